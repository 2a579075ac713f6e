#!/usr/bin/env python3
"""Writes scenarios/traces/sharegpt_sample.json: a small conversation trace in ShareGPT's
JSON layout, generated for this project from its own corpus (core/corpus, CC0), so that
trace replay has a fixture with real text and no third-party data.

Ten conversations of one to four turns (25 turns): each is about one corpus text; a user
message asks about a sentence of it, the reply is the passage that follows. The first has a
system prompt. Deterministic (fixed seed); run from anywhere:

    python3 scripts/make_sharegpt_sample.py
"""
import json
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [
    "Can you explain this part to me: \"{s}\"",
    "I read that \"{s}\" What does that mean in practice?",
    "Tell me more about this: \"{s}\"",
    "Why would someone say \"{s}\"",
    "Could you expand on \"{s}\" with an example or two?",
]
FOLLOW_UPS = [
    "That helps. What comes next?",
    "Interesting. Can you go on?",
    "And after that?",
    "Thanks. Is there more to it?",
]


def sentences(text):
    flat = " ".join(text.split())
    return [s for s in re.split(r"(?<=[.!?])\s+", flat) if len(s.split()) >= 5]


def main():
    rng = random.Random(2026)
    texts = sorted((ROOT / "core" / "corpus").glob("*.txt"))
    turns_per_chat = [3, 1, 4, 2, 3, 1, 2, 4, 2, 3]
    out = []
    for i, turns in enumerate(turns_per_chat):
        sents = sentences(texts[i % len(texts)].read_text())
        at = rng.randrange(0, max(1, len(sents) - 40))
        messages = []
        if i == 0:
            messages.append({"from": "system", "value": "You are a patient assistant who answers in plain words."})
        for t in range(turns):
            if t == 0:
                question = rng.choice(QUESTIONS).format(s=sents[at])
            else:
                question = rng.choice(FOLLOW_UPS)
            n = rng.randint(2, 7)
            reply = " ".join(sents[at + 1 : at + 1 + n])
            at += 1 + n
            messages.append({"from": "human", "value": question})
            messages.append({"from": "gpt", "value": reply})
        out.append({"id": f"infer-sample-{i}", "conversations": messages})
    path = ROOT / "scenarios" / "traces" / "sharegpt_sample.json"
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path} ({len(out)} conversations, {sum(turns_per_chat)} turns)")


if __name__ == "__main__":
    main()
