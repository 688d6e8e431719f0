"""Per-call overhead of the torch ops in `interop.torch`, same run as the direct JAX call.

    python -m benchmarks.bench_interop [--device cuda|cpu] [--per-call] [--json out.json]

At a small shape the GPU work is a few microseconds, so the time per call of a long stream of
back-to-back calls (one synchronisation at the end) is the host-side cost of a call (median of
15 rounds in which the columns take turns): for the
direct call, jit dispatch of the jitted jattn function on JAX arrays; for the torch op, that plus
the DLPack crossings and the Python around them. Added overhead = torch op - direct JAX call.
Target (issue 4): <= 50 us per call. Columns: "same tensors" passes the same torch tensors
every call (inference: nothing requires grad); "new tensor objects" passes fresh views each
call (no cached crossing), as activations are, its added time net of making the views;
"training" passes the same tensors with the first one requiring grad (the autograd.Function
records a node; forward only). torch's own op on the same tensors is printed for scale. On
CUDA also: flex_attention end to end (causal) at the attention benchmark shapes, op vs direct
JAX.

--device cpu times the XLA implementation on CPU tensors at smaller shapes, with JAX's CPU
client dispatching synchronously (an exported CPU result waits for its computation; this way
the direct call does too, and neither side pays a thread hand-off). The computations are not
negligible there: the per-call numbers carry their noise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import torch

import interop.torch as jt
import jattn
from benchmarks import record, shapes
from benchmarks.timing import warm_up

CALLS = 2000
SHAPES = {"cuda": {"matmul": (128, 256), "flex": (256, 1024), "head_dim": 64,
                   "dtype": torch.bfloat16},
          "cpu": {"matmul": (16, 64), "flex": (64, 128), "head_dim": 16,
                  "dtype": torch.float32}}


def _per_call_seconds(columns: dict, rounds: int = 15) -> dict:
    """Median over `rounds` of the seconds per call of each column's fn in CALLS back-to-back
    calls: {name: (fn, wait)} -> {name: seconds}. The columns take turns within each round, so
    a drift of the host (clock, neighbours) between columns does not become a difference."""
    for fn, wait in columns.values():
        for _ in range(50):  # warm-up: compile, caches
            fn()
        wait()
    samples = {name: [] for name in columns}
    for _ in range(rounds):
        for name, (fn, wait) in columns.items():
            start = time.perf_counter()
            for _ in range(CALLS):
                out = fn()
            wait(out)
            samples[name].append((time.perf_counter() - start) / CALLS)
    return {name: statistics.median(times) for name, times in samples.items()}


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor object on the same memory: it misses the per-tensor view cache, like an
    activation produced anew each step. Making the view costs 5-10 us of its own on these
    hosts; it is timed alone and taken out of the added time (`views_us`)."""
    return tensor.view(tensor.shape)


def _timed_row(op: str, shape: str, device: str, direct, interop_call, torch_call,
               first: torch.Tensor, rest: tuple) -> dict:
    """Per-call microseconds of the direct JAX call, of `interop_call(first, *rest)` with the
    same tensors, fresh views and `first` requiring grad, and of `torch_call`."""
    if device == "cuda":
        wait = lambda *_: torch.cuda.synchronize()  # noqa: E731
        wait_jax = lambda *o: jax.block_until_ready(o)  # noqa: E731
    else:  # synchronous dispatch (main)
        wait = wait_jax = lambda *_: None  # noqa: E731
    trained = first.detach().requires_grad_()
    row = {"op": op, "shape": shape, **_per_call_seconds({
        "jax_us": (direct, wait_jax),
        "interop_us": (lambda: interop_call(first, *rest), wait),
        "interop_fresh_us": (lambda: interop_call(_fresh(first), *map(_fresh, rest)), wait),
        "interop_training_us": (lambda: interop_call(trained, *rest), wait),
        "views_us": (lambda: (_fresh(first), *map(_fresh, rest)), wait),
        "torch_us": (torch_call, wait)})}
    row = {k: v * 1e6 if k.endswith("_us") else v for k, v in row.items()}
    for column in ("", "_fresh", "_training"):
        row[f"added{column}_us"] = row[f"interop{column}_us"] - row["jax_us"]
    row["added_fresh_us"] -= row["views_us"]  # the benchmark's own cost, not the op's
    return row


def bench_matmul(n: int, device: str) -> dict:
    dtype = SHAPES[device]["dtype"]
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    ja, jb = jax.dlpack.from_dlpack(a), jax.dlpack.from_dlpack(b)
    direct = jax.jit(lambda x, y: jattn.matmul(x, y))
    return _timed_row("matmul", f"{n}^3 {str(dtype).removeprefix('torch.')}", device,
                      lambda: direct(ja, jb), jt.matmul, lambda: torch.mm(a, b), a, (b,))


