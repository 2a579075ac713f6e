#!/usr/bin/env python3
"""How llama.cpp's server batches decodes in different slots: what `micro_batches =
"slot_runs"` in the simulator's cost model describes.

With a KV stream per slot (`kv_unified = false`, the server's default for several slots),
llama.cpp cuts a batch with `split_equal` in sequential mode: a micro-batch holds only
sequences whose ids (slots) follow one another. Decodes in slots 0-3 run as one pass;
decodes in slots 0, 4, 8 and 12 as four, each reading all the weights.

Start the server as the black-box loop does, then run this against it:

    llama-server -m MODEL.gguf --port 8411 -np 16 -c 65536 -b 2048 -ub 512 -t 2 --cache-ram 0
    python3 scripts/llama_slot_passes.py [http://127.0.0.1:8411]

Each set of slots decodes 64 tokens per sequence, all at once, twice; the figure is the
server's own time per generated token (`timings.predicted_per_token_ms`), averaged over the
sequences.
"""
import json
import sys
import threading
import urllib.request

URL = (sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8411") + "/completion"
SLOT_SETS = [
    [0],
    [0, 1, 2, 3],
    [0, 4, 8, 12],
    [0, 1, 2, 3, 4, 5, 6, 7],
    [0, 2, 4, 6, 8, 10, 12, 14],
    [0, 1, 2, 3, 8, 9, 10, 11],
]


def decode(slot: int, out: dict) -> None:
    body = json.dumps(
        {
            "prompt": [1] + [100 + slot] * 31,
            "n_predict": 64,
            "id_slot": slot,
            "ignore_eos": True,
            "cache_prompt": False,
        }
    ).encode()
    req = urllib.request.Request(URL, body, {"Content-Type": "application/json"})
    out[slot] = json.loads(urllib.request.urlopen(req).read())["timings"]["predicted_per_token_ms"]


def runs(slots: list) -> int:
    return sum(1 for i, s in enumerate(slots) if i == 0 or s != slots[i - 1] + 1)


def main() -> None:
    print(f"{'slots':<28} {'runs':>4} {'ms per token':>13} {'ms per token':>13}")
    for slots in SLOT_SETS:
        ms = []
        for _ in range(2):
            out: dict = {}
            threads = [threading.Thread(target=decode, args=(s, out)) for s in slots]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            ms.append(sum(out.values()) / len(out))
        print(f"{str(slots):<28} {runs(slots):>4} {ms[0]:>13.1f} {ms[1]:>13.1f}")


if __name__ == "__main__":
    main()
