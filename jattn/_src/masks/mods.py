"""A library of mask_mods and score_mods.

mask_mod(b, h, q_idx, kv_idx) -> bool and score_mod(score, b, h, q_idx, kv_idx) -> score are
evaluated elementwise on broadcastable int32 index arrays (float32 scores), in kernels and in the
XLA path alike. Arrays the returned functions close over (slopes, tables, segment ids) become
kernel inputs, and score_mod captures receive gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jattn._src.masks.block_mask import MaskMod


# ---- masks ---------------------------------------------------------------------------------------

def noop_mask(b, h, q_idx, kv_idx):
    """Every pair attends."""
    return jnp.full(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx)), True)


def causal_mask(b, h, q_idx, kv_idx):
    """Query i attends to keys 0..i (top-left aligned)."""
    return q_idx >= kv_idx


def sliding_window(window: int) -> MaskMod:
    """Causal attention to the last `window` keys, the query's own included."""
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window: `window` must be a positive int, got {window!r}.")

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return sliding_window_mask


def prefix_lm(prefix_length: int) -> MaskMod:
    """Bidirectional attention inside the first `prefix_length` keys, causal after."""
    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_length) | (q_idx >= kv_idx)

    return prefix_lm_mask


def document_mask(segment_ids: jax.Array) -> MaskMod:
    """Attention only within a document: segment_ids [L] (shared) or [B, L] (per batch)."""
    segment_ids = jnp.asarray(segment_ids)
    if segment_ids.ndim not in (1, 2) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"document_mask: `segment_ids` must be an int array [L] or [B, L], got "
                         f"{segment_ids.dtype}{list(segment_ids.shape)}.")

    def document_mask_mod(b, h, q_idx, kv_idx):
        if segment_ids.ndim == 1:
            return segment_ids[q_idx] == segment_ids[kv_idx]
        return segment_ids[b, q_idx] == segment_ids[b, kv_idx]

    return document_mask_mod


def and_masks(*masks: MaskMod) -> MaskMod:
    """Attends where every mask attends."""
    def and_mask(b, h, q_idx, kv_idx):
        return functools.reduce(jnp.logical_and, (m(b, h, q_idx, kv_idx) for m in masks))

    return and_mask


def or_masks(*masks: MaskMod) -> MaskMod:
    """Attends where any mask attends."""
    def or_mask(b, h, q_idx, kv_idx):
        return functools.reduce(jnp.logical_or, (m(b, h, q_idx, kv_idx) for m in masks))

    return or_mask


# ---- score mods ----------------------------------------------------------------------------------

def alibi(slopes: jax.Array):
    """ALiBi: score + slopes[h] * (kv_idx - q_idx); slopes [H] (learnable)."""
    slopes = jnp.asarray(slopes)
    def alibi_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx).astype(score.dtype)

    return alibi_mod


def alibi_slopes(num_heads: int) -> jax.Array:
    """The standard ALiBi slopes 2^(-8 i / H), i = 1..H, float32 [H]."""
    return jnp.exp2(-8.0 * jnp.arange(1, num_heads + 1, dtype=jnp.float32) / num_heads)


def softcap(cap: float):
    """cap * tanh(score / cap) (Gemma 2 style logit soft-capping)."""
    def softcap_mod(score, b, h, q_idx, kv_idx):
        return cap * jnp.tanh(score / cap)

    return softcap_mod


def relative_position_bias(table: jax.Array):
    """score + table[h, kv_idx - q_idx + R]; table [H, 2R+1] (learnable), offsets clamped to ±R."""
    table = jnp.asarray(table)
    radius = (table.shape[-1] - 1) // 2

    def relative_bias_mod(score, b, h, q_idx, kv_idx):
        offset = jnp.clip(kv_idx - q_idx, -radius, radius) + radius
        return score + table[h, offset].astype(score.dtype)

    return relative_bias_mod
