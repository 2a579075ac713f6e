#!/usr/bin/env python3
"""A running server against an independent implementation: many concurrent greedy requests of
different lengths through `engine serve` (or any OpenAI-compatible server that takes token-id
prompts and vLLM's `return_tokens_as_token_ids`), each checked position by position against
Hugging Face transformers (PyTorch, float32) on the very safetensors the server loaded.

oracle_check.py checks the model runner with batches it composes; this checks the served path
as users meet it: the scheduler's batches, chunked prefill, prefix-cache hits (a third of the
requests share one of two long prefixes), preemption and recompute (start the server with a
small KV pool), decode splits and CUDA graphs, all at once. Each request asks for --decode
greedy tokens with the top --logprobs logprobs; the oracle then runs each prompt followed by
the server's own tokens in one forward pass (teacher-forced on the server's choices, so one
early divergence does not hide the rest) and per position compares:

  mismatch     the server's token is not the oracle's argmax;
  unexplained  such a mismatch where the oracle's top-2 margin exceeds --tol (a clear winner,
               not a near tie that rounding may flip): a failure;
  lp err       |server logprob - oracle log-softmax| over every id the server listed (its
               token and its top list).

--tol defaults to 0.1 logits (a bf16 engine on a GPU: see oracle_check.py) or 1e-3 with
--f32 (the CPU backend). The server's prefix-cache hits and preemptions during the run are read
from its /metrics and reported; --require-prefix-hits / --require-preemption fail the run when
the load did not cause them. Exit status 1 on any unexplained mismatch or unmet requirement.

  engine serve --model DIR --num-gpu-blocks 96 --port 8000 &
  python3 scripts/served_oracle.py --server http://127.0.0.1:8000 --model DIR --f32 \\
      --prompt-lens 64,200,600 --requests 24 --decode 16 --out runs/served-oracle
"""

import argparse
import json
import os
import re
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from oracle_check import log_softmax, top2_margin