def bench_flex_overhead(L: int, device: str, *, with_mod: bool = False) -> dict:
    """Per-call cost of a small causal flex attention (B1 H2): the op vs the direct call, and
    torch's own compiled flex_attention on the same tensors. The direct call takes q, k, v as
    the op does (three arguments, one array here), its BlockMask a constant of the jitted
    function (cheaper to dispatch than the op's kv-major lists as arguments). with_mod adds
    an ALiBi score_mod closing over a slopes tensor: torch-written for the op (its state
    guarded and its tensor looked up on every call), jattn.mods.alibi with the slopes as an
    argument for the direct call."""
    from torch.nn.attention import flex_attention as tflex

    D, dtype = SHAPES[device]["head_dim"], SHAPES[device]["dtype"]
    q = torch.randn(1, 2, L, D, device=device, dtype=dtype)
    mask = jt.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, L, device=device)
    jq = jax.dlpack.from_dlpack(q)
    jmask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)
    slopes = torch.exp2(-torch.arange(1, 3, device=device, dtype=torch.float32))
    jslopes = jax.dlpack.from_dlpack(slopes)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    score_mod = alibi if with_mod else None
    direct = jax.jit(lambda q, k, v, s: jattn.flex_attention(
        q, k, v, jattn.mods.alibi(s) if with_mod else None, jmask))
    compiled = torch.compile(tflex.flex_attention)
    name = f"B1 H2 L{L} D{D} causal{' alibi' if with_mod else ''} "
    return _timed_row("flex_attention", name + str(dtype).removeprefix("torch."), device,
                      lambda: direct(jq, jq, jq, jslopes),
                      lambda q, k, v: jt.flex_attention(q, k, v, score_mod, mask),
                      lambda: compiled(q, q, q, score_mod, block_mask=mask), q, (q, q))


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
    ones = torch.ones(B, H, L, D, device="cuda", dtype=torch.bfloat16)  # as JAX's d_out below
    t_op_all = time_torch(
        lambda q, k, v: torch.autograd.grad(jt.flex_attention(q, k, v, None, mask), (q, k, v),
                                            ones), grad_sets, graph=False)

    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(lambda *x: jattn.flex_attention(*x, None, jmask), q, k, v)
        return vjp(jnp.ones_like(out))

    t_jax_all = time_jax(fwd_bwd, jax_sets)
    return {"op": "flex_attention end to end", "shape": name, "fwd_jax_ms": t_jax * 1e3,
            "fwd_op_ms": t_op * 1e3, "fwd_bwd_jax_ms": t_jax_all * 1e3,
            "fwd_bwd_op_ms": t_op_all * 1e3}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--per-call", action="store_true",
                        help="only the per-call rows (no end-to-end attention timings)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    # Before JAX's backends start: the CPU client reads this when it is created. The first
    # computation then starts them after interop set its allocator option.
    jax.config.update("jax_cpu_enable_async_dispatch", args.device != "cpu")
    jnp.zeros(())
    print(f"device: {jax.devices(args.device if args.device == 'cpu' else None)[0].device_kind}"
          f"; jax {jax.__version__}; torch {torch.__version__}")
    warm_up()
    rows = []
    sizes = SHAPES[args.device]
    for r in ([bench_matmul(n, args.device) for n in sizes["matmul"]]
              + [bench_flex_overhead(L, args.device) for L in sizes["flex"]]
              + [bench_flex_overhead(L, args.device, with_mod=True) for L in sizes["flex"]]):
        rows.append(r)
        print(f"{r['op']} {r['shape']}: direct jax {r['jax_us']:.1f} us; interop.torch "
              f"same tensors {r['interop_us']:.1f} us (added {r['added_us']:+.1f}), new tensor "
              f"objects {r['interop_fresh_us']:.1f} ({r['added_fresh_us']:+.1f} after "
              f"{r['views_us']:.1f} of making the views), training "
              f"{r['interop_training_us']:.1f} ({r['added_training_us']:+.1f}); torch "
              f"{r['torch_us']:.1f} us", flush=True)
    for name, B, H, L, D in shapes.ATTENTION if args.device == "cuda" and not args.per_call else ():
        r = bench_end_to_end(name, B, H, L, D)
        rows.append(r)
        print(f"{r['op']} {name}: forward jax {r['fwd_jax_ms']:.3f} ms, op "
              f"{r['fwd_op_ms']:.3f} ms; forward+backward jax {r['fwd_bwd_jax_ms']:.3f} ms, op "
              f"{r['fwd_bwd_op_ms']:.3f} ms", flush=True)
    record.write(args.json, rows)


if __name__ == "__main__":
    main()
