#!/usr/bin/env python3
"""The engine's model runner against an independent implementation: Hugging Face transformers
(PyTorch, float32) on the very safetensors the engine loads.

For each case (prompt length x batch) the oracle draws prompts of random token ids, decodes
greedily for --decode tokens and keeps the logits of each position; the engine's runner
(engine/examples/oracle_run.rs) is fed the same prompts and the oracle's tokens (teacher
forcing) and returns its logits at the same positions. Per case it reports:

  max_abs   the largest |engine - oracle| logit over every row;
  max_rel   that, over the largest |oracle logit| of the row;
  mismatch  positions where the engine's greedy token differs from the oracle's;
  unexplained  those of them whose oracle top-2 margin exceeds --tol: a near tie may flip
            under rounding, a clear winner may not.

--tol defaults to 0.1 logits for a bf16 engine: bf16 keeps 8 significant bits, so a logit of
magnitude 25 is already uncertain by 25 * 2^-8 = 0.1 from its last rounding alone (and 1e-3
for an f32 engine, i.e. the CPU backend). Exit status 1 when any case has an unexplained
mismatch, 0 otherwise.

  python3 scripts/oracle_check.py --model DIR --runner target/release/examples/oracle_run \\
      --device cpu --prompt-lens 128,1024 --batches 1,4 --decode 16 --out runs/oracle
On a GPU: --device cuda --torch-device cuda (and --cuda-graphs: every case eager and graphed).
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def oracle_logits(model, prompts, decode, device):
    """Greedy decoding from each prompt: the D logits rows per sequence (row j predicts token
    L + j) and the D greedy tokens, as [B, D, V] and [B, D]. One sequence at a time: the
    oracle's own batching is not under test, and a [32, 4096] f32 prompt would not fit."""
    all_rows, all_tokens = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], dtype=torch.long, device=device)
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            rows, tokens = [], []
            for j in range(decode):
                logits = out.logits[0, -1, :].float()
                rows.append(logits.cpu().numpy())
                nxt = int(logits.argmax())
                tokens.append(nxt)
                if j + 1 < decode:
                    step = torch.tensor([[nxt]], dtype=torch.long, device=device)
                    out = model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
            all_rows.append(np.stack(rows))
            all_tokens.append(np.array(tokens))
    return np.stack(all_rows), np.stack(all_tokens)


