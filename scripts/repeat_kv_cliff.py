#!/usr/bin/env python3
"""The cost per key of transformers' masked sdpa attention on a CPU, below and past glibc's
mmap threshold: what `page_fault_s_per_gib` in the simulator's cost model describes.

With a mask and grouped-query heads, transformers' sdpa attention repeats a pass's keys and
values for every query head (`repeat_kv`) before PyTorch's kernel runs. glibc's malloc maps
every block of at least its mmap threshold afresh and unmaps it on free; the threshold rises
with the blocks freed, but never past 32 MiB. Past that, each layer's repeated K and V are
new pages every step, faulted in one by one.

    python3 scripts/repeat_kv_cliff.py                        # as transformers serve runs
    MALLOC_MMAP_THRESHOLD_=1000000000 python3 scripts/repeat_kv_cliff.py   # threshold raised

One layer of the generated 0.5B Llama (16 query heads, 4 KV heads, head_dim 64, f32),
eight decodes of one step (eight query rows against all the step's keys, as transformers'
masked pass runs them); the time per key is scaled to the model's 28 layers.
"""
import time

import torch

HEADS, KV_HEADS, HEAD_DIM, LAYERS, QUERIES = 16, 4, 64, 28, 8


def main() -> None:
    torch.set_num_threads(2)
    print(f"{'keys':>6} {'repeated K MiB':>15} {'ms per layer':>13} {'us per key, 28 layers':>22}")
    for keys in [2048, 4096, 6144, 7680, 8192, 8704, 10240, 12288, 16384]:
        k = torch.randn(1, KV_HEADS, keys, HEAD_DIM)
        v = torch.randn(1, KV_HEADS, keys, HEAD_DIM)
        q = torch.randn(1, HEADS, QUERIES, HEAD_DIM)
        mask = torch.zeros(1, 1, QUERIES, keys)
        rep = HEADS // KV_HEADS

        def layer() -> torch.Tensor:
            # transformers' repeat_kv: expand, then reshape (a copy).
            kr = k[:, :, None].expand(1, KV_HEADS, rep, keys, HEAD_DIM).reshape(1, HEADS, keys, HEAD_DIM)
            vr = v[:, :, None].expand(1, KV_HEADS, rep, keys, HEAD_DIM).reshape(1, HEADS, keys, HEAD_DIM)
            return torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)

        for _ in range(3):
            layer()
        n = 20
        start = time.perf_counter()
        for _ in range(n):
            layer()
        per_layer = (time.perf_counter() - start) / n
        mib = keys * HEADS * HEAD_DIM * 4 / 2**20
        print(f"{keys:>6} {mib:>15.1f} {per_layer * 1e3:>13.2f} {per_layer * LAYERS / keys * 1e6:>22.1f}")


if __name__ == "__main__":
    main()
