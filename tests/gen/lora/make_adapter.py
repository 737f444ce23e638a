"""Train a PEFT LoRA adapter on a GLM-5-architecture checkpoint and write reference logits of the
adapted model (the test data of tests/test_lora.c). Runs on the accelerator machine, which has
torch, transformers >= 5.17 and peft; the outputs are copied into tests/data/lora-*/.

Usage: python3 make_adapter.py SPEC.json BASE_DIR CORPUS.txt OUTDIR

SPEC.json: {"seed": int, "r": int, "alpha": float, "targets": [...] or "regex", "rank_pattern": {},
            "alpha_pattern": {}, "use_rslora": bool, "seconds": 30, "save_dtype": "f32"|"bf16"|"f16",
            "prompts": ["text", ...] (a base with a tokenizer) or [[ids], ...]}

OUTDIR receives adapter_config.json and adapter_model.safetensors as PEFT's save_pretrained writes
them (save_dtype other than f32: the tensors re-saved in that type; the trained values are rounded
to bf16 first, so every type holds them exactly), and golden.safetensors: prompt_N.ids (i32 [T]),
prompt_N.logits (f32 [T, V], the adapted model in float64 with eager attention) and
prompt_N.base_logits. Prompts are cut to index_topk tokens, so DSA keeps every key.
"""
import json, os, sys, time
import torch
import torch.nn.functional as F
from transformers import GlmMoeDsaForCausalLM
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file, load_file

spec = json.load(open(sys.argv[1]))
base, corpus, out = sys.argv[2], sys.argv[3], sys.argv[4]
os.makedirs(out, exist_ok=True)
torch.manual_seed(spec["seed"])
tok = None
if os.path.exists(os.path.join(base, "tokenizer.json")):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(base, "tokenizer.json"))
model = GlmMoeDsaForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager").cuda()
cfg = model.config
V = cfg.vocab_size
if tok is not None and not spec.get("random_data"):
    data = torch.tensor(tok.encode(open(corpus, encoding="utf-8").read()).ids, dtype=torch.long)
else:
    data = torch.randint(0, V, (200000,), generator=torch.Generator().manual_seed(spec["seed"]))
lcfg = LoraConfig(r=spec.get("r", 8), lora_alpha=spec.get("alpha", 16), lora_dropout=0.0,
                  target_modules=spec["targets"], rank_pattern=spec.get("rank_pattern", {}),
                  alpha_pattern=spec.get("alpha_pattern", {}), use_rslora=spec.get("use_rslora", False),
                  bias="none", init_lora_weights=spec.get("init", True))
pm = get_peft_model(model, lcfg)
pm.print_trainable_parameters()
opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=spec.get("lr", 3e-3))
SEQ, B = 64, 32
g = torch.Generator().manual_seed(spec["seed"])
t0, step, losses = time.time(), 0, []
pm.train()
while time.time() - t0 < spec.get("seconds", 30):
    s = torch.randint(0, len(data) - SEQ - 1, (B,), generator=g)
    x = torch.stack([data[i: i + SEQ + 1] for i in s]).cuda()
    lg = pm(input_ids=x[:, :SEQ], use_cache=False).logits
    loss = F.cross_entropy(lg.float().reshape(-1, lg.shape[-1]), x[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    if step % 20 == 0:
        losses.append(round(loss.item(), 4)); print(step, losses[-1], flush=True)
    step += 1
pm.eval()
with torch.no_grad():
    for n, p in pm.named_parameters():
        if "lora_" in n:
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
pm.save_pretrained(out)
dt = {"f32": None, "bf16": torch.bfloat16, "f16": torch.float16}[spec.get("save_dtype", "f32")]
if dt is not None:
    p = os.path.join(out, "adapter_model.safetensors")
    t = load_file(p)
    save_file({k: v.to(dt).contiguous() for k, v in t.items()}, p, metadata={"format": "pt"})
gold = {}
pm = pm.to(torch.float64).cpu()
topk = cfg.index_topk
with torch.no_grad():
    for n, t in enumerate(spec["prompts"]):
        ids = (tok.encode(t).ids if isinstance(t, str) else list(t))[:topk]
        x = torch.tensor([ids])
        gold[f"prompt_{n}.ids"] = torch.tensor(ids, dtype=torch.int32)
        gold[f"prompt_{n}.logits"] = pm(input_ids=x, use_cache=False).logits[0].float().contiguous()
        with pm.disable_adapter():
            gold[f"prompt_{n}.base_logits"] = pm(input_ids=x, use_cache=False).logits[0].float().contiguous()
save_file(gold, os.path.join(out, "golden.safetensors"))
shift = [float((gold[f"prompt_{n}.logits"] - gold[f"prompt_{n}.base_logits"]).norm() / gold[f"prompt_{n}.base_logits"].norm())
         for n in range(len(spec["prompts"]))]
json.dump({"spec": spec, "steps": step, "losses": losses, "adapter_vs_base_rel_l2": shift,
           "modules": sorted({k.rsplit(".lora_", 1)[0] for k in load_file(os.path.join(out, "adapter_model.safetensors"))})},
          open(os.path.join(out, "golden.json"), "w"), indent=1)
print("done", step, "steps; adapter moves logits by", shift, flush=True)
