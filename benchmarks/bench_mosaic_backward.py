"""The Mosaic GPU backward against cuDNN's, same run, and where its time goes.

    python -m benchmarks.bench_mosaic_backward [--only CASE] [--kernel dkdv|dq]
        [--reduce-add-dq] [--registers 232,40] [--json out.json]

Backward time = time(forward + vjp) - time(forward), with a random cotangent (a constant one
lets the tensor cores run cooler and faster, on both sides); TFLOP/s are 2.5x the forward's
FLOPs over it, as bench_attention's. `--kernel dkdv` (or `dq`) replaces the other backward
kernel by zeros, to time one kernel alone (the delta pass still runs). Where flex_attention(deterministic=False) runs
other kernels (dQ reduce-added by the dK/dV kernel: REDUCE_ADD_HEAD_DIMS, head dim 64), it is
timed too; `--reduce-add-dq` does so at head dim 128 as well. `--registers` sets the consumer and
producer warpgroups' registers of the three Mosaic kernels. Set MOSAIC_GPU_DUMP_PTXAS=1 to see ptxas's registers and
spills of each kernel.
"""

from __future__ import annotations

import argparse
import os
import types

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from benchmarks import record, shapes
from jattn._src.attention import pallas_mosaic_gpu_bwd as bwd
from jattn._src.attention import pallas_mosaic_gpu_fwd as fwd
from benchmarks.timing import time_jax, warm_up

KERNELS = {"dkdv": "jattn_mosaic_bwd_dkdv", "dq": "jattn_mosaic_bwd_dq"}


def _only_kernel(bwd, kept: str) -> None:
    """Makes the Mosaic backward launch `kept` alone, the other kernel's outputs zeros."""
    launch = bwd.pl.kernel

    def kernel(body, *, out_type, name, **kwargs):
        if name in KERNELS.values() and name != KERNELS[kept]:
            return lambda *args: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_type)
        return launch(body, out_type=out_type, name=name, **kwargs)

    bwd.pl = types.SimpleNamespace(**{n: getattr(bwd.pl, n) for n in dir(bwd.pl)
                                      if not n.startswith("__")})
    bwd.pl.kernel = kernel


def _backward_tflops(fn, sets, flops) -> dict:
    def fwd_bwd(q, k, v, cotangent):
        out, vjp = jax.vjp(fn, q, k, v)
        return vjp(cotangent)

    t_fwd = time_jax(lambda q, k, v, cotangent: fn(q, k, v), sets)
    t_all = time_jax(fwd_bwd, sets)
    return {"fwd": flops / t_fwd / 1e12, "bwd": 2.5 * flops / (t_all - t_fwd) / 1e12,
            "bwd_ms": (t_all - t_fwd) * 1e3}


def bench_case(name, B, H, L, D, causal: bool) -> dict:
    rng = np.random.default_rng(0)
    sets = [[jnp.asarray(rng.standard_normal((B, H, L, D)), jnp.bfloat16) for _ in range(4)]
            for _ in range(3)]
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L) if causal else None
    flops = 4 * B * H * L * L * D * ((L + 128) / (2 * L) if causal else 1.0)

    def mosaic(deterministic):
        return _backward_tflops(lambda q, k, v: jattn.flex_attention(
            q, k, v, block_mask=mask, implementation="pallas_mosaic_gpu",
            deterministic=deterministic), sets, flops)

    row = {"case": name, "mask": "causal" if causal else "full", "mosaic": mosaic(True)}
    if D in bwd.REDUCE_ADD_HEAD_DIMS:
        row["nondeterministic"] = mosaic(False)
    blhd = [[jnp.swapaxes(x, 1, 2) for x in s] for s in sets]
    row["cudnn"] = _backward_tflops(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"), blhd, flops)
    for kind in ("mosaic", "nondeterministic"):
        if kind in row:
            row[f"{kind}_bwd_vs_cudnn"] = row[kind]["bwd"] / row["cudnn"]["bwd"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="", help="cases whose name contains this")
    parser.add_argument("--kernel", choices=sorted(KERNELS), help="time this kernel alone")
    parser.add_argument("--reduce-add-dq", action="store_true")
    parser.add_argument("--registers", help="consumer,producer registers per thread")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.reduce_add_dq:
        bwd.REDUCE_ADD_HEAD_DIMS = (64, 128)
    if args.registers:
        for kernels in (fwd, bwd):  # (each reads its imported name when it is traced)
            kernels.CONSUMER_REGISTERS, kernels.PRODUCER_REGISTERS = map(
                int, args.registers.split(","))
    if args.kernel:
        _only_kernel(bwd, args.kernel)
    settings = {"kernel": args.kernel or "both",
                "reduce_add_head_dims": list(bwd.REDUCE_ADD_HEAD_DIMS),
                "registers": [bwd.CONSUMER_REGISTERS, bwd.PRODUCER_REGISTERS]}
    print(f"device: {jax.devices()[0].device_kind}; {settings}")
    warm_up()
    rows = []
    for name, B, H, L, D in shapes.ATTENTION:
        if args.only not in name:
            continue
        for causal in (False, True):
            row = bench_case(name, B, H, L, D, causal)
            rows.append(row)
            record.write(args.json, rows, settings=settings)
            print(f"{name:>20} {row['mask']:>6}: mosaic {row['mosaic']['fwd']:6.1f}/"
                  f"{row['mosaic']['bwd']:6.1f}  cudnn {row['cudnn']['fwd']:6.1f}/"
                  f"{row['cudnn']['bwd']:6.1f}  bwd x cuDNN {row['mosaic_bwd_vs_cudnn']:.2f}"
                  + (f"  deterministic=False {row['nondeterministic']['bwd']:6.1f} "
                     f"({row['nondeterministic_bwd_vs_cudnn']:.2f}x cuDNN)"
                     if "nondeterministic" in row else ""), flush=True)


if __name__ == "__main__":
    main()
