"""Per-call overhead of the torch ops in `interop.torch`, same run as the direct JAX call.

    python -m benchmarks.bench_interop [--json out.json]

At a small shape the GPU work is a few microseconds, so the time per call of a long stream of
back-to-back calls (one synchronisation at the end) is the host-side cost of a call: for the
direct call, jit dispatch of the jitted jattn function on JAX arrays; for the torch op, that plus
the custom-op dispatch and the DLPack crossings. Added overhead = torch op - direct JAX call.
Target (issue 4): <= 50 us per call. "New tensor objects" passes fresh views each call (no
cached crossing), as activations are. torch's own op on the same tensors is printed for scale.
Also: flex_attention end to end (causal) at the attention benchmark shapes, op vs direct JAX.
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
from benchmarks import shapes

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


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor object on the same memory: it misses the per-tensor view cache, like an
    activation produced anew each step (the ~1 us view is counted against us)."""
    return tensor.view(tensor.shape)


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
           "interop_fresh_us": 1e6 * _per_call_seconds(lambda: jt.matmul(_fresh(a), b), sync),
           "torch_us": 1e6 * _per_call_seconds(lambda: torch.mm(a, b), sync)}
    row["added_us"] = row["interop_us"] - row["jax_us"]
    row["added_fresh_us"] = row["interop_fresh_us"] - row["jax_us"]
    return row


def bench_flex_overhead(L: int) -> dict:
    """Per-call cost of a small causal flex attention (B1 H2 D64): the op vs the direct call,
    and torch's own compiled flex_attention on the same tensors."""
    from torch.nn.attention import flex_attention as tflex

    q = torch.randn(1, 2, L, 64, device="cuda", dtype=torch.bfloat16)
    mask = jt.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, L, device="cuda")
    jq = jax.dlpack.from_dlpack(q)
    jmask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)
    direct = jax.jit(lambda x: jattn.flex_attention(x, x, x, None, jmask))
    compiled = torch.compile(tflex.flex_attention)
    sync = lambda *_: torch.cuda.synchronize()  # noqa: E731
    row = {"op": "flex_attention", "shape": f"B1 H2 L{L} D64 causal bf16",
           "jax_us": 1e6 * _per_call_seconds(lambda: direct(jq),
                                             lambda *o: jax.block_until_ready(o)),
           "interop_us": 1e6 * _per_call_seconds(lambda: jt.flex_attention(q, q, q, None, mask),
                                                 sync),
           "interop_fresh_us": 1e6 * _per_call_seconds(
               lambda: jt.flex_attention(_fresh(q), _fresh(q), _fresh(q), None, mask), sync),
           "torch_us": 1e6 * _per_call_seconds(lambda: compiled(q, q, q, block_mask=mask),
                                               sync)}
    row["added_us"] = row["interop_us"] - row["jax_us"]
    row["added_fresh_us"] = row["interop_fresh_us"] - row["jax_us"]
    return row


def bench_end_to_end(name, B, H, L, D) -> dict:
    """Forward and forward+backward at an attention benchmark shape, causal, through the torch
    op and through JAX directly (same kernels): the ratio is what the bridge costs there."""
    from benchmarks.timing import time_jax, time_torch

    rng_sets = [[torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
                 for _ in range(3)] for _ in range(3)]
    mask = jt.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, L, device="cuda")
    jmask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)
    jax_sets = [[jax.dlpack.from_dlpack(x) for x in s] for s in rng_sets]
    t_jax = time_jax(lambda q, k, v: jattn.flex_attention(q, k, v, None, jmask), jax_sets)
    t_op = time_torch(lambda q, k, v: jt.flex_attention(q, k, v, None, mask), rng_sets,
                      graph=False)
    grad_sets = [[x.clone().requires_grad_() for x in s] for s in rng_sets]
    t_op_all = time_torch(lambda q, k, v: jt.flex_attention(q, k, v, None, mask).sum().backward(),
                          grad_sets, graph=False)

    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(lambda *x: jattn.flex_attention(*x, None, jmask), q, k, v)
        return vjp(jnp.ones_like(out))

    t_jax_all = time_jax(fwd_bwd, jax_sets)
    return {"op": "flex_attention end to end", "shape": name, "fwd_jax_ms": t_jax * 1e3,
            "fwd_op_ms": t_op * 1e3, "fwd_bwd_jax_ms": t_jax_all * 1e3,
            "fwd_bwd_op_ms": t_op_all * 1e3}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; torch "
          f"{torch.__version__}")
    rows = []
    for r in [bench_matmul(n) for n in (128, 256)] + [bench_flex_overhead(L)
                                                       for L in (256, 1024)]:
        rows.append(r)
        print(f"{r['op']} {r['shape']}: direct jax {r['jax_us']:.1f} us, interop.torch "
              f"{r['interop_us']:.1f} us (added {r['added_us']:+.1f} us; new tensor objects "
              f"{r['interop_fresh_us']:.1f} us, added {r['added_fresh_us']:+.1f} us), torch "
              f"{r['torch_us']:.1f} us", flush=True)
    for name, B, H, L, D in shapes.ATTENTION:
        r = bench_end_to_end(name, B, H, L, D)
        rows.append(r)
        print(f"{r['op']} {name}: forward jax {r['fwd_jax_ms']:.3f} ms, op "
              f"{r['fwd_op_ms']:.3f} ms; forward+backward jax {r['fwd_bwd_jax_ms']:.3f} ms, op "
              f"{r['fwd_bwd_op_ms']:.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    jnp.zeros(())  # initialise JAX's backend after interop set its allocator option
    main()
