"""The black-box loop's last step: each workload's prediction (OUT/predicted/W) against the
mean of its measured repeats (OUT/measured/W, OUT/measured-2/W, ...), and the repeats'
spread, (max - min) / mean: how far the measurement itself moves on this machine; and how
many of the repeats fell inside the prediction's 90% interval (its summary.json's `KEY_lo`
and `KEY_hi`: `sim run`'s seeds and the calibration's recorded errors on the probes).
Last, how many measured requests failed or ended before the length the workload gave them
(a server that refuses `ignore_eos` stops where the model ends an output; the simulation
runs every output to its length), and how many streamed fewer chunks than tokens: a server
that holds text ending mid-character back (llama.cpp's, transformers') sends such tokens late,
together, so the client's TTFT and gaps time the holding (`engine bench --whole-characters`
bans those tokens). A request's chunks are counted from its timeline: its gaps,
(e2e - TTFT) / mean ITL (the stream's end follows its last chunk at once), plus one.

    python3 scripts/blackbox_compare.py OUT REPEATS WORKLOAD...
"""
import csv
import json
import sys

METRICS = ["output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms"]


def median(values):
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def main(out, repeats, workloads):
    dirs = ["measured"] + [f"measured-{r}" for r in range(2, repeats + 1)]

    def load(d, w):
        with open(f"{out}/{d}/{w}/summary.json") as f:
            return json.load(f)

    print(f"{'workload':<20} {'metric':<18} {'measured':>10} {'repeats':>22} "
          f"{'predicted':>10} {'error%':>7} {'spread%':>8} {'in 90%':>7}")
    errors, spreads, inside = {}, {}, {}
    for w in workloads:
        p = load("predicted", w)
        runs = [load(d, w) for d in dirs]
        for k in METRICS:
            m = [r[k] for r in runs]
            mean = sum(m) / len(m)
            if mean == 0:  # every request failed: nothing to compare
                print(f"{w:<20} {k:<18} measured 0 in every repeat")
                continue
            err = (p[k] - mean) / mean * 100
            spread = (max(m) - min(m)) / mean * 100
            errors.setdefault(k, []).append(abs(err))
            spreads.setdefault(k, []).append(spread)
            shown = "/".join(f"{v:.1f}" for v in m)
            covered = "-"
            if f"{k}_lo" in p:
                hits = sum(p[f"{k}_lo"] <= v <= p[f"{k}_hi"] for v in m)
                width = (p[f"{k}_hi"] - p[f"{k}_lo"]) / p[k] * 100
                inside.setdefault(k, []).append((hits, len(m), width))
                covered = f"{hits}/{len(m)}"
            print(f"{w:<20} {k:<18} {mean:>10.1f} {shown:>22} {p[k]:>10.1f} "
                  f"{err:>+7.0f} {spread:>8.0f} {covered:>7}")
    print("median |error| against the repeats' mean:",
          ", ".join(f"{k} {median(v):.0f}%" for k, v in errors.items()))
    if repeats > 1:
        print("median spread of the repeats:",
              ", ".join(f"{k} {median(v):.0f}%" for k, v in spreads.items()))
    if inside:
        rows = [r for v in inside.values() for r in v]
        hits, n = sum(r[0] for r in rows), sum(r[1] for r in rows)
        print(f"measurements inside the prediction's 90% interval: {hits} of {n} "
              f"({hits / n * 100:.0f}%), median width {median([r[2] for r in rows]):.0f}%;",
              ", ".join(f"{k} {sum(r[0] for r in v)}/{sum(r[1] for r in v)}"
                        for k, v in inside.items()))
    short, failed, total, held, chunks, tokens = 0, 0, 0, 0, 0, 0
    for w in workloads:
        with open(f"{out}/predicted/{w}/requests.csv") as f:
            wanted = {r["id"]: int(r["output_tokens"]) for r in csv.DictReader(f)}
        for d in dirs:
            with open(f"{out}/{d}/{w}/requests.csv") as f:
                for r in csv.DictReader(f):
                    total += 1
                    if r["success"] != "true":
                        failed += 1
                    elif int(r["output_tokens"]) < wanted.get(r["id"], 0):
                        short += 1
                    if r["success"] == "true" and r["itl_mean_ms"]:
                        n = int(r["output_tokens"])
                        seen = round((float(r["e2e_ms"]) - float(r["ttft_ms"]))
                                     / float(r["itl_mean_ms"])) + 1
                        chunks, tokens = chunks + min(seen, n), tokens + n
                        held += seen < n
    print(f"measured requests: {total}, {failed} failed, {short} ended before their length, "
          f"{held} streamed fewer chunks than tokens ({chunks} chunks for {tokens} tokens)")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
