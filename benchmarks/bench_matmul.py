"""GEMM throughput on the GPU: jattn.matmul against jnp.dot (XLA) and torch.mm, same run.

    python -m benchmarks.bench_matmul [--tune] [--json results.json]

FLOP model: 2·M·N·K per product. bf16 inputs and outputs, fp32 accumulation on every side.
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


def bench_case(name: str, m: int, n: int, k: int, *, epilogue: bool, tune: bool) -> dict:
    import torch

    rng = np.random.default_rng(0)
    copies = input_copies(2 * (m * k + k * n + m * n))
    base = [jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
            for shape in ((m, k), (k, n), (n,))]
    # Distinct copies (scaled) so that no two calls see the same inputs.
    sets = [[x * (1 + i / copies) for x in base] for i in range(copies)]
    config = choose_config("matmul", backends.resolve("matmul", "pallas_triton"),
                           "autotune" if tune else None, m, n, k, jnp.bfloat16)
    if epilogue:
        ours = jax.jit(lambda a, b, bias: jattn.matmul(a, b, bias=bias, epilogue=_gelu,
                                                       config=config))
        xla = jax.jit(_xla_fused)
        torch_fn = lambda a, b, bias: torch.nn.functional.gelu(torch.addmm(bias, a, b),
                                                               approximate="tanh")
    else:
        sets = [s[:2] for s in sets]
        ours = jax.jit(functools.partial(jattn.matmul, config=config))
        xla = jax.jit(jnp.dot)
        torch_fn = torch.mm
    compile_s = first_call_seconds(ours, *sets[0])
    err = float(jnp.abs(ours(*sets[0]).astype(jnp.float32)
                        - xla(*sets[0]).astype(jnp.float32)).max())
    seconds = {"jattn": time_jax(ours, sets), "xla": time_jax(xla, sets),
               "torch": time_torch(torch_fn, _torch_sets(sets))}
    tflops = {key: 2 * m * n * k / t / 1e12 for key, t in seconds.items()}
    return {"case": name, "m": m, "n": n, "k": k, "config": config.__dict__,
            "first_call_s": compile_s, "max_abs_diff_vs_xla": err,
            "tflops": tflops, "vs_xla": tflops["jattn"] / tflops["xla"],
            "vs_torch": tflops["jattn"] / tflops["torch"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tune", action="store_true", help="autotune each shape first")
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--only", help="run only cases whose name contains this")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    cases = [(c, False) for c in shapes.MATMUL_SQUARE + shapes.MATMUL_SKINNY]
    cases += [(c, True) for c in shapes.MATMUL_EPILOGUE]
    warm_up()
    rows = []
    for (name, m, n, k), epilogue in cases:
        if args.only and args.only not in name:
            continue
        rows.append(bench_case(name, m, n, k, epilogue=epilogue, tune=args.tune))
        r = rows[-1]
        print(f"{r['case']:>20}: jattn {r['tflops']['jattn']:6.1f}  xla {r['tflops']['xla']:6.1f}"
              f"  torch {r['tflops']['torch']:6.1f} TFLOP/s   vs xla {r['vs_xla']:.3f}"
              f"  vs torch {r['vs_torch']:.3f}   first call {r['first_call_s']:.2f}s"
              f"  {r['config']}", flush=True)
        record.write(args.json, rows)


if __name__ == "__main__":
    main()
