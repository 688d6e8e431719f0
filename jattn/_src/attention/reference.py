"""A dense attention oracle for tests: plain jnp, O(L·S) memory, any float precision."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jattn._src.masks.block_mask import BlockMask


def element_mask(block_mask: BlockMask, B: int, H: int) -> jax.Array:
    """[B|1, H|1, L, S] bool: full blocks attend, partial blocks where mask_mod says so."""
    bq, bk = block_mask.block_size
    L, S = block_mask.seq_lengths
    q = jnp.arange(L, dtype=jnp.int32)[:, None]
    kv = jnp.arange(S, dtype=jnp.int32)[None, :]
    full = block_mask.full_blocks()[:, :, q // bq, kv // bk]
    partial = block_mask.partial_blocks()[:, :, q // bq, kv // bk]
    if block_mask.mask_mod is not None:
        b = jnp.arange(partial.shape[0], dtype=jnp.int32)[:, None, None, None]
        h = jnp.arange(partial.shape[1], dtype=jnp.int32)[None, :, None, None]
        partial = partial & block_mask.mask_mod(b, h, q, kv)
    return full | partial


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array,
                        score_mod: Callable[..., jax.Array] | None = None,
                        block_mask: BlockMask | None = None, *, scale: float | None = None,
                        dropout: tuple[jax.Array, float] | None = None):
    """softmax(score_mod(scale·q·kᵀ) masked)·v and the natural-log LSE [B, Hq, L] (float32+).

    Scores and softmax run in float32 (float64 for float64 inputs); the probabilities are cast to
    v's dtype before the P·V product, as in the kernels. Fully masked rows give 0 and -inf.
    dropout: (kept [B|1, Hq|1, L, S] bool, rate): the probabilities where kept, over 1 - rate
    (the LSE stays the softmax's).
    """
    B, Hq, L, E = q.shape
    Hkv = k.shape[1]
    acc = jnp.promote_types(q.dtype, jnp.float32)
    scale = E ** -0.5 if scale is None else scale
    k = jnp.repeat(k, Hq // Hkv, axis=1)
    v = jnp.repeat(v, Hq // Hkv, axis=1)
    s = jnp.einsum("bhle,bhse->bhls", q, k, preferred_element_type=acc) * scale
    b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(Hq, dtype=jnp.int32)[None, :, None, None]
    q_idx = jnp.arange(L, dtype=jnp.int32)[None, None, :, None]
    kv_idx = jnp.arange(k.shape[2], dtype=jnp.int32)[None, None, None, :]
    if score_mod is not None:
        s = score_mod(s, b, h, q_idx, kv_idx).astype(acc)
    if block_mask is not None:
        s = jnp.where(element_mask(block_mask, B, Hq), s, -jnp.inf)
    # Softmax written out so that fully masked rows have finite gradients (no 0/0 anywhere).
    m = jax.lax.stop_gradient(s.max(axis=-1, keepdims=True))
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = e.sum(axis=-1, keepdims=True)
    l_safe = jnp.where(l == 0, 1.0, l)
    p = e / l_safe
    if dropout is not None:
        kept, rate = dropout
        p = jnp.where(kept, p / (1 - rate), 0.0)
    lse = jnp.where(l == 0, -jnp.inf, jnp.log(l_safe) + jnp.where(jnp.isfinite(m), m, 0.0))[..., 0]
    out = jnp.einsum("bhls,bhse->bhle", p.astype(v.dtype), v, preferred_element_type=acc)
    return out.astype(q.dtype), lse
