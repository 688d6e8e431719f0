"""A training-style loop through interop.torch.flex_attention: every step builds a fresh
closure over a new tensor (per-step document ids), as torch users hand per-step state to a
mod, and runs forward + backward.

    python -m benchmarks.bench_mod_loop [--device cpu|cuda] [--steps 10000] [--json out.json]

Reports the process's resident memory at 1k / 5k / 10k steps (flat: nothing per step is kept),
the mod translations and XLA compilations after the first step (none: the closure's code is the
same, its tensor an argument), the time per step, and, for scale, torch's own flex_attention
(compiled on CUDA, eager on the CPU) on the same loop for a few hundred steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

import interop.torch as jt
from benchmarks import record
from benchmarks.process import CompileCounter, rss_mib
from benchmarks.timing import warm_up
from interop import _capture

SHAPE = {"cpu": (1, 2, 128, 16, torch.float32), "cuda": (4, 8, 1024, 64, torch.bfloat16)}
CHECKPOINTS = (1_000, 5_000, 10_000)


def _step(attention, q, k, v, mask, d_out, length, device):
    documents = torch.randint(0, 4, (length,), device=device).sort().values

    def same_document(score, b, h, q_idx, kv_idx):
        return torch.where(documents[q_idx] == documents[kv_idx], score, -float("inf"))

    out = attention(q, k, v, same_document, mask)
    out.backward(d_out)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=CHECKPOINTS[-1])
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    B, H, L, D, dtype = SHAPE[args.device]
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    q, k, v = (torch.randn(B, H, L, D, device=args.device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    d_out = torch.randn(B, H, L, D, device=args.device, dtype=dtype)
    mask = jt.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, L, args.device)
    compiles = CompileCounter()
    warm_up()

    _step(jt.flex_attention, q, k, v, mask, d_out, L, args.device)
    sync()
    first = {"translations": len(_capture._TRANSLATIONS), "compiles": compiles.count}
    rss, start = {}, time.perf_counter()
    for step in range(2, args.steps + 1):
        _step(jt.flex_attention, q, k, v, mask, d_out, L, args.device)
        if step in CHECKPOINTS:
            sync()
            gc.collect()
            rss[step] = rss_mib()
            print(f"step {step}: RSS {rss[step]:.1f} MiB", flush=True)
    sync()
    per_step_ms = (time.perf_counter() - start) / (args.steps - 1) * 1e3
    result = {"device": args.device, "shape": f"B{B} H{H} L{L} D{D} {dtype}",
              "steps": args.steps, "rss_mib": rss, "per_step_ms": per_step_ms,
              "translations_after_first": len(_capture._TRANSLATIONS) - first["translations"],
              "compiles_after_first": compiles.count - first["compiles"]}

    from torch.nn.attention import flex_attention as tflex
    torch_attention = (torch.compile(tflex.flex_attention) if args.device == "cuda"
                       else tflex.flex_attention)
    torch_mask = tflex.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, L,
                                         device=args.device)
    if args.device == "cuda":  # torch's CPU flex_attention has no backward
        for _ in range(10):
            _step(torch_attention, q, k, v, torch_mask, d_out, L, args.device)
        sync()
        start = time.perf_counter()
        for _ in range(300):
            _step(torch_attention, q, k, v, torch_mask, d_out, L, args.device)
        sync()
        result["torch_per_step_ms"] = (time.perf_counter() - start) / 300 * 1e3
    print(json.dumps(result, indent=1))
    record.write(args.json, result)


if __name__ == "__main__":
    main()
