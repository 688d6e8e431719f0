"""Per-call overhead of the torch ops in `interop.torch`, same run as the direct JAX call.

    python -m benchmarks.bench_interop [--json out.json]

At a small shape the GPU work is a few microseconds, so the time per call of a long stream of
back-to-back calls (one synchronisation at the end) is the host-side cost of a call: for the
direct call, jit dispatch of the jitted jattn function on JAX arrays; for the torch op, that plus
the custom-op dispatch and the DLPack crossings. Added overhead = torch op - direct JAX call.
Target (issue 4): <= 50 us per call. torch's own op on the same tensors is printed for scale.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import torch

import interop.torch as jt
import jattn

CALLS = 2000


def _per_call_seconds(fn, wait) -> float:
    for _ in range(50):  # warm-up: compile, caches
        fn()
    wait()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(CALLS):
            out = fn()
        wait(out)
        best = min(best, (time.perf_counter() - start) / CALLS)
    return best


def bench_matmul(n: int) -> dict:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ja, jb = jax.dlpack.from_dlpack(a), jax.dlpack.from_dlpack(b)
    direct = jax.jit(lambda x, y: jattn.matmul(x, y))
    sync = lambda *_: torch.cuda.synchronize()  # noqa: E731
    row = {"op": "matmul", "shape": f"{n}^3 bf16",
           "jax_us": 1e6 * _per_call_seconds(lambda: direct(ja, jb),
                                             lambda *o: jax.block_until_ready(o)),
           "interop_us": 1e6 * _per_call_seconds(lambda: jt.matmul(a, b), sync),
           "torch_mm_us": 1e6 * _per_call_seconds(lambda: torch.mm(a, b), sync)}
    row["added_us"] = row["interop_us"] - row["jax_us"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; torch "
          f"{torch.__version__}")
    rows = []
    for n in (128, 256):
        r = bench_matmul(n)
        rows.append(r)
        print(f"{r['op']} {r['shape']}: direct jax {r['jax_us']:.1f} us, interop.torch "
              f"{r['interop_us']:.1f} us (added {r['added_us']:+.1f} us), torch.mm "
              f"{r['torch_mm_us']:.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    jnp.zeros(())  # initialise JAX's backend after interop set its allocator option
    main()
