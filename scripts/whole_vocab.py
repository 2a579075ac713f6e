"""A generated model whose every token id streams as whole text, for servers whose stream
shows only whole text (transformers' `DecodeStream`): MODEL_DIR's config and weights
(linked, not copied) with its tokenizer's vocabulary filled up to the model's `vocab_size`
by plain-text tokens `<wN>` (N the id; not special, so every server prints them).

The generated models train a byte-level tokenizer on a small corpus: 3,043 entries for a
32,768-id model, and a random-weight model mostly generates the ids beyond them, which
transformers' stream drops (nothing is sent for them). The tokenizer's own entries, and so
the prompts, are unchanged; only the filled ids decode to text where they decoded to
nothing. Tokens that are part of a character stay (a server holds them back until the
character completes; `engine bench --whole-characters` bans them where the server honours
`logit_bias`).

    python3 scripts/whole_vocab.py MODEL_DIR OUT_DIR
"""
import json
import os
import shutil
import sys


def main(src, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    for name in os.listdir(src):
        if name in ("tokenizer.json", "tokenizer_config.json"):
            continue
        dst = os.path.join(out, name)
        if os.path.lexists(dst):
            os.remove(dst)
        if name.endswith(".safetensors"):
            os.symlink(os.path.abspath(os.path.join(src, name)), dst)
        else:
            shutil.copy(os.path.join(src, name), dst)
    with open(os.path.join(src, "tokenizer.json")) as f:
        tok = json.load(f)
    used = set(tok["model"]["vocab"].values()) | {t["id"] for t in tok["added_tokens"]}
    filled = [
        {"id": i, "content": f"<w{i}>", "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": False}
        for i in range(vocab_size) if i not in used
    ]
    tok["added_tokens"] += filled
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tok, f, ensure_ascii=False)
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    decoder = cfg.setdefault("added_tokens_decoder", {})
    for t in filled:
        decoder[str(t["id"])] = {k: v for k, v in t.items() if k != "id"}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=1)
    print(f"{out}: {len(filled)} ids filled ({len(used)} in the tokenizer, vocab_size {vocab_size})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