def log_softmax(rows):
    rows = rows.astype(np.float64)
    shifted = rows - rows.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def top2_margin(rows):
    part = np.partition(rows, -2, axis=-1)
    return part[..., -1] - part[..., -2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face directory (config.json + safetensors)")
    ap.add_argument("--runner", required=True, help="the oracle_run example binary")
    ap.add_argument("--device", default="cpu", help="the engine's device: cpu or cuda")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="also run every case with decode steps replayed from CUDA graphs")
    ap.add_argument("--torch-device", default="cpu", help="where transformers runs")
    ap.add_argument("--prompt-lens", default="128,1024,4096")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512, help="the engine's prefill chunk")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engine's KV cache: auto or fp8")
    ap.add_argument("--max-mean-kl", type=float, default=None,
                    help="fail a case whose mean KL(oracle || engine) exceeds this (nats): the "
                         "judge of a lossy KV cache, with --tol inf to report flips only")
    ap.add_argument("--tol", type=float, default=None, help="top-2 margin below which a flip is a tie")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="", help="a name for this run in the report")
    ap.add_argument("--out", required=True, help="folder for the report (and scratch files)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tol = a.tol if a.tol is not None else (1e-3 if a.device == "cpu" else 0.1)

    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    model = model.to(a.torch_device).eval()
    vocab = model.config.get_text_config().vocab_size
    rng = np.random.default_rng(a.seed)
    # The oracle first, every case; then the engine, all cases in one process per mode.
    cases = []
    for length in [int(x) for x in a.prompt_lens.split(",")]:
        for batch in [int(x) for x in a.batches.split(",")]:
            # Ids away from 0..2 (special tokens of the generated tokenizers).
            prompts = rng.integers(3, vocab, size=(batch, length)).tolist()
            t0 = time.time()
            want, tokens = oracle_logits(model, prompts, a.decode, a.torch_device)
            name = f"L{length}_B{batch}"
            inp = os.path.join(a.out, name + ".json")
            with open(inp, "w") as f:
                json.dump({"prompt_len": length, "seqs": [p + t.tolist() for p, t in zip(prompts, tokens)]}, f)
            print(f"oracle {name}: {time.time() - t0:.1f} s", flush=True)
            cases.append((name, length, batch, inp, want, tokens))
    del model
    modes = ["eager", "graphs"] if a.cuda_graphs else ["eager"]
    report, failed = [], False
    for mode in modes:
        outs = {name: os.path.join(a.out, f"{name}.{mode}.f32") for name, *_ in cases}
        cmd = [a.runner, "--model", a.model, "--device", a.device, "--chunk", str(a.chunk),
               "--kv-cache-dtype", a.kv_cache_dtype]
        if mode == "graphs":
            cmd.append("--cuda-graphs")
        for name, _, _, inp, _, _ in cases:
            cmd += [inp, outs[name]]
        t0 = time.time()
        run = subprocess.run(cmd, capture_output=True, text=True)
        print(f"engine {mode}: {time.time() - t0:.1f} s", flush=True)
        if run.returncode != 0:
            print(f"the runner failed ({run.returncode}):\n{run.stderr}", file=sys.stderr)
            failed = True
        for name, length, batch, _, want, tokens in cases:
            if not os.path.exists(outs[name]):
                report.append({"case": name, "mode": mode, "error": run.stderr.strip()[-500:]})
                continue
            got = np.fromfile(outs[name], dtype="<f4").reshape(batch, a.decode, -1)[..., :vocab]
            os.remove(outs[name])
            err = np.abs(got - want)
            scale = np.maximum(np.abs(want).max(axis=-1), 1e-30)
            margin = top2_margin(want)
            mismatch = got.argmax(axis=-1) != tokens
            unexplained = mismatch & (margin > tol)
            # KL(oracle || engine) per position, in nats: how far the sampled distribution
            # moves, which a lossy KV cache (fp8) is judged by beside the greedy flips.
            log_p, log_q = log_softmax(want), log_softmax(got)
            kl = (np.exp(log_p) * (log_p - log_q)).sum(axis=-1)
            row = {
                "case": name,
                "mode": mode,
                "prompt_len": length,
                "batch": batch,
                "decode": a.decode,
                "max_abs": float(err.max()),
                "max_rel": float((err.max(axis=-1) / scale).max()),
                "mismatch": int(mismatch.sum()),
                "unexplained": int(unexplained.sum()),
                "positions": int(mismatch.size),
                "mean_kl": float(kl.mean()),
                "max_kl": float(kl.max()),
            }
            if a.max_mean_kl is not None and row["mean_kl"] > a.max_mean_kl:
                failed = True
                row["kl_over"] = a.max_mean_kl
            if unexplained.any():
                failed = True
                b, j = np.argwhere(unexplained)[0]
                row["first_unexplained"] = {"seq": int(b), "row": int(j), "margin": float(margin[b, j])}
            report.append(row)
            print(json.dumps(row), flush=True)
    for c in cases:
        os.remove(c[3])
    label = a.label or f"{os.path.basename(os.path.normpath(a.model))} on {a.device}" + (
        f", KV {a.kv_cache_dtype}" if a.kv_cache_dtype != "auto" else "")
    with open(os.path.join(a.out, "oracle.json"), "a") as f:
        f.write(json.dumps({"label": label, "tol": tol, "cases": report}) + "\n")
    with open(os.path.join(a.out, "oracle.md"), "a") as f:
        f.write(f"\n### {label} (tolerance {tol} logits)\n\n")
        f.write("| case | mode | max abs | max rel | greedy mismatches | unexplained (margin > tol) "
                "| mean KL (nats) |\n|---|---|---|---|---|---|---|\n")
        for r in report:
            if "error" in r:
                f.write(f"| {r['case']} | {r['mode']} | runner failed | | | | |\n")
            else:
                f.write(f"| {r['case']} | {r['mode']} | {r['max_abs']:.3g} | {r['max_rel']:.3g} | "
                        f"{r['mismatch']} / {r['positions']} | {r['unexplained']} "
                        f"| {r['mean_kl']:.2e} |\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
