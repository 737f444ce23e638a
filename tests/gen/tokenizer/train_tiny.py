#!/usr/bin/env python3
"""train_tiny.py: builds tests/data/tiny/tokenizer.json, a small GLM-like byte-level BPE for the
bundled tiny model (vocab_size 1024), and tests/data/tiny/tokenizer_config.json (chat template
from tests/data/templates/GLM-5.2.jinja).

Layout of the 1024 ids: 0..15 added tokens (GLM specials), 16..271 the 256 byte tokens, 272..1023
merges learned greedily (classic BPE: most frequent adjacent pair, ties by first occurrence) over
English text split with the same GLM Split regex the tokenizer uses.

usage: python3 tests/gen/tokenizer/train_tiny.py [TEXT_FILE...]   (run from the repo root;
default text: the GPL-3 and Apache-2.0 licence texts of /usr/share/common-licenses)
Needs the `regex` module (for \\p{L})."""
import collections
import json
import sys

import regex

VOCAB = 1024
SPECIALS = [  # (content, special)
    ("[gMASK]", True), ("<|endoftext|>", True), ("<sop>", True), ("<eop>", True),
    ("<|system|>", True), ("<|user|>", True), ("<|assistant|>", True), ("<|observation|>", True),
    ("<think>", False), ("</think>", False), ("<tool_call>", False), ("</tool_call>", False),
    ("<arg_key>", False), ("</arg_key>", False), ("<arg_value>", False), ("</arg_value>", False),
]
GLM_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def bytes_to_unicode():
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def main():
    files = sys.argv[1:] or ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0"]
    text = "".join(open(f, encoding="utf-8").read() for f in files)
    b2u = bytes_to_unicode()
    words = collections.Counter(regex.findall(GLM_RE, text))
    # each word: tuple of token strings (byte-level chars)
    seqs = {w: tuple(b2u[b] for b in w.encode()) for w in words}
    vocab = {}
    base = len(SPECIALS)
    # the added tokens are also vocabulary entries: Hugging Face keeps an added token's id only
    # when its content is in model.vocab (else it appends it after the vocabulary)
    for i, (c, _) in enumerate(SPECIALS):
        vocab[c] = i
    for b in range(256):
        vocab[b2u[b]] = base + b
    merges = []
    next_id = base + 256
    while next_id < VOCAB:
        pairs = collections.Counter()
        for w, s in seqs.items():
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: kv[1])[0]  # first max in insertion order
        merged = best[0] + best[1]
        merges.append([best[0], best[1]])
        vocab[merged] = next_id
        next_id += 1
        for w, s in seqs.items():
            if len(s) < 2:
                continue
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == best[0] and s[i + 1] == best[1]:
                    out.append(merged)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = tuple(out)
    added = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": sp} for i, (c, sp) in enumerate(SPECIALS)]
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": GLM_RE}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }
    with open("tests/data/tiny/tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False, indent=1)
        f.write("\n")
    template = open("tests/data/templates/GLM-5.2.jinja", encoding="utf-8").read()
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512,
           "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False,
           "do_lower_case": False, "remove_space": False,
           "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in a if k != "id"} for a in added},
           "chat_template": template}
    with open("tests/data/tiny/tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=2)
        f.write("\n")
    print(f"vocab {len(vocab)} ids, {len(merges)} merges", file=sys.stderr)


if __name__ == "__main__":
    main()
