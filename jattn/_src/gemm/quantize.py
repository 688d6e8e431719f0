"""Weight-only quantisation for `jattn.mixed_matmul`: int8, or int4 packed two per byte.

Symmetric and zero-point free: w ≈ q · scale with one scale per output channel (column of the
[K, N] weight) or per group of `group_size` consecutive K rows of a channel. The integers are
stored output-channel-major, K contiguous (the layout of torch.nn.Linear's weight, and the one
the GPU kernel reads as Hopper's tensor cores want it): int8 [N, K], or int4 packed along K as
the seed's uint4x2 template packs it, byte [n, i] holding q[2i, n] + 8 in its low nibble and
q[2i + 1, n] + 8 in its high nibble: uint8 [N, K/2].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BITS = (8, 4)
_QMAX = {8: 127, 4: 7}


def check_bits(op: str, bits) -> None:
    if bits not in BITS:
        raise ValueError(f"{op}: `bits` must be 8 or 4, got {bits!r}.")


def check_group_size(op: str, bits: int, k: int, group_size) -> None:
    """group_size: None (per channel) or a positive multiple of 16 (int8) / 32 (int4) dividing K.

    The multiple keeps each group's slice of K a whole number of tensor-core dot steps (int4:
    at least 16 bytes of a weight row; 8-byte int4 chunks give wrong results on the H100).
    """
    if group_size is None:
        return
    multiple = 16 if bits == 8 else 32
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise TypeError(f"{op}: `group_size` must be a positive int or None, got {group_size!r}.")
    if group_size % multiple:
        raise ValueError(f"{op}: `group_size`={group_size} must be a multiple of {multiple} for "
                         f"{bits}-bit weights (e.g. 32, 64 or 128).")
    if k % group_size:
        raise ValueError(f"{op}: K={k} is not divisible by `group_size`={group_size}; pick a "
                         "group size that divides K, or group_size=None (per channel).")


def pack_int4(q: jax.Array) -> jax.Array:
    """int values in [-8, 7] of shape [K, N] (K even) -> uint8 [N, K/2], even k low nibble."""
    biased = (q.astype(jnp.int32) + 8).astype(jnp.uint8).T
    return biased[:, 0::2] | (biased[:, 1::2] << 4)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """uint8 [N, K/2] -> int8 [K, N] in [-8, 7], the inverse of `pack_int4`."""
    low = (packed & 15).astype(jnp.int8) - 8
    high = (packed >> 4).astype(jnp.int8) - 8
    n, half = packed.shape
    return jnp.stack([low, high], axis=-1).reshape(n, 2 * half).T


def integer_values(qweight: jax.Array, bits: int) -> jax.Array:
    """The int8 [K, N] values q of a quantised weight (int8 transposed, int4 unpacked)."""
    return qweight.T if bits == 8 else unpack_int4(qweight)


def quantize_weight(w: jax.Array, bits: int = 8, group_size: int | None = None, *,
                    scale_dtype=None) -> tuple[jax.Array, jax.Array]:
    """Quantises a [K, N] weight for `jattn.mixed_matmul` (symmetric, round to nearest).

    Each scale is max|w| / qmax over its channel or group (qmax 127 for int8, 7 for int4; an
    all-zero group gets scale 1, a group holding NaN the scale NaN, so that dequantisation and
    mixed_matmul give NaN there, not 0), stored in scale_dtype; q = round(w / stored scale)
    clipped to [-qmax, qmax], so dequantisation uses exactly the scale that was stored.

    Args:
      w: [K, N] floating weight (N output channels); K even for bits=4.
      bits: 8 (int8 values) or 4 (int4, packed two per byte along K).
      group_size: None for one scale per output channel, or the number of consecutive K rows
        sharing a scale (a multiple of 16 for int8, 32 for int4, dividing K).
      scale_dtype: dtype of the scales; default w's dtype (bfloat16/float16 scales halve the
        scale bytes the kernel reads; float32 for the most accurate).

    Returns:
      (qweight, scales): qweight int8 [N, K] (bits=8) or uint8 [N, K/2] (bits=4), output
      channels major (see the module docstring); scales [N] (per channel) or
      [K / group_size, N].

    Example::

        w = jax.random.normal(jax.random.key(0), (128, 64), jnp.bfloat16)  # [K, N]
        qweight, scales = jattn.quantize_weight(w, bits=8)
        print(qweight.dtype, qweight.shape, scales.shape)  # int8 (64, 128) (64,)
    """
    op = "quantize_weight"
    check_bits(op, bits)
    w = jnp.asarray(w)
    if w.ndim != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"{op}: `w` must be a floating [K, N] matrix, got {w.dtype}{w.shape}.")
    k, n = w.shape
    if bits == 4 and k % 2:
        raise ValueError(f"{op}: int4 packs two K rows per byte, so K must be even; got K={k}. "
                         "Pad w with a zero row.")
    check_group_size(op, bits, k, group_size)
    group = k if group_size is None else group_size
    grouped = w.astype(jnp.float32).reshape(k // group, group, n)
    qmax = _QMAX[bits]
    scale = jnp.max(jnp.abs(grouped), axis=1) / qmax  # NaN where the group holds a NaN
    scale = jnp.where(scale == 0, 1.0, scale).astype(scale_dtype or w.dtype)
    q = jnp.clip(jnp.round(grouped / scale.astype(jnp.float32)[:, None, :]), -qmax, qmax)
    q = q.reshape(k, n).astype(jnp.int8)
    scales = scale[0] if group_size is None else scale
    return (q.T if bits == 8 else pack_int4(q)), scales


def dequantize_weight(qweight: jax.Array, scales: jax.Array, *, bits: int,
                      group_size: int | None = None, dtype=jnp.float32) -> jax.Array:
    """The [K, N] weight that `quantize_weight` encoded, q · scale, in `dtype`.

    For debugging and for the XLA path; `jattn.mixed_matmul` never materialises it on the GPU.
    Scales are [N] or [1, N] (per channel) or [K / group_size, N].

    Args:
      qweight, scales, bits, group_size: as `quantize_weight` returned and was given them:
        qweight int8 [N, K] (bits=8) or uint8 [N, K/2] (bits=4); scales of any float dtype.
      dtype: the output dtype (default float32).

    Returns:
      [K, N] of `dtype`.

    Example::

        w = jax.random.normal(jax.random.key(0), (128, 64))  # [K, N] float32
        qweight, scales = jattn.quantize_weight(w, bits=4, group_size=32)
        w2 = jattn.dequantize_weight(qweight, scales, bits=4, group_size=32)
        print(w2.shape, w2.dtype, float(jnp.abs(w2 - w).max()) < 0.5)  # (128, 64) float32 True
    """
    return scale_values(integer_values(qweight, bits), scales, group_size=group_size,
                        dtype=dtype)


def scale_values(q: jax.Array, scales: jax.Array, *, group_size: int | None,
                 dtype=jnp.float32) -> jax.Array:
    """q · scale in `dtype` for the int8 [K, N] values of `integer_values`."""
    k, n = q.shape
    groups = 1 if group_size is None else k // group_size
    compute = jnp.promote_types(dtype, jnp.float32)  # exact for 16-bit scales; f64 in goldens
    per_group = scales.astype(compute).reshape(groups, 1, n)
    w = q.astype(compute).reshape(groups, k // groups, n) * per_group
    return w.reshape(k, n).astype(dtype)
