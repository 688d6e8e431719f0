"""Fused GEMM variants and fp8 scaled_matmul on the GPU against baselines doing the same work.

    python -m benchmarks.bench_gemm_variants [--json results.json] [--only NAME] [--smoke]

Cases (issue 6, item 5), bf16 inputs and outputs, fp32 accumulation on both sides:
- mm_plus_mm: jattn.mm_plus_mm(a, b, c, d) against jit(jnp.dot(a, b) + jnp.dot(c, d)).
  FLOP model 2·M·N·(K1 + K2).
- b2b: jattn.b2b_matmul(a, b, c, gelu) against jit(gelu(a @ b in fp32) rounded to bf16 @ c),
  where the [M, P] intermediate is large (M=8192, K=N=128, P=8192) and, for side="right", its
  mirror image. FLOP model 2·M·P·(K + N) (left), 2·P·N·(K + M) (right).
- scaled_matmul: jattn.scaled_matmul on float8_e4m3fn 8192^3, tensor-wise and row-wise scales,
  bf16 out, b stored [N, K] on both sides, against torch._scaled_mm on the same values, with
  the same use_fast_accum on both sides (False, and True for one case); the default choice
  ("jattn") and each other kernel backend that runs it. FLOP model 2·M·N·K; torch skipped
  where it or its GPU is missing.
- mixed_matmul: int8 and int4 (per channel, and per group of 128) weights at decode shapes
  M in {1, 16, 64}, N = K = 8192, bf16 activations, against XLA dequantise-then-dot and the
  bf16 GEMMs (jattn.matmul and jnp.dot) on the unquantised weight, the Mosaic GPU kernel
  where it runs ("jattn_mosaic"), and for int4 torch's tinygemm kernel
  (aten._weight_int4pack_mm, "torch_int4pack") on the same weights where torch sees a GPU;
  GB/s of weight bytes read (integer values + scales, or the bf16 weight), and the best bf16
  time over jattn's.
The ratio printed is the baseline's time over jattn's (> 1: jattn is faster). --smoke runs tiny
shapes with the default implementation (xla on a CPU) to check the script end to end.
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn._src import backends
from jattn._src.gemm.reference import mixed_matmul_reference
from benchmarks import record
from benchmarks.bench_matmul import kernel_backends
from benchmarks.timing import first_call_seconds, input_copies, time_jax, time_torch, warm_up

# (name, M, N, K1, K2)
MM_PLUS_MM = [("mm+mm M=N=8192 K=128+128", 8192, 8192, 128, 128),
              ("mm+mm 4096^3 + 4096^3", 4096, 4096, 4096, 4096)]
# (name, side, M, K, P, N): P is the intermediate width (a@b is [M, P] for left).
B2B = [("b2b left M=8192 K=N=128 P=8192", "left", 8192, 128, 8192, 128),
       ("b2b right M=128 K=128 P=8192 N=8192", "right", 128, 128, 8192, 8192)]
# (name, M, N, K, scale mode, use_fast_accum on both sides)
SCALED = [("fp8 8192^3 tensor-wise", 8192, 8192, 8192, "tensor", False),
          ("fp8 8192^3 row-wise", 8192, 8192, 8192, "row", False),
          ("fp8 8192^3 tensor-wise fast accum", 8192, 8192, 8192, "tensor", True)]
# (name, M, N, K, bits, group_size): weight-only quantized GEMM at decode shapes.
MIXED = [(f"int{bits} {'per-channel' if g is None else f'g{g}'} M={m} N=K=8192", m, 8192, 8192,
          bits, g) for m in (1, 16, 64) for bits, g in ((8, None), (4, None), (4, 128))]
SMOKE_MM_PLUS_MM = [("smoke mm+mm", 64, 48, 32, 16)]
SMOKE_B2B = [("smoke b2b left", "left", 64, 32, 128, 32),
             ("smoke b2b right", "right", 32, 32, 128, 64)]
SMOKE_MIXED = [("smoke int8 per-channel", 4, 48, 64, 8, None), ("smoke int4 g32", 4, 48, 64, 4, 32)]
SMOKE_SCALED = [("smoke fp8 tensor-wise", 64, 48, 32, "tensor", False),
                ("smoke fp8 row-wise fast accum", 64, 48, 32, "row", True)]


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
    return {"case": name, "baseline": "xla", "tflops": tflops, "seconds": seconds,
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


def _torch_on_gpu():
    """torch, if it is installed and sees a GPU; else None (the fp8 baseline is skipped)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _scale_values(rng, m: int, n: int, mode: str):
    shapes = ((m, 1), (1, n)) if mode == "row" else ((), ())
    return [np.asarray(rng.uniform(0.5, 2.0, shape), np.float32) for shape in shapes]


