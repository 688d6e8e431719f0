"""Fused GEMM variants on the GPU against the same work as two XLA GEMMs (+fn), same run.

    python -m benchmarks.bench_gemm_variants [--json results.json] [--only NAME] [--smoke]

Cases (issue 6, item 5), bf16 inputs and outputs, fp32 accumulation on both sides:
- mm_plus_mm: jattn.mm_plus_mm(a, b, c, d) against jit(jnp.dot(a, b) + jnp.dot(c, d)).
  FLOP model 2·M·N·(K1 + K2).
- b2b: jattn.b2b_matmul(a, b, c, gelu) against jit(gelu(a @ b in fp32) rounded to bf16 @ c),
  where the [M, P] intermediate is large (M=8192, K=N=128, P=8192) and, for side="right", its
  mirror image. FLOP model 2·M·P·(K + N) (left), 2·P·N·(K + M) (right).
The ratio printed is XLA's time over jattn's (> 1: jattn is faster). --smoke runs tiny shapes
with the default implementation (xla on a CPU) to check the script end to end.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from benchmarks.timing import first_call_seconds, input_copies, time_jax

# (name, M, N, K1, K2)
MM_PLUS_MM = [("mm+mm M=N=8192 K=128+128", 8192, 8192, 128, 128),
              ("mm+mm 4096^3 + 4096^3", 4096, 4096, 4096, 4096)]
# (name, side, M, K, P, N): P is the intermediate width (a@b is [M, P] for left).
B2B = [("b2b left M=8192 K=N=128 P=8192", "left", 8192, 128, 8192, 128),
       ("b2b right M=128 K=128 P=8192 N=8192", "right", 128, 128, 8192, 8192)]
SMOKE_MM_PLUS_MM = [("smoke mm+mm", 64, 48, 32, 16)]
SMOKE_B2B = [("smoke b2b left", "left", 64, 32, 128, 32),
             ("smoke b2b right", "right", 32, 32, 128, 64)]


def _gelu(x):
    return jax.nn.gelu(x, approximate=True)


def _dot32(x, y):
    return jnp.dot(x, y, preferred_element_type=jnp.float32)


def _xla_mm_plus_mm(a, b, c, d):
    return (_dot32(a, b) + _dot32(c, d)).astype(a.dtype)


def _xla_b2b(side):
    def run(a, b, c):
        if side == "left":
            return _dot32(_gelu(_dot32(a, b)).astype(a.dtype), c).astype(a.dtype)
        return _dot32(a, _gelu(_dot32(b, c)).astype(a.dtype)).astype(a.dtype)
    return run


def _input_sets(shapes, smoke: bool, dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    base = [jnp.asarray(0.3 * rng.standard_normal(s), dtype) for s in shapes]
    copies = 2 if smoke else input_copies(sum(2 * int(np.prod(s)) for s in shapes))
    # Distinct copies (scaled) so that no two calls see the same inputs.
    return [[x * (1 + i / copies) for x in base] for i in range(copies)]


def _compare(name: str, flops: float, ours, xla, sets) -> dict:
    compile_s = first_call_seconds(ours, *sets[0])
    err = float(jnp.abs(ours(*sets[0]).astype(jnp.float32)
                        - xla(*sets[0]).astype(jnp.float32)).max())
    seconds = {"jattn": time_jax(ours, sets), "xla": time_jax(xla, sets)}
    tflops = {key: flops / t / 1e12 for key, t in seconds.items()}
    return {"case": name, "tflops": tflops, "seconds": seconds,
            "vs_xla": seconds["xla"] / seconds["jattn"], "first_call_s": compile_s,
            "max_abs_diff_vs_xla": err}


def bench_mm_plus_mm(name, m, n, k1, k2, *, smoke=False) -> dict:
    sets = _input_sets([(m, k1), (k1, n), (m, k2), (k2, n)], smoke)
    row = _compare(name, 2 * m * n * (k1 + k2), jax.jit(jattn.mm_plus_mm),
                   jax.jit(_xla_mm_plus_mm), sets)
    return {**row, "m": m, "n": n, "k1": k1, "k2": k2}


def bench_b2b(name, side, m, k, p, n, *, smoke=False) -> dict:
    shapes = [(m, k), (k, p), (p, n)] if side == "left" else [(m, p), (p, k), (k, n)]
    flops = 2 * m * p * (k + n) if side == "left" else 2 * p * n * (k + m)
    ours = jax.jit(lambda a, b, c: jattn.b2b_matmul(a, b, c, _gelu, side=side))
    row = _compare(name, flops, ours, jax.jit(_xla_b2b(side)),
                   _input_sets(shapes, smoke))
    return {**row, "side": side, "m": m, "k": k, "p": p, "n": n}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--only", help="run only cases whose name contains this")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, default implementation: checks the script runs")
    args = parser.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    cases = [(bench_mm_plus_mm, c) for c in (SMOKE_MM_PLUS_MM if args.smoke else MM_PLUS_MM)]
    cases += [(bench_b2b, c) for c in (SMOKE_B2B if args.smoke else B2B)]
    rows = []
    for bench, case in cases:
        if args.only and args.only not in case[0]:
            continue
        rows.append(bench(*case, smoke=args.smoke))
        r = rows[-1]
        print(f"{r['case']:>38}: jattn {r['tflops']['jattn']:7.2f}  xla {r['tflops']['xla']:7.2f}"
              f" TFLOP/s   xla time / jattn time {r['vs_xla']:.3f}   max |diff| "
              f"{r['max_abs_diff_vs_xla']:.3g}   first call {r['first_call_s']:.2f}s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
