#!/usr/bin/env python3
"""Peers on the same GPU, at the shapes infer's benchmarks time (issues 34 and 35):

- PyTorch's scaled-dot-product attention, flash backend, at kernel_bench's prefill shapes
  (32 query heads over 8, head_dim 64: a fresh 2,048-token prompt, a 512-token chunk after
  1,536 cached tokens; 24 over 8 at head_dim 128). K and V are expanded to every query head
  before the timing (the flash backend takes no GQA): the same FLOPs, 4x the K/V reads,
  which prefill barely notices. TFLOP/s counted as infer counts them: 4 * head_dim per
  (query, visible key) and head.
- Hugging Face transformers' greedy decode on the very safetensors gpu_bench generates,
  batch 1 / 8 / 32 at 512 tokens of context: eager (sdpa attention, dynamic cache) and, with
  --compile, torch.compile with a static cache (mode reduce-overhead: CUDA graphs).

- llama.cpp built with CUDA from its source (`llama`; gpu-check.sh's llama_cpp step builds it
  and converts the same safetensors to a bf16 GGUF with llama.cpp's own converter), flash
  attention on, every layer on the GPU: `llama-bench` for prefill (512 and 2,048 fresh
  tokens, 512 after 1,536) and `llama-batched-bench` for decode at 1 / 8 / 32 parallel
  sequences, each with a 512-token prompt of its own and 128 generated tokens (its decode
  steps run at 512-640 tokens of context; infer's at 512).

Prints `name: value unit` lines as infer's benchmarks do; `table` reads them beside infer's
(kernel_bench's and gpu_bench's logs) and prints infer / peer for each pair of figures.

  python3 scripts/gpu_peers.py measure MODEL_DIR [--compile] > peers.log
  python3 scripts/gpu_peers.py llama BIN_DIR GGUF --vocab N [--prefill] > llama-cpp.log
  python3 scripts/gpu_peers.py table kernel_bench.log gpu_bench.log peers.log llama-cpp.log
"""
import argparse
import os
import re
import time

# torch and transformers are imported where a peer is measured: `table` runs without them.

WARMUP, ITERS = 5, 50


def line(name, value, unit):
    print(f"{name}: {value:.2f} {unit}", flush=True)


def time_ms(fn):
    import torch

    for _ in range(WARMUP):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / ITERS


def sdpa(heads, kv_heads, head_dim, tokens, cached):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    keys = cached + tokens
    q = torch.randn(1, heads, tokens, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, keys, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    if cached == 0:
        mask, causal = None, True
    else:
        # The chunk's queries sit at the end of the keys: causal aligned to the lower right.
        from torch.nn.attention.bias import causal_lower_right

        mask, causal = causal_lower_right(tokens, keys), False
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal))
    visible = sum(cached + i for i in range(1, tokens + 1))
    tflops = 4.0 * head_dim * heads * visible / (ms * 1e-3) / 1e12
    tag = f"heads={heads}/{kv_heads},head_dim={head_dim},tokens={tokens},cached={cached}"
    line(f"sdpa_flash_prefill_us[{tag}]", ms * 1e3, "us")
    line(f"sdpa_flash_prefill_tflops[{tag}]", tflops, "TFLOP/s")


