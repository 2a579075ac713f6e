#!/usr/bin/env python3
"""vLLM's `prompt_logprobs` from `engine serve` against Hugging Face transformers on the
same safetensors: each prompt token's logprob, its rank in the vocabulary, and the k most
likely tokens at each position.

    pip install torch transformers
    engine serve --model DIR &                      # DIR: a model directory, f32
    python3 scripts/prompt_logprobs_check.py DIR [BASE_URL] [K]

Prints the largest logprob difference and the positions whose rank or top-k ids differ;
exits non-zero on any rank or top-k mismatch, or a difference above 1e-4.
"""
import json
import sys
import urllib.request

import torch
import transformers

model_dir = sys.argv[1]
base = sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:8000"
k = int(sys.argv[3]) if len(sys.argv) > 3 else 3
# Token ids, so that both sides score exactly the same sequence.
ids = [1] + [(i * 37 + 11) % 2000 + 5 for i in range(200)]
body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": k}
req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                             headers={"content-type": "application/json"})
served = json.load(urllib.request.urlopen(req))["choices"][0]["prompt_logprobs"]
model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
with torch.no_grad():
    lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
worst, rank_misses, top_misses = 0.0, [], []
for pos in range(1, len(ids)):
    row, token, entry = lp[pos - 1], ids[pos], served[pos]
    own = entry[str(token)]
    worst = max(worst, abs(own["logprob"] - row[token].item()))
    # vLLM's rank: the tokens at least as likely, itself included.
    if own["rank"] != int((row >= row[token]).sum()):
        rank_misses.append(pos)
    # The served alternatives by their rank: the k most likely (the prompt's own token
    # among them carries its own rank, the same).
    by_rank = {e["rank"]: int(t) for t, e in entry.items() if e["rank"] <= k}
    if [by_rank.get(r) for r in range(1, k + 1)] != torch.topk(row, k).indices.tolist():
        top_misses.append(pos)
print(f"{len(ids) - 1} positions, k={k}: max |logprob - transformers| {worst:.2e}; "
      f"rank mismatches {len(rank_misses)} {rank_misses[:5]}; top-{k} mismatches "
      f"{len(top_misses)} {top_misses[:5]}")
sys.exit(0 if worst < 1e-4 and not rank_misses and not top_misses else 1)
