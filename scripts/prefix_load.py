#!/usr/bin/env python3
"""Prefix-sharing load for a router in front of replicas (standard library only).

8 documents of ~500 tokens, each asked 6 questions, in rounds of one question per document
(4 requests at a time), so every document's first request comes before its others. Prints
the fraction of prompt tokens the replicas served from their prefix caches, from each
response's `usage.prompt_tokens_details.cached_tokens`.

usage: python3 scripts/prefix_load.py http://127.0.0.1:8500
"""
import concurrent.futures
import json
import random
import sys
import urllib.request

url = sys.argv[1].rstrip("/")
model = json.load(urllib.request.urlopen(url + "/v1/models", timeout=30))["data"][0]["id"]
random.seed(1)
words = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango").split()
docs = [" ".join(random.choice(words) for _ in range(160)) for _ in range(8)]


def ask(prompt):
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    usage = json.load(urllib.request.urlopen(req, timeout=120))["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


total = cached = 0
for q in range(6):
    prompts = [d + f" question {q}: what is {random.choice(words)} {random.choice(words)}?"
               for d in docs]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for p, c in pool.map(ask, prompts):
            total += p
            cached += c
print(f"prompt_tokens {total} cached_tokens {cached} hit_rate {cached / total:.3f}")
