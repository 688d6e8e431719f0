"""A library of mask_mods and score_mods.

mask_mod(b, h, q_idx, kv_idx) -> bool and score_mod(score, b, h, q_idx, kv_idx) -> score are
evaluated elementwise on broadcastable int32 index arrays (float32 scores), in kernels and in the
XLA path alike. Arrays the returned mods hold (slopes, tables, segment ids) become kernel
inputs, and score_mod captures receive gradients.

The mods with parameters are pytrees (frozen dataclasses): their arrays are leaves, so a
BlockMask holding one passes new ids through `jax.jit` as arguments (no retrace), and an eager
call recognises a new mod of the same kind and shapes as one it has planned.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp

from jattn._src.masks.block_mask import MaskMod


def _library_mod(helper: str):
    """A frozen dataclass mod, registered as a pytree whose fields are all children, named
    `helper` in messages (`mod_name`)."""
    def register(cls):
        cls = dataclasses.dataclass(frozen=True, eq=False)(cls)  # hashed by identity
        cls.mod_name = helper
        fields = [f.name for f in dataclasses.fields(cls)]
        return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])
    return register


def _as_array(x) -> jax.Array:
    """x as a JAX array; an array (or tracer) as it is (jnp.asarray of one costs ~20 us, and
    a training loop makes its mods anew every step)."""
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


# ---- masks ---------------------------------------------------------------------------------------

def noop_mask(b, h, q_idx, kv_idx):
    """Every pair attends.

    Args:
      b, h, q_idx, kv_idx: int32 arrays (batch, query head, query and key positions) that
        broadcast together, e.g. [B, 1, 1, 1], [1, H, 1, 1], [1, 1, L, 1], [1, 1, 1, S].

    Returns:
      bool array that broadcasts with them, True where the query attends to the key.

    Example::

        dense = jattn.create_mask(jattn.masks.noop_mask, None, None, 4, 4)
        print(dense.shape, bool(dense.all()))  # (1, 1, 4, 4) True
    """
    return jnp.full(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx)), True)


def causal_mask(b, h, q_idx, kv_idx):
    """Query i attends to keys 0..i (top-left aligned). Arguments and result as `noop_mask`.

    Example::

        dense = jattn.create_mask(jattn.masks.causal_mask, None, None, 4, 4)
        print(dense.shape, int(dense.sum()))  # (1, 1, 4, 4) 10: the lower triangle
    """
    return q_idx >= kv_idx


def sliding_window(window: int) -> MaskMod:
    """Causal attention to the last `window` keys, the query's own included.

    Args:
      window: int >= 1, the keys each query attends to (itself and window - 1 before it), or a
        0-d integer array (a per-layer window under `jax.lax.scan`; not checked).

    Returns:
      A mask_mod `f(b, h, q_idx, kv_idx) -> bool` on int32 indices (as `causal_mask`).

    Example::

        dense = jattn.create_mask(jattn.masks.sliding_window(2), None, None, 4, 4)
        print(dense[0, 0].sum(axis=1))  # [1 2 2 2]; dense is bool (1, 1, 4, 4)
    """
    if hasattr(window, "dtype") and not isinstance(window, numbers.Integral):
        if not (jnp.issubdtype(window.dtype, jnp.integer) and jnp.ndim(window) == 0):
            raise ValueError(f"sliding_window: `window` must be a positive int or a 0-d "
                             f"integer array, got {window!r}.")
        return _SlidingWindow(window)
    if not isinstance(window, numbers.Integral) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window: `window` must be a positive int, got {window!r}.")
    return _SlidingWindow(int(window))


@_library_mod("jattn.masks.sliding_window")
class _SlidingWindow:
    window: Any

    def __call__(self, b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < self.window)


def prefix_lm(prefix_length: int) -> MaskMod:
    """Bidirectional attention inside the first `prefix_length` keys, causal after.

    Args:
      prefix_length: int, the keys every query attends to (the bidirectional prefix).

    Returns:
      A mask_mod `f(b, h, q_idx, kv_idx) -> bool` on int32 indices (as `causal_mask`).

    Example::

        dense = jattn.create_mask(jattn.masks.prefix_lm(2), None, None, 4, 4)
        print(dense[0, 0, 0])  # [ True  True False False]; dense is bool (1, 1, 4, 4)
    """
    if isinstance(prefix_length, bool) or (
            isinstance(prefix_length, numbers.Number) and not (
                isinstance(prefix_length, numbers.Integral) and prefix_length >= 0)) or (
            hasattr(prefix_length, "dtype") and not (
                jnp.issubdtype(prefix_length.dtype, jnp.integer)
                and jnp.ndim(prefix_length) == 0)):
        raise ValueError(f"prefix_lm: `prefix_length` must be an int >= 0 (or a 0-d integer "
                         f"array), got {prefix_length!r}.")
    return _PrefixLM(prefix_length)


@_library_mod("jattn.masks.prefix_lm")
class _PrefixLM:
    prefix_length: Any

    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx < self.prefix_length) | (q_idx >= kv_idx)


def document_mask(segment_ids: jax.Array) -> MaskMod:
    """Attention only within a document: segment_ids [L] (shared) or [B, L] (per batch).

    Args:
      segment_ids: integer array [L] or [B, L], L >= Q_LEN and KV_LEN (a shorter one raises
        ValueError when the mask is built or applied): the document of each position; a query
        attends to keys with the same id. Closed over, so it becomes a kernel input.

    Returns:
      A mask_mod `f(b, h, q_idx, kv_idx) -> bool` on int32 indices (as `causal_mask`).

    Example::

        ids = jnp.array([0, 0, 0, 1, 1, 2, 2, 2])  # three documents packed in L = 8
        mask_mod = jattn.masks.and_masks(jattn.masks.causal_mask, jattn.masks.document_mask(ids))
        dense = jattn.create_mask(mask_mod, None, None, 8, 8)
        print(dense[0, 0, 4].astype(int))  # [0 0 0 1 1 0 0 0]; dense is bool (1, 1, 8, 8)
    """
    segment_ids = _as_array(segment_ids)
    if segment_ids.ndim not in (1, 2) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"document_mask: `segment_ids` must be an int array [L] or [B, L], got "
                         f"{segment_ids.dtype}{list(segment_ids.shape)}.")

    return _DocumentMask(segment_ids)


@_library_mod("jattn.masks.document_mask")
class _DocumentMask:
    segment_ids: jax.Array

    def __call__(self, b, h, q_idx, kv_idx):
        ids = self.segment_ids
        if ids.ndim == 1:
            return ids[q_idx] == ids[kv_idx]
        return ids[b, q_idx] == ids[b, kv_idx]


def and_masks(*masks: MaskMod) -> MaskMod:
    """Attends where every mask attends.

    Args:
      *masks: mask_mods `f(b, h, q_idx, kv_idx) -> bool`.

    Returns:
      A mask_mod, the elementwise AND of theirs (bool, broadcast shape of their results).

    Example::

        mask_mod = jattn.masks.and_masks(jattn.masks.causal_mask,
                                         lambda b, h, q_idx, kv_idx: kv_idx % 2 == 0)
        mask = jattn.create_block_mask(mask_mod, None, None, 256, 256, block_size=64)
        print(mask.shape)  # (1, 1, 256, 256)
    """
    return _AndMasks(masks)


@_library_mod("jattn.masks.and_masks")
class _AndMasks:
    masks: tuple

    def __call__(self, b, h, q_idx, kv_idx):
        return functools.reduce(jnp.logical_and, (m(b, h, q_idx, kv_idx) for m in self.masks))


def or_masks(*masks: MaskMod) -> MaskMod:
    """Attends where any mask attends.

    Args:
      *masks: mask_mods `f(b, h, q_idx, kv_idx) -> bool`.

    Returns:
      A mask_mod, the elementwise OR of theirs (bool, broadcast shape of their results).

    Example::

        mask_mod = jattn.masks.or_masks(jattn.masks.sliding_window(32),
                                        lambda b, h, q_idx, kv_idx: kv_idx < 4)  # + sinks
        mask = jattn.create_block_mask(mask_mod, None, None, 256, 256, block_size=32)
        print(mask.shape)  # (1, 1, 256, 256)
    """
    return _OrMasks(masks)


@_library_mod("jattn.masks.or_masks")
class _OrMasks:
    masks: tuple

    def __call__(self, b, h, q_idx, kv_idx):
        return functools.reduce(jnp.logical_or, (m(b, h, q_idx, kv_idx) for m in self.masks))


# ---- score mods ----------------------------------------------------------------------------------

def alibi(slopes: jax.Array):
    """ALiBi: score + slopes[h] * (kv_idx - q_idx); slopes [H] (learnable).

    Args:
      slopes: float array [H], one slope per query head (e.g. `alibi_slopes(H)`); closed over,
        so it becomes a kernel input and receives gradients.

    Returns:
      A score_mod `f(score, b, h, q_idx, kv_idx) -> score`: float32 scores, int32 indices.

    Example::

        q = k = v = jnp.ones((1, 4, 128, 32), jnp.float32)  # [B, H, L, E]
        out = jattn.flex_attention(q, k, v, jattn.mods.alibi(jattn.mods.alibi_slopes(4)))
        print(out.shape)  # (1, 4, 128, 32)
    """
    slopes = _as_array(slopes)
    if slopes.ndim != 1:
        raise ValueError(f"alibi: `slopes` must be one slope per query head, shape [H], got "
                         f"shape {tuple(slopes.shape)}.")
    return _Alibi(slopes)


@_library_mod("jattn.mods.alibi")
class _Alibi:
    slopes: jax.Array

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score + self.slopes[h] * (kv_idx - q_idx).astype(score.dtype)


def alibi_slopes(num_heads: int) -> jax.Array:
    """The standard ALiBi slopes 2^(-8 i / H), i = 1..H, float32 [H].

    Args:
      num_heads: int H, the number of query heads.

    Returns:
      float32 [H].

    Example::

        slopes = jattn.mods.alibi_slopes(4)
        print(slopes.dtype, slopes.tolist())  # float32 [0.25, 0.0625, 0.015625, 0.00390625]
    """
    return jnp.exp2(-8.0 * jnp.arange(1, num_heads + 1, dtype=jnp.float32) / num_heads)


def softcap(cap: float):
    """cap * tanh(score / cap) (Gemma 2 style logit soft-capping).

    Args:
      cap: float > 0, the bound on |score|.

    Returns:
      A score_mod `f(score, b, h, q_idx, kv_idx) -> score`: float32 scores, int32 indices.

    Example::

        q = k = v = jnp.ones((1, 2, 128, 32), jnp.bfloat16)  # [B, H, L, E]
        out = jattn.flex_attention(q, k, v, jattn.mods.softcap(50.0))
        print(out.shape, out.dtype)  # (1, 2, 128, 32) bfloat16
    """
    return _Softcap(cap)


@_library_mod("jattn.mods.softcap")
class _Softcap:
    cap: Any

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.cap * jnp.tanh(score / self.cap)


def relative_position_bias(table: jax.Array):
    """score + table[h, kv_idx - q_idx + R]; table [H, 2R+1] (learnable), offsets clamped to ±R.

    Args:
      table: float array [H, 2R+1], a bias per query head and relative offset -R..R; closed
        over, so it becomes a kernel input and receives gradients.

    Returns:
      A score_mod `f(score, b, h, q_idx, kv_idx) -> score`: float32 scores, int32 indices.

    Example::

        table = jnp.zeros((2, 17), jnp.float32)  # H = 2, R = 8
        q = k = v = jnp.ones((1, 2, 64, 32), jnp.float32)
        loss = lambda t: jattn.flex_attention(
            q, k, v, jattn.mods.relative_position_bias(t)).sum()
        print(jax.grad(loss)(table).shape)  # (2, 17)
    """
    table = _as_array(table)
    if table.ndim != 2 or table.shape[1] % 2 != 1:
        raise ValueError(f"relative_position_bias: `table` must be [H, 2R+1] (a bias per query "
                         f"head and offset -R..R: an odd width), got shape "
                         f"{tuple(table.shape)}.")
    return _RelativePositionBias(table)


@_library_mod("jattn.mods.relative_position_bias")
class _RelativePositionBias:
    table: jax.Array

    def __call__(self, score, b, h, q_idx, kv_idx):
        radius = (self.table.shape[-1] - 1) // 2
        offset = jnp.clip(kv_idx - q_idx, -radius, radius) + radius
        return score + self.table[h, offset].astype(score.dtype)
