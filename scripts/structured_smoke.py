#!/usr/bin/env python3
"""Structured output under concurrent load, checked exactly, with the standard library only
(the GPU machine has no openai or jsonschema).

    python3 scripts/structured_smoke.py BASE_URL [REQUESTS]

Sends REQUESTS (default 24) completions at once: a third constrained to a choice of three
words, a third to a regular expression, a third free, so each step mixes constrained and
unconstrained rows (with `--device-sampling` the grammars' masks go to the GPU with their
rows). Every constrained answer must be exactly one of the choices or match the expression
in full; every request must succeed. Exits 1 otherwise.
"""

import json
import re
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

CHOICES = ["alpha", "bravo", "charlie"]
PATTERN = r"[0-9]{3}-[a-z]{4}"


def post(base: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"{base}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    base = sys.argv[1].rstrip("/")
    n = int(sys.argv[2]) if len(sys.argv) == 3 else 24
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
        model = json.load(r)["data"][0]["id"]

    def one(i: int) -> tuple[str, bool, str]:
        body = {
            "model": model,
            "prompt": f"Request {i}: the answer is",
            "max_tokens": 24,
            "temperature": 0.0 if i % 2 == 0 else 0.8,
            "seed": i,
        }
        kind = ("choice", "regex", "free")[i % 3]
        if kind == "choice":
            body["structured_outputs"] = {"choice": CHOICES}
        elif kind == "regex":
            body["structured_outputs"] = {"regex": PATTERN}
        try:
            text = post(base, body)["choices"][0]["text"]
        except Exception as e:  # noqa: BLE001 - any failure is reported as such
            return kind, False, f"request {i}: {e}"
        ok = {
            "choice": text in CHOICES,
            "regex": re.fullmatch(PATTERN, text) is not None,
            "free": True,
        }[kind]
        return kind, ok, f"request {i} ({kind}): {text!r}"

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    failed = [detail for _, ok, detail in results if not ok]
    for kind in ("choice", "regex", "free"):
        got = [r for r in results if r[0] == kind]
        print(f"structured_smoke[{kind}]: {sum(ok for _, ok, _ in got)}/{len(got)} ok")
    for detail in failed:
        print(f"FAIL {detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