def post(url, body, timeout):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def counters(server):
    """The server's prefix-cache hits and preemptions so far (0 where it does not say)."""
    try:
        with urllib.request.urlopen(server + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for key, name in [("prefix_hits", "vllm:prefix_cache_hits_total"),
                      ("preemptions", "vllm:num_preemptions_total")]:
        values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        out[key] = sum(float(v) for v in values)
    return out


def token_id(name):
    if not name.startswith("token_id:"):
        raise ValueError(f"the server named a token {name!r}: it must honour "
                         "return_tokens_as_token_ids")
    return int(name[len("token_id:"):])


def make_prompts(rng, lens, n, vocab):
    """n prompts cycling through lens; every third request starts with one of two shared
    prefixes (half its length, at most half the longest prompt) so prefix hits happen."""
    longest = max(lens)
    shared = [rng.integers(3, vocab, size=longest // 2).tolist() for _ in range(2)]
    prompts = []
    for i in range(n):
        length = lens[i % len(lens)]
        ids = rng.integers(3, vocab, size=length).tolist()
        if i % 3 == 0:
            k = length // 2
            ids[:k] = shared[(i // 3) % 2][:k]
        prompts.append(ids)
    return prompts


def ask(server, model_name, prompt, decode, logprobs, timeout):
    body = {"model": model_name, "prompt": prompt, "max_tokens": decode, "temperature": 0,
            "logprobs": logprobs, "ignore_eos": True, "return_tokens_as_token_ids": True}
    r = post(server + "/v1/completions", body, timeout)
    lp = r["choices"][0]["logprobs"]
    tokens = [token_id(t) for t in lp["tokens"]]
    chosen = lp["token_logprobs"]
    tops = [{token_id(k): v for k, v in top.items()} for top in lp["top_logprobs"]]
    if len(tokens) != decode:
        raise RuntimeError(f"asked for {decode} tokens, got {len(tokens)}")
    return tokens, chosen, tops


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", required=True, help="the server's base URL")
    ap.add_argument("--model", required=True, help="the Hugging Face directory the server loaded")
    ap.add_argument("--torch-device", default="cpu", help="where transformers runs")
    ap.add_argument("--prompt-lens", default="128,1024,4096")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=48, help="requests in flight at once")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--logprobs", type=int, default=5, help="top logprobs per position (<= 20)")
    ap.add_argument("--f32", action="store_true", help="the server computes in f32 (tol 1e-3)")
    ap.add_argument("--tol", type=float, default=None, help="top-2 margin below which a flip is a tie")
    ap.add_argument("--require-prefix-hits", action="store_true")
    ap.add_argument("--require-preemption", action="store_true")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="", help="a name for this run in the report")
    ap.add_argument("--out", required=True, help="folder for the report")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tol = a.tol if a.tol is not None else (1e-3 if a.f32 else 0.1)
    server = a.server.rstrip("/")

    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    model = model.to(a.torch_device).eval()
    vocab = model.config.get_text_config().vocab_size
    with urllib.request.urlopen(server + "/v1/models", timeout=30) as r:
        model_name = json.loads(r.read())["data"][0]["id"]
    lens = [int(x) for x in a.prompt_lens.split(",")]
    prompts = make_prompts(np.random.default_rng(a.seed), lens, a.requests, vocab)

    before = counters(server)
    t0 = time.time()
    with ThreadPoolExecutor(a.concurrency) as pool:
        answers = list(pool.map(lambda p: ask(server, model_name, p, a.decode, a.logprobs, a.timeout),
                                prompts))
    served_s = time.time() - t0
    after = counters(server)
    load = {k: after[k] - before.get(k, 0) for k in after}
    print(f"served {a.requests} requests in {served_s:.1f} s; during the run: "
          + ", ".join(f"{k} {v:g}" for k, v in load.items()), flush=True)

    groups = {}
    worst = None
    t0 = time.time()
    with torch.no_grad():
        for i, (prompt, (tokens, chosen, tops)) in enumerate(zip(prompts, answers)):
            ids = torch.tensor([prompt + tokens[:-1]], dtype=torch.long, device=a.torch_device)
            logits = model(input_ids=ids, logits_to_keep=a.decode).logits[0].float().cpu().numpy()
            want = log_softmax(logits)
            margin = top2_margin(logits)
            mismatch = logits.argmax(axis=-1) != np.array(tokens)
            unexplained = mismatch & (margin > tol)
            err = 0.0
            for j, (tok, lp, top) in enumerate(zip(tokens, chosen, tops)):
                err = max(err, abs(lp - want[j, tok]), *(abs(v - want[j, t]) for t, v in top.items()))
            g = groups.setdefault(len(prompt), {"requests": 0, "positions": 0, "mismatch": 0,
                                                "unexplained": 0, "max_lp_err": 0.0})
            g["requests"] += 1
            g["positions"] += len(tokens)
            g["mismatch"] += int(mismatch.sum())
            g["unexplained"] += int(unexplained.sum())
            g["max_lp_err"] = max(g["max_lp_err"], err)
            if unexplained.any() and worst is None:
                j = int(np.argmax(unexplained))
                worst = {"request": i, "prompt_len": len(prompt), "position": j,
                         "server": tokens[j], "oracle": int(logits[j].argmax()),
                         "margin": float(margin[j])}
    print(f"oracle: {time.time() - t0:.1f} s", flush=True)

    failed = any(g["unexplained"] for g in groups.values())
    problems = []
    if a.require_prefix_hits and not load.get("prefix_hits"):
        problems.append("no prefix-cache hit during the run")
    if a.require_preemption and not load.get("preemptions"):
        problems.append("no preemption during the run")
    for p in problems:
        print(f"unmet: {p}", file=sys.stderr)
    if worst:
        print(f"first unexplained mismatch: {json.dumps(worst)}", file=sys.stderr)
    label = a.label or f"{os.path.basename(os.path.normpath(a.model))} served at {server}"
    report = {"label": label, "tol": tol, "requests": a.requests, "decode": a.decode,
              "served_s": served_s, "load": load, "groups": groups, "problems": problems,
              "first_unexplained": worst}
    with open(os.path.join(a.out, "served-oracle.json"), "a") as f:
        f.write(json.dumps(report) + "\n")
    with open(os.path.join(a.out, "served-oracle.md"), "a") as f:
        f.write(f"\n### {label} (tolerance {tol} logits)\n\n"
                f"{a.requests} concurrent requests, {a.decode} greedy tokens each, top "
                f"{a.logprobs} logprobs; during the run: "
                + ", ".join(f"{k} {v:g}" for k, v in load.items()) + "\n\n"
                "| prompt tokens | requests | greedy mismatches | unexplained (margin > tol) "
                "| max logprob error |\n|---|---|---|---|---|\n")
        for length, g in sorted(groups.items()):
            f.write(f"| {length} | {g['requests']} | {g['mismatch']} / {g['positions']} | "
                    f"{g['unexplained']} | {g['max_lp_err']:.3g} |\n")
    for length, g in sorted(groups.items()):
        print(json.dumps({"prompt_len": length, **g}))
    sys.exit(1 if failed or problems else 0)


if __name__ == "__main__":
    main()
