"""GEMM throughput on the GPU: jattn.matmul (and jattn.bmm) on each kernel backend that runs the
shape (pallas_triton, pallas_mosaic_gpu) against jnp.dot / jnp.matmul (XLA) and torch.mm /
torch.bmm, same run.

    python -m benchmarks.bench_matmul [--tune] [--json results.json]

FLOP model: 2·M·N·K per product (times the batch for bmm). bf16 inputs and outputs, fp32
accumulation on every side.
The epilogue case compares matmul+bias+gelu(tanh) in one kernel with XLA's fused jnp version
and torch's addmm + gelu.
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from benchmarks import shapes
from benchmarks import record
from benchmarks.timing import first_call_seconds, input_copies, time_jax, time_torch, warm_up
from jattn._src import backends
from jattn._src.gemm.api import choose_config


def _gelu(x):
    return jax.nn.gelu(x, approximate=True)


def _xla_fused(a, b, bias):
    return _gelu(jnp.dot(a, b, preferred_element_type=jnp.float32) + bias).astype(a.dtype)


def _torch_sets(jax_sets):
    import torch

    return [[torch.from_dlpack(x) for x in args] for args in jax_sets]


KERNELS = ("pallas_triton", "pallas_mosaic_gpu")


def kernel_backends(op: str, facts: dict) -> list[str]:
    """The KERNELS that run an `op` call with these facts on this machine."""
    runs = []
    for name in KERNELS:
        try:
            backends.resolve(op, name, **facts)
        except ValueError:
            continue
        runs.append(name)
    return runs


def bench_case(name: str, m: int, n: int, k: int, *, epilogue: bool, tune: bool,
               batch: int | None = None) -> dict:
    """batch: jattn.bmm of `batch` [m, k] @ [k, n] products (None: one jattn.matmul)."""
    import torch

    rng = np.random.default_rng(0)
    lead = () if batch is None else (batch,)
    op = "matmul" if batch is None else "bmm"
    products = batch or 1
    copies = input_copies(2 * products * (m * k + k * n + m * n))
    base = [jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
            for shape in (lead + (m, k), lead + (k, n), (n,))]
    # Distinct copies (scaled) so that no two calls see the same inputs.
    sets = [[x * (1 + i / copies) for x in base] for i in range(copies)]
    facts = dict(dtype=jnp.bfloat16, m=m, n=n, k=k, epilogue=epilogue, batch=products)
    default = backends.resolve(op, **facts).name
    kernels = kernel_backends(op, facts)
    configs = {name: choose_config(op, backends.resolve(op, name),
                                   "autotune" if tune else None, m, n, k, jnp.bfloat16,
                                   batch=products)
               for name in kernels}
    if epilogue:
        ours = {name: jax.jit(lambda a, b, bias, c=configs[name], i=name: jattn.matmul(
            a, b, bias=bias, epilogue=_gelu, config=c, implementation=i)) for name in kernels}
        xla = jax.jit(_xla_fused)
        torch_fn = lambda a, b, bias: torch.nn.functional.gelu(torch.addmm(bias, a, b),
                                                               approximate="tanh")
    else:
        sets = [s[:2] for s in sets]
        ours = {name: jax.jit(functools.partial(getattr(jattn, op), config=configs[name],
                                                implementation=name)) for name in kernels}
        xla = jax.jit(jnp.matmul)
        torch_fn = torch.mm if batch is None else torch.bmm
    compile_s = {name: first_call_seconds(fn, *sets[0]) for name, fn in ours.items()}
    expected = xla(*sets[0]).astype(jnp.float32)
    err = {name: float(jnp.abs(fn(*sets[0]).astype(jnp.float32) - expected).max())
           for name, fn in ours.items()}
    seconds = {name: time_jax(fn, sets) for name, fn in ours.items()}
    seconds |= {"xla": time_jax(xla, sets), "torch": time_torch(torch_fn, _torch_sets(sets))}
    tflops = {key: 2 * products * m * n * k / t / 1e12 for key, t in seconds.items()}
    return {"case": name, "batch": batch, "m": m, "n": n, "k": k, "default": default,
            "configs": {name: c.__dict__ for name, c in configs.items()},
            "first_call_s": compile_s, "max_abs_diff_vs_xla": err, "tflops": tflops,
            "vs_xla": {name: tflops[name] / tflops["xla"] for name in kernels},
            "vs_torch": {name: tflops[name] / tflops["torch"] for name in kernels}}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tune", action="store_true", help="autotune each shape first")
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--only", help="run only cases whose name contains this")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    cases = [((*c, None), False) for c in shapes.MATMUL_SQUARE + shapes.MATMUL_SKINNY]
    cases += [((*c, None), True) for c in shapes.MATMUL_EPILOGUE]
    cases += [((name, m, n, k, batch), False) for name, batch, m, n, k in shapes.MATMUL_BATCHED]
    warm_up()
    rows = []
    for (name, m, n, k, batch), epilogue in cases:
        if args.only and args.only not in name:
            continue
        rows.append(bench_case(name, m, n, k, epilogue=epilogue, tune=args.tune, batch=batch))
        r = rows[-1]
        ours = "  ".join(f"{name} {r['tflops'][name]:6.1f} (x{r['vs_xla'][name]:.3f} xla, "
                         f"x{r['vs_torch'][name]:.3f} torch, first call "
                         f"{r['first_call_s'][name]:.2f}s)" for name in r["vs_xla"])
        print(f"{r['case']:>20}: {ours}  xla {r['tflops']['xla']:6.1f}  torch "
              f"{r['tflops']['torch']:6.1f} TFLOP/s; default {r['default']}", flush=True)
        record.write(args.json, rows)


if __name__ == "__main__":
    main()
