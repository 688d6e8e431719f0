"""scaled_matmul: fp8 GEMM with tensor-wise or row-wise scales, as torch._scaled_mm; forward only.

Validation and canonical scale shapes live here; the kernels are `jattn.matmul`'s (see
pallas_triton.scaled_matmul and pallas_mosaic_gpu.scaled_product), with the scales applied to
the fp32 tile before the bias.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jattn._src.gemm.api import Config, Options, make_options
from jattn._src.programs import jitted

_OP = "scaled_matmul"
_FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _check_operands(a: jax.Array, b: jax.Array) -> None:
    for name, x in (("a", a), ("b", b)):
        if x.ndim != 2:
            raise ValueError(f"{_OP}: `{name}` must be a 2-D matrix, got shape {x.shape}.")
        if x.dtype not in _FP8_DTYPES:
            raise TypeError(f"{_OP}: `{name}` has dtype {x.dtype}; it must be float8_e4m3fn or "
                            "float8_e5m2 (quantise first; use jattn.matmul for 16/32-bit inputs).")
    if a.dtype != b.dtype:
        # Pallas' Triton dot lowering requires one element type for both operands.
        raise TypeError(f"{_OP}: `a` and `b` must have the same fp8 dtype, got {a.dtype} and "
                        f"{b.dtype}; cast one of them (through float32) to the other.")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{_OP}: inner dimensions differ: a {a.shape} has K={a.shape[1]} but "
                         f"b {b.shape} has K={b.shape[0]}.")


def _canonical_scale(name: str, scale: Any, per: str, row_wise_shapes,
                     shape_2d) -> jax.Array:
    """scale as float32 [1, 1] (tensor-wise) or `shape_2d` (row-wise, one per `per`)."""
    scale = jnp.asarray(scale)
    if scale.dtype != jnp.float32:
        raise TypeError(f"{_OP}: `{name}` must be float32, got {scale.dtype}.")
    if scale.shape in ((), (1,), (1, 1)):
        return scale.reshape(1, 1)
    if scale.shape in row_wise_shapes:
        return scale.reshape(shape_2d)
    expected = " or ".join(str(s) for s in row_wise_shapes)
    raise ValueError(f"{_OP}: `{name}` has shape {scale.shape}; expected a scalar (tensor-wise) "
                     f"or {expected} (row-wise, one scale per {per}).")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _scaled_matmul(options: Options, use_fast_accum: bool, a, b, scale_a, scale_b, bias):
    return options.implementation.module.scaled_product(
        a, b, scale_a, scale_b, bias, config=options.config, out_dtype=options.out_dtype,
        use_fast_accum=use_fast_accum, interpret=options.implementation.backend.interpret)


def _scaled_matmul_fwd(options: Options, use_fast_accum: bool, a, b, scale_a, scale_b, bias):
    return _scaled_matmul(options, use_fast_accum, a, b, scale_a, scale_b, bias), None


def _scaled_matmul_bwd(options: Options, use_fast_accum: bool, res, d_out):
    raise NotImplementedError(
        f"{_OP} is a forward (inference) op and has no gradient. To train through an fp8 "
        "product, differentiate jattn.matmul on the dequantised operands instead, e.g. "
        "jattn.matmul(a.astype(jnp.bfloat16) * scale_a.reshape(-1, 1), "
        "b.astype(jnp.bfloat16) * scale_b.reshape(1, -1)).")


_scaled_matmul.defvjp(_scaled_matmul_fwd, _scaled_matmul_bwd)


def scaled_matmul(a: jax.Array, b: jax.Array, scale_a: jax.Array, scale_b: jax.Array, *,
                  bias: jax.Array | None = None, out_dtype=jnp.bfloat16,
                  use_fast_accum: bool = False, config: Config | None = None,
                  implementation: str | None = None) -> jax.Array:
    """(a @ b) * scale_a[:, None] * scale_b[None, :] + bias on fp8 inputs, as torch._scaled_mm.

    The product is accumulated in float32; scales multiply the float32 tile, then the bias is
    added (in output units), then the result is cast to out_dtype — all inside the kernel.

    Args:
      a: [M, K] float8_e4m3fn or float8_e5m2.
      b: [K, N], the same fp8 dtype as `a` (e4m3 x e5m2 mixes are rejected: Pallas' Triton dot
        takes one element type).
      scale_a: float32; tensor-wise: a scalar (shape (), (1,) or (1, 1)); row-wise: [M] or
        [M, 1], one scale per row of a.
      scale_b: float32; tensor-wise: a scalar; row-wise: [N] or [1, N], one per column of b.
        Each scale picks its mode independently.
      bias: optional [N], any float dtype, added after scaling.
      out_dtype: bfloat16 (default), float16 or float32.
      use_fast_accum: as torch._scaled_mm's. False: the tensor cores' fp8 partial sums are
        promoted into the float32 accumulator every 128 K elements (pallas_triton: every
        min(block_k, 128); as DeepGEMM does); True: the tensor cores accumulate the whole K
        range themselves (faster, less accurate for long K). pallas_triton needs the `triton`
        package on the GPU for both (it compiles the kernel with Triton's fp8 accumulation
        setting, which Pallas does not expose); without it the kernel promotes after every MMA
        instruction and runs far slower. The xla and interpret implementations accumulate in
        float32 either way.
      config: a MatmulConfig (pallas_triton; used as given, split_k must be 1), a
        MosaicMatmulConfig (pallas_mosaic_gpu; block_k=128, and with promoted accumulation a
        consumer's tile of at most 64 x 128), or None (cached tuning result, else the
        heuristic, run without split-K).
      implementation: "pallas_mosaic_gpu" (Hopper; M and N multiples of 128, K of 128),
        "pallas_triton", "xla" or "interpret", as in `jattn.matmul`.

    Returns:
      [M, N] of out_dtype. Not differentiable: a forward (inference) op, and jax.grad through it
      raises NotImplementedError (differentiate `jattn.matmul` on dequantised operands instead).

    Example::

        a = jnp.ones((64, 32), jnp.float8_e4m3fn)  # [M, K]
        b = jnp.ones((32, 16), jnp.float8_e4m3fn)  # [K, N]
        scale_a, scale_b = jnp.float32(0.5), jnp.full((16,), 2.0, jnp.float32)  # tensor, [N]
        out = jattn.scaled_matmul(a, b, scale_a, scale_b)
        print(out.shape, out.dtype, out[0, 0])  # (64, 16) bfloat16 32
    """
    a, b = (x if isinstance(x, jax.Array) else jnp.asarray(x) for x in (a, b))
    _check_operands(a, b)
    if not isinstance(use_fast_accum, bool):
        raise TypeError(f"{_OP}: `use_fast_accum` must be a bool, got {use_fast_accum!r}.")
    out = None if out_dtype is None else jnp.dtype(out_dtype)
    if out not in _OUT_DTYPES:
        raise TypeError(f"{_OP}: `out_dtype`={out} is not supported; use bfloat16, float16 or "
                        "float32.")
    if not (config is None or isinstance(config, Config)):
        raise TypeError(f"{_OP}: `config` must be a MatmulConfig (pallas_triton), a "
                        f"MosaicMatmulConfig (pallas_mosaic_gpu) or None, got {config!r}.")
    (m, k), n = a.shape, b.shape[1]
    scale_a = _canonical_scale("scale_a", scale_a, "row of a", ((m,), (m, 1)), (m, 1))
    scale_b = _canonical_scale("scale_b", scale_b, "column of b", ((n,), (1, n)), (1, n))
    options, _ = make_options(_OP, m, n, k, a.dtype, bias, None, out_dtype, config,
                              implementation, split_k=False, fast_accum=use_fast_accum)
    return jitted(_scaled_matmul, options, use_fast_accum)(a, b, scale_a, scale_b, bias)
