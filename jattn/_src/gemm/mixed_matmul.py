"""mixed_matmul: bf16/f16 activations times an int8 or int4 weight, dequantised in the kernel.

Validation, config choice and the custom_vjp live here; the kernels are pallas_triton_mixed
and pallas_mosaic_gpu_mixed, the quantisation format gemm/quantize.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jattn._src import backends
from jattn._src.backends import Implementation
from jattn._src.gemm import pallas_mosaic_gpu_mixed, pallas_triton_mixed, quantize, xla
from jattn._src.gemm.api import product_for_shape
from jattn._src.gemm.config import (MatmulConfig, MosaicMixedConfig, heuristic_mixed_config,
                                    heuristic_mosaic_mixed_config)
from jattn._src.programs import jitted

_OP = "mixed_matmul"
_ACTIVATION_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_QWEIGHT_DTYPES = {8: jnp.dtype(jnp.int8), 4: jnp.dtype(jnp.uint8)}


def _triton_unsupported(*, config=None, **facts) -> str | None:
    if isinstance(config, MosaicMixedConfig):
        return ("a MosaicMixedConfig gives pallas_mosaic_gpu's tiles; pass a MatmulConfig for "
                "these kernels.")
    return None


backends.register_xla_and_kernels(_OP, xla, pallas_triton_mixed, config_class=MatmulConfig,
                                  heuristic=heuristic_mixed_config,
                                  unsupported=_triton_unsupported)
backends.register(Implementation(
    _OP, backends.PALLAS_MOSAIC_GPU, pallas_mosaic_gpu_mixed,
    unsupported=pallas_mosaic_gpu_mixed.unsupported, slower=pallas_mosaic_gpu_mixed.slower,
    config_class=MosaicMixedConfig, heuristic=heuristic_mosaic_mixed_config))


@dataclasses.dataclass(frozen=True)
class _Options:
    """Everything static about one call (the custom_vjp's non-differentiable argument)."""

    implementation: Implementation
    config: MatmulConfig | MosaicMixedConfig | None
    bits: int
    group_size: int | None

    def product(self, a, qweight, scales):
        return self.implementation.module.mixed_product(
            a, qweight, scales, bits=self.bits, group_size=self.group_size, config=self.config,
            out_dtype=a.dtype, interpret=self.implementation.backend.interpret)


class _Residuals(NamedTuple):
    a: jax.Array
    qweight: jax.Array
    scales: jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mixed_matmul(options: _Options, a, qweight, scales):
    return options.product(a, qweight, scales)


def _mixed_matmul_fwd(options: _Options, a, qweight, scales):
    return options.product(a, qweight, scales), _Residuals(a, qweight, scales)


def _mixed_matmul_bwd(options: _Options, res: _Residuals, d_out):
    # d_a = d_out · Wᵀ through the dense GEMM on W dequantised to a's dtype (a temporary of the
    # backward only). Scales: out = Σ_g (a_g @ q_g) · s_g, so d_s[g, n] = Σ_{k in g} q[k, n] ·
    # (aᵀ d_out)[k, n]; XLA drops that product when the scales' gradient is unused.
    a, dtype = res.a, res.a.dtype
    bits, group_size = options.bits, options.group_size
    d_out = d_out.astype(dtype)
    q = quantize.integer_values(res.qweight, bits)  # [K, N], unpacked once for both
    w = quantize.scale_values(q, res.scales, group_size=group_size, dtype=dtype)
    d_a = product_for_shape(options.implementation, d_out, w, dtype, transpose_b=True)
    a_t_d_out = product_for_shape(options.implementation, a, d_out, jnp.float32,
                                  transpose_a=True)
    d_scales = (q.astype(jnp.float32) * a_t_d_out).reshape(
        res.scales.shape[0], -1, q.shape[1]).sum(axis=1)
    return d_a, None, d_scales.astype(res.scales.dtype)


_mixed_matmul.defvjp(_mixed_matmul_fwd, _mixed_matmul_bwd)


def _check_inputs(a, qweight, scales, bits, group_size) -> tuple[int, int]:
    """Validates shapes and dtypes; returns (K, N)."""
    if a.ndim < 2:
        raise ValueError(f"{_OP}: `a` must have rank >= 2 ([..., M, K]), got shape {a.shape}.")
    if a.dtype not in _ACTIVATION_DTYPES:
        raise TypeError(f"{_OP}: `a` has dtype {a.dtype}; the activations must be bfloat16 or "
                        "float16 (cast them first).")
    k = a.shape[-1]
    expected_dtype = _QWEIGHT_DTYPES[bits]
    if qweight.dtype != expected_dtype:
        layout = "int8 [N, K]" if bits == 8 else "uint8 [N, K/2], two int4 values per byte"
        raise TypeError(f"{_OP}: bits={bits} takes `qweight` as {layout}, got dtype "
                        f"{qweight.dtype}; build it with jattn.quantize_weight(w, bits={bits}).")
    if bits == 4 and k % 2:
        raise ValueError(f"{_OP}: int4 weights pack two K rows per byte, so K must be even; "
                         f"`a` {a.shape} has K={k}. Pad K with a zero column of a and a zero "
                         "row of the weight.")
    width = k if bits == 8 else k // 2
    if qweight.ndim != 2 or qweight.shape[1] != width:
        packed = "" if bits == 8 else " (K/2 packed bytes)"
        raise ValueError(f"{_OP}: `qweight` must be [N, {width}]{packed}, output channels "
                         f"first, for `a` {a.shape} with K={k}; got shape {qweight.shape} "
                         "(jattn.quantize_weight builds it from a [K, N] weight).")
    quantize.check_group_size(_OP, bits, k, group_size)
    n = qweight.shape[0]
    if not jnp.issubdtype(scales.dtype, jnp.floating):
        raise TypeError(f"{_OP}: `scales` must be floating point, got {scales.dtype}.")
    if group_size is None and scales.shape not in ((n,), (1, n)):
        raise ValueError(f"{_OP}: per-channel `scales` (group_size=None) must be [{n}] (one per "
                         f"output column), got shape {scales.shape}; pass group_size for "
                         "per-group scales.")
    if group_size is not None and scales.shape != (k // group_size, n):
        raise ValueError(f"{_OP}: with group_size={group_size}, `scales` must be "
                         f"[K / group_size, N] = [{k // group_size}, {n}], got shape "
                         f"{scales.shape}.")
    return k, n


def _resolve_config(implementation: Implementation, config, m: int, n: int, k: int, bits: int,
                    group_size: int | None):
    """config, or the implementation's heuristic (a config of another implementation's class
    never resolves here: its `unsupported` names it)."""
    if config is None:
        return implementation.heuristic(m, n, k, bits, group_size)
    if bits == 4 and isinstance(config, MatmulConfig) and config.block_k < 32:
        raise ValueError(f"{_OP}: int4 needs config.block_k >= 32 (16-byte weight rows per K "
                         f"step), got block_k={config.block_k}.")
    return config


def mixed_matmul(a: jax.Array, qweight: jax.Array, scales: jax.Array, *, bits: int,
                 group_size: int | None = None, config: MatmulConfig | None = None,
                 implementation: str | None = None) -> jax.Array:
    """a @ W for a weight W ≈ q · scales stored as int8 or int4, dequantised inside the kernel.

    Each K step widens the integer tile to a's dtype in registers (exact) and multiplies on the
    tensor cores in float32; scales multiply each group's partial product (or the finished tile,
    per channel). The dequantised weight is never written to memory.

    Args:
      a: [..., M, K] bfloat16 or float16 activations; leading dims are flattened into M.
      qweight: from `jattn.quantize_weight`, output channels first (K contiguous, as
        torch.nn.Linear's weight): int8 [N, K] (bits=8) or uint8 [N, K/2] (bits=4: two int4
        values per byte along K, even k in the low nibble, each stored + 8).
      scales: any float dtype; [N] or [1, N] per output channel (group_size None), or
        [K / group_size, N] per group of K rows.
      bits: 8 or 4.
      group_size: None, or the K rows sharing a scale: a multiple of 16 (int8) or 32 (int4)
        dividing K.
      config: a MatmulConfig for pallas_triton (used as given; int4 needs block_k >= 32;
        split_k > 1 sums fp32 partials in XLA), a MosaicMixedConfig for pallas_mosaic_gpu, or
        None (heuristic).
      implementation: "pallas_triton", "pallas_mosaic_gpu" (Hopper: N a multiple of its 64 or
        128 weight rows, K of its K-step, group_size of the K-step; not yet the default: it
        has not been timed against pallas_triton), "xla" (dequantises in float32, then one
        dot) or "interpret", as in `jattn.matmul`.

    Returns:
      [..., M, N] of a's dtype. Differentiable in `a` and `scales`; the integer `qweight` is
      frozen (jax.grad with respect to it raises, as for any integer input). The backward runs
      the dense GEMM on a temporary dequantised weight.

    Example::

        w = jax.random.normal(jax.random.key(0), (128, 64))  # [K, N] float32
        qweight, scales = jattn.quantize_weight(w, bits=4, group_size=32)  # [N, K/2], [K/32, N]
        a = jnp.ones((8, 128), jnp.bfloat16)  # [M, K]
        out = jattn.mixed_matmul(a, qweight, scales, bits=4, group_size=32)
        print(out.shape, out.dtype)  # (8, 64) bfloat16
    """
    quantize.check_bits(_OP, bits)
    a, qweight, scales = (jnp.asarray(x) for x in (a, qweight, scales))
    k, n = _check_inputs(a, qweight, scales, bits, group_size)
    *lead, _ = a.shape
    m = math.prod(lead)
    if not (config is None or isinstance(config, (MatmulConfig, MosaicMixedConfig))):
        raise TypeError(f"{_OP}: `config` must be a MatmulConfig (pallas_triton), a "
                        f"MosaicMixedConfig (pallas_mosaic_gpu) or None, got {config!r}.")
    implementation = backends.resolve(_OP, implementation, dtype=a.dtype, m=m, n=n, k=k,
                                      bits=bits, group_size=group_size, config=config)
    if 0 in (*a.shape, *qweight.shape):
        implementation = backends.for_empty(_OP)
    resolved = None
    if implementation.tunable:
        resolved = _resolve_config(implementation, config, m, n, k, bits, group_size)
    scales = scales.reshape(-1, n)
    options = _Options(implementation, resolved, bits, group_size)
    return jitted(_mixed_matmul, options)(a.reshape(m, k), qweight, scales).reshape(*lead, n)