def bench_scaled(name, m, n, k, mode, fast, *, smoke=False) -> dict:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), np.float32)
    b = rng.standard_normal((k, n), np.float32)
    scale_a, scale_b = _scale_values(rng, m, n, mode)
    copies = 2 if smoke else input_copies((m + n) * k)
    factors = [1 + i / copies for i in range(copies)]  # distinct copies, same fp8 range
    fp8 = jnp.float8_e4m3fn
    # Both sides get b stored [N, K] (K-major, as torch._scaled_mm requires and as fp8 weights
    # are kept); jattn receives its transpose, which cancels the kernel's own under jit.
    a_dev, b_nk = jnp.asarray(a), jnp.asarray(np.ascontiguousarray(b.T))
    sets = [[(a_dev * f).astype(fp8), (b_nk * f).astype(fp8), jnp.asarray(scale_a),
             jnp.asarray(scale_b)] for f in factors]
    facts = dict(dtype=fp8, m=m, n=n, k=k)
    default = backends.resolve("scaled_matmul", **facts).name
    kernels = [default] + [name for name in kernel_backends("scaled_matmul", facts)
                           if name != default]

    def ours_on(implementation):
        return jax.jit(lambda a, b_nk, sa, sb: jattn.scaled_matmul(
            a, b_nk.T, sa, sb, use_fast_accum=fast, implementation=implementation))

    ours = ours_on(default)
    compile_s = first_call_seconds(ours, *sets[0])
    seconds = {"jattn": time_jax(ours, sets)}
    seconds |= {name: time_jax(ours_on(name), sets) for name in kernels[1:]}
    row = {"case": name, "baseline": "torch", "m": m, "n": n, "k": k, "mode": mode,
           "use_fast_accum": fast, "default": default, "first_call_s": compile_s}
    torch = _torch_on_gpu()
    if torch is not None:
        a_t, b_t = torch.from_numpy(a).cuda(), torch.from_numpy(np.ascontiguousarray(b.T)).cuda()
        scales = [torch.from_numpy(s).cuda() for s in (scale_a, scale_b)]
        torch_sets = [[(a_t * f).to(torch.float8_e4m3fn), (b_t * f).to(torch.float8_e4m3fn).t(),
                       *scales] for f in factors]

        def baseline(a, b, sa, sb):
            return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                    use_fast_accum=fast)

        seconds["torch"] = time_torch(baseline, torch_sets)
        theirs = baseline(*torch_sets[0]).float().cpu().numpy()
        row["vs_torch"] = seconds["torch"] / seconds["jattn"]
        row["kernels_vs_torch"] = {name: seconds["torch"] / seconds[name]
                                   for name in kernels[1:]}
        row["max_abs_diff_vs_torch"] = float(np.abs(
            np.asarray(ours(*sets[0]).astype(jnp.float32)) - theirs).max())
    row["seconds"] = seconds
    row["tflops"] = {key: 2 * m * n * k / t / 1e12 for key, t in seconds.items()}
    return row


# torch's weight-only int4 anchor on CUDA: aten._weight_int4pack_mm (tinygemm), groups of 32 to
# 256 weights; innerKTiles 8 as torchao packs it for large K.
_TINYGEMM_GROUPS, _INNER_K_TILES = (32, 64, 128, 256), 8


