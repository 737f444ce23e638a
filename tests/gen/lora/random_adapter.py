"""A random LoRA adapter in PEFT's format for a model's config.json (benchmarks of GLM-5.2 shapes:
the real model's adapters are not at hand). No numpy needed.

Usage: python3 random_adapter.py CONFIG.json OUTDIR [R] [TARGETS,...] [LAYERS]
  TARGETS: q_a_proj,q_b_proj,kv_b_proj,o_proj (the default); LAYERS: how many (default: all)."""
import json, os, random, struct, sys
cfg = json.load(open(sys.argv[1]))
out = sys.argv[2]
r = int(sys.argv[3]) if len(sys.argv) > 3 else 16
targets = sys.argv[4].split(",") if len(sys.argv) > 4 else ["q_a_proj", "q_b_proj", "kv_b_proj", "o_proj"]
L = int(sys.argv[5]) if len(sys.argv) > 5 else cfg["num_hidden_layers"]
H, NH = cfg["hidden_size"], cfg["num_attention_heads"]
dq = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
shape = {"q_a_proj": (cfg["q_lora_rank"], H), "q_b_proj": (NH * dq, cfg["q_lora_rank"]),
         "kv_a_proj_with_mqa": (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], H),
         "kv_b_proj": (NH * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]),
         "o_proj": (H, NH * cfg["v_head_dim"])}
os.makedirs(out, exist_ok=True)
rng = random.Random(1)
hdr, blobs, off = {}, [], 0
for l in range(L):
    for t in targets:
        o, i = shape[t]
        for ab, (rows, cols) in (("A", (r, i)), ("B", (o, r))):
            n = rows * cols
            scale = 0.02 if ab == "A" else 0.01
            b = struct.pack("<%de" % n, *[(rng.random() - 0.5) * scale for _ in range(n)])
            hdr[f"base_model.model.model.layers.{l}.self_attn.{t}.lora_{ab}.weight"] = {"dtype": "F16", "shape": [rows, cols], "data_offsets": [off, off + len(b)]}
            blobs.append(b); off += len(b)
h = json.dumps(hdr).encode(); h += b" " * (-len(h) % 8)
with open(os.path.join(out, "adapter_model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(h))); f.write(h)
    for b in blobs: f.write(b)
json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": targets, "bias": "none"},
          open(os.path.join(out, "adapter_config.json"), "w"))
print(out, "r", r, "targets", targets, "layers", L, off / 1e6, "MB")