def hf_decode(model_dir, compile_):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.bfloat16, attn_implementation="sdpa"
    ).cuda().eval()
    vocab = model.config.vocab_size
    steps = 64
    for batch in [1, 8, 32]:
        prompt = torch.randint(10, vocab, (batch, 512), device="cuda")
        with torch.inference_mode():
            out = model(prompt, use_cache=True)
            cache = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(steps):
                out = model(token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t) / steps * 1e3
        line(f"hf_decode_step_ms[eager,batch={batch},ctx=512]", ms, "ms")
        line(f"hf_decode_tok_s[eager,batch={batch},ctx=512]", batch * 1e3 / ms, "tok/s")
    if not compile_:
        return
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    for batch in [1, 8, 32]:
        prompt = torch.randint(10, vocab, (batch, 512), device="cuda")

        def generate(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(
                prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                cache_implementation="static", pad_token_id=0,
            )
            torch.cuda.synchronize()
            return time.perf_counter() - t

        generate(steps + 1)  # compiles and captures
        generate(steps + 1)
        ms = (generate(steps + 1) - generate(1)) / steps * 1e3
        line(f"hf_decode_step_ms[compile,batch={batch},ctx=512]", ms, "ms")
        line(f"hf_decode_tok_s[compile,batch={batch},ctx=512]", batch * 1e3 / ms, "tok/s")


def llama_cpp(bin_dir, gguf, vocab, prefill):
    """llama.cpp's figures on one GGUF, from its own benchmarks' JSON lines."""
    import json
    import subprocess

    def jsonl(*args):
        run = subprocess.run(args, capture_output=True, text=True, check=True)
        return [json.loads(l) for l in run.stdout.splitlines() + run.stderr.splitlines()
                if l.startswith("{")]

    common = ["-m", gguf, "-ngl", "99", "-fa", "1"]
    bench = f"{bin_dir}/llama-bench"
    if prefill:
        for tokens, depth in [(512, 0), (2048, 0), (512, 1536)]:
            for r in jsonl(bench, *common, "-p", str(tokens), "-n", "0", "-d", str(depth),
                           "-r", "5", "-o", "jsonl"):
                tag = f"{tokens} after {depth}" if depth else f"{tokens}"
                line(f"llama_cpp_prefill_ms[{tag}]", r["avg_ns"] / 1e6, "ms")
    for r in jsonl(bench, *common, "-p", "0", "-n", "128", "-d", "512", "-r", "3", "-o", "jsonl"):
        line(f"llama_cpp_bench_tg_tok_s[vocab={vocab},tg=128,depth=512]", r["avg_ts"], "tok/s")
    batched = [f"{bin_dir}/llama-batched-bench", "-m", gguf, "-ngl", "99", "-fa", "on",
               "-c", str(32 * 640 + 512), "-npp", "512", "-ntg", "128", "-npl", "1,8,32",
               "--output-format", "jsonl"]
    for r in jsonl(*batched):
        at = f"[vocab={vocab},batch={r['pl']},ctx=512]"
        line(f"llama_cpp_decode_step_ms{at}", r["t_tg"] / r["tg"] * 1e3, "ms")
        line(f"llama_cpp_decode_tok_s{at}", r["speed_tg"], "tok/s")


# (infer's figure, the peer's, what is better) for the ratio table.
PAIRS = [
    (f"paged_attention_prefill_tflops[Flash,{tag}]", f"sdpa_flash_prefill_tflops[{tag}]", "higher")
    for tag in [
        "heads=32/8,head_dim=64,tokens=2048,cached=0",
        "heads=32/8,head_dim=64,tokens=512,cached=1536",
        "heads=24/8,head_dim=128,tokens=2048,cached=0",
        "heads=24/8,head_dim=128,tokens=512,cached=0",
    ]
] + [
    (
        f"decode_step_ms[vocab=32768,batch={b},ctx=512,{mode},greedy_device]",
        f"hf_decode_step_ms[{peer},batch={b},ctx=512]",
        "lower",
    )
    for b in [1, 8, 32]
    for mode, peer in [("eager", "eager"), ("graphs", "compile")]
] + [
    (f"prefill_ms[{tag}]", f"llama_cpp_prefill_ms[{tag}]", "lower")
    for tag in ["512", "2048", "512 after 1536"]
] + [
    (
        f"decode_step_ms[vocab={v},batch={b},ctx=512,graphs,greedy_device]",
        f"llama_cpp_decode_step_ms[vocab={v},batch={b},ctx=512]",
        "lower",
    )
    for v in [32768, 128256]
    for b in [1, 8, 32]
]


def figures(paths):
    found = {}
    for path in paths:
        if not os.path.exists(path):  # a step that did not run
            continue
        for text in open(path, errors="replace"):
            m = re.match(r"^(\S.*?): (-?[0-9.]+)", text.strip())
            if m:
                found[m.group(1)] = float(m.group(2))
    return found


def table(paths):
    """infer / peer for every pair found in the logs (infer's and the peers' together)."""
    found = figures(paths)
    print("| infer | peer | infer ÷ peer | better |")
    print("|---|---|---|---|")
    for mine, theirs, better in PAIRS:
        if mine in found and theirs in found:
            print(f"| `{mine}` {found[mine]:.2f} | `{theirs}` {found[theirs]:.2f} "
                  f"| {found[mine] / found[theirs]:.2f} | {better} |")
        else:
            print(f"| `{mine}` | `{theirs}` | not measured | {better} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    measure = sub.add_parser("measure", help="time the peers")
    measure.add_argument("model_dir")
    measure.add_argument("--compile", action="store_true")
    llama = sub.add_parser("llama", help="time llama.cpp's CUDA build on a GGUF")
    llama.add_argument("bin_dir")
    llama.add_argument("gguf")
    llama.add_argument("--vocab", type=int, required=True)
    llama.add_argument("--prefill", action="store_true", help="llama-bench's prefill too")
    pairs = sub.add_parser("table", help="infer / peer from the logs")
    pairs.add_argument("logs", nargs="+")
    args = ap.parse_args()
    if args.command == "table":
        table(args.logs)
        return
    if args.command == "llama":
        llama_cpp(args.bin_dir, args.gguf, args.vocab, args.prefill)
        return
    import torch

    print(f"# device {torch.cuda.get_device_name()} · torch {torch.__version__}")
    for heads, kv_heads, head_dim, tokens, cached in [
        (32, 8, 64, 2048, 0),
        (32, 8, 64, 512, 1536),
        (24, 8, 128, 2048, 0),
        (24, 8, 128, 512, 0),
    ]:
        sdpa(heads, kv_heads, head_dim, tokens, cached)
    hf_decode(args.model_dir, args.compile)


if __name__ == "__main__":
    main()