def _torch_int4pack(quant_sets, bits: int, group_size: int | None):
    """(fn, argument sets) of torch's int4 weight-only GEMM on jattn's int4 weights, or None
    (not int4, no torch GPU, or a group size tinygemm lacks). jattn packs even k in the low
    nibble, stored + 8; tinygemm takes even k in the high nibble and dequantises
    (q - 8) · scale + zero: the nibbles are swapped and the zeros are 0. Per-channel scales run
    as groups of 128 holding the same scale (the same products)."""
    torch = _torch_on_gpu()
    k = 2 * quant_sets[0][1].shape[1]
    group = group_size or 128
    if torch is None or bits != 4 or group not in _TINYGEMM_GROUPS or k % group:
        return None
    sets = []
    for a, qweight, scales in quant_sets:
        packed = np.asarray(qweight)
        swapped = torch.from_numpy(((packed >> 4) | (packed << 4)).astype(np.uint8)).cuda()
        weight = torch.ops.aten._convert_weight_to_int4pack(swapped, _INNER_K_TILES)
        per_group = np.asarray(scales, np.float32).reshape(-1, packed.shape[0])
        per_group = np.repeat(per_group, k // group // per_group.shape[0], axis=0)
        scale_and_zero = torch.from_numpy(np.stack([per_group, np.zeros_like(per_group)], -1))
        sets.append([torch.from_numpy(np.asarray(a, np.float32)).cuda().to(torch.bfloat16),
                     weight, scale_and_zero.cuda().to(torch.bfloat16)])

    def int4pack_mm(x, weight, scale_and_zero):
        return torch.ops.aten._weight_int4pack_mm(x, weight, group, scale_and_zero)

    return int4pack_mm, sets


def bench_mixed(name, m, n, k, bits, group_size, *, smoke=False) -> dict:
    """mixed_matmul against XLA dequantise-then-dot and the bf16 GEMMs (jattn and XLA)."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(0.05 * rng.standard_normal((k, n)), jnp.bfloat16)
    qweight, scales = jattn.quantize_weight(w, bits, group_size)
    quant_bytes, dense_bytes = qweight.nbytes + scales.nbytes, w.nbytes
    copies = 2 if smoke else input_copies(dense_bytes)  # one count for every side
    # Distinct weight buffers (rotated out of L2) and distinct activations per call.
    quant_sets = [[a * (1 + i / copies), jnp.array(qweight, copy=True),
                   jnp.array(scales, copy=True)] for i in range(copies)]
    dense_sets = [[x, w * (1 + i / copies)] for i, (x, _, _) in enumerate(quant_sets)]
    mode = dict(bits=bits, group_size=group_size)
    ours = jax.jit(lambda a, q, s: jattn.mixed_matmul(a, q, s, **mode))
    dequantise_then_dot = functools.partial(mixed_matmul_reference, **mode)

    compile_s = first_call_seconds(ours, *quant_sets[0])
    seconds = {"jattn": time_jax(ours, quant_sets),
               "xla_dequant": time_jax(jax.jit(dequantise_then_dot), quant_sets),
               "jattn_bf16": time_jax(jax.jit(jattn.matmul), dense_sets),
               "xla_bf16": time_jax(jax.jit(_dot32), dense_sets)}
    mosaic = jax.jit(lambda a, q, s: jattn.mixed_matmul(a, q, s, **mode,
                                                        implementation="pallas_mosaic_gpu"))
    try:  # (Hopper, and a shape its tiles divide)
        seconds["jattn_mosaic"] = time_jax(mosaic, quant_sets)
    except ValueError:
        mosaic = None
    torch_int4 = _torch_int4pack(quant_sets, bits, group_size)
    if torch_int4 is not None:
        seconds["torch_int4pack"] = time_torch(torch_int4[0], torch_int4[1])
    weight_bytes = {key: quant_bytes if key in ("jattn", "xla_dequant", "jattn_mosaic",
                                                "torch_int4pack")
                    else dense_bytes for key in seconds}
    expected = dequantise_then_dot(*quant_sets[0]).astype(jnp.float32)
    err = float(jnp.abs(ours(*quant_sets[0]).astype(jnp.float32) - expected).max())
    if mosaic is not None:
        err = max(err, float(jnp.abs(mosaic(*quant_sets[0]).astype(jnp.float32)
                                     - expected).max()))
    if torch_int4 is not None:  # (its weights are ours: the same sums, its own rounding)
        theirs = torch_int4[0](*torch_int4[1][0]).float().cpu().numpy()
        err = max(err, float(np.abs(theirs - np.asarray(expected)).max()))
    return {"case": name, "baseline": "bf16", "m": m, "n": n, "k": k, **mode,
            "seconds": seconds, "tflops": {key: 2 * m * n * k / t / 1e12
                                           for key, t in seconds.items()},
            "weight_gbps": {key: weight_bytes[key] / t / 1e9 for key, t in seconds.items()},
            "vs_bf16": min(seconds["jattn_bf16"], seconds["xla_bf16"]) / seconds["jattn"],
            "vs_xla_dequant": seconds["xla_dequant"] / seconds["jattn"],
            "first_call_s": compile_s, "max_abs_diff_vs_xla_dequant": err}


def _report(r: dict) -> str:
    if "weight_gbps" in r:
        rates = "  ".join(f"{key} {value:6.0f}" for key, value in r["weight_gbps"].items())
        return (f"{r['case']:>38}: weight GB/s {rates}   jattn {r['tflops']['jattn']:.1f} "
                f"TFLOP/s   best bf16 time / jattn time "
                f"{r['vs_bf16']:.2f}   xla dequant time / jattn time {r['vs_xla_dequant']:.2f}"
                f"   max |diff| {r['max_abs_diff_vs_xla_dequant']:.3g}   "
                f"first call {r['first_call_s']:.2f}s")
    base = r["baseline"]
    rates = "  ".join(f"{key} {value:7.2f}" for key, value in r["tflops"].items())
    if f"vs_{base}" not in r:
        return f"{r['case']:>38}: {rates} TFLOP/s   ({base} unavailable: no ratio)"
    return (f"{r['case']:>38}: {rates} TFLOP/s   {base} time / jattn time "
            f"{r[f'vs_{base}']:.3f}   max |diff| {r[f'max_abs_diff_vs_{base}']:.3g}   "
            f"first call {r['first_call_s']:.2f}s")


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
    cases += [(bench_mixed, c) for c in (SMOKE_MIXED if args.smoke else MIXED)]
    cases += [(bench_scaled, c) for c in (SMOKE_SCALED if args.smoke else SCALED)]
    warm_up()
    rows = []
    for bench, case in cases:
        if args.only and args.only not in case[0]:
            continue
        rows.append(bench(*case, smoke=args.smoke))
        print(_report(rows[-1]), flush=True)
        record.write(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
