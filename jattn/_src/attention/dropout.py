"""Dropout of the attention weights: P' = P ∘ keep / (1 - rate).

Whether weight (b, h, q, kv) is kept is a hash of the call's seed and those four positions,
so every implementation draws the same mask, block by block, without storing it: the backward
recomputes it where it recomputes P. The seed is the two uint32 words of the caller's JAX PRNG
key (drawn from it for implementations whose keys hold more); the kernels read it as the last
of the mask_mod's captured arrays (`with_seed`, `split`), so it travels wherever those do.
The hash: murmur3's 32-bit finaliser (a bijection with full avalanche) gives a per-(b, h)
key, and from it one word per row and one per key position; a weight's bits are those two
words xored and mixed by a shortened finaliser (multiply, xorshift, multiply), so that a score
tile spends six integer operations a weight where a full finaliser of the four positions
spends eleven: on the H100 and H200 the hash is most of what dropout costs a kernel.
int32 arithmetic that wraps and logical shifts, which XLA, Triton and the Pallas interpreter
compute alike. A weight is kept where the hash, unsigned, reaches round(rate · 2³²).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

_MIX1, _MIX2 = -2048144789, -1028477387  # 0x85EBCA6B, 0xC2B2AE35 as int32
_GOLDEN = -1640531527  # 0x9E3779B9 as int32: odd, so kv -> kv·_GOLDEN is a bijection


class Dropout(NamedTuple):
    """A call's dropout: the rate (static), the seed (None without dropout) and whether every
    batch and head shares one mask (static)."""

    rate: float
    seed: jax.Array | None
    shared: bool = False


NO_DROPOUT = Dropout(0.0, None)


def checked_dropout(fn: str, rate, key, *, shared: bool = False) -> Dropout:
    """The Dropout of a call's `dropout_rate` and `dropout_key` (NO_DROPOUT for rate 0); bad
    values raise naming the argument."""
    if isinstance(rate, (bool, str, bytes)) or not hasattr(rate, "__float__"):
        raise TypeError(f"{fn}: `dropout_rate` must be a Python float in [0, 1), got "
                        f"{type(rate).__name__} {rate!r}.")
    try:
        rate = float(rate)
    except jax.errors.ConcretizationTypeError:
        raise TypeError(f"{fn}: `dropout_rate` must be a Python float, but a traced value was "
                        "given (under jax.jit, grad or vmap): the rate is compiled into the "
                        "kernels. Pass a float; the key may be traced.") from None
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{fn}: `dropout_rate` must be in [0, 1), got {rate!r}.")
    if rate == 0.0:
        return NO_DROPOUT
    if key is None:
        raise ValueError(f"{fn}: dropout_rate={rate} needs a `dropout_key` (a JAX PRNG key, "
                         "e.g. jax.random.key(0), split anew for every step).")
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if key.shape != () if typed else (key.shape != (2,) or key.dtype != jnp.uint32):
        raise TypeError(f"{fn}: `dropout_key` must be one JAX PRNG key (jax.random.key(0), or "
                        f"a legacy jax.random.PRNGKey), got {key.dtype} of shape {key.shape}.")
    # The key's own two words where it has two (threefry, JAX's default: no computation to
    # dispatch on an eager call), else two drawn from it; the hash mixes them either way.
    words = jax.random.key_data(key) if typed else key
    if words.shape != (2,):
        words = jax.random.bits(key, (2,), jnp.uint32)
    return Dropout(rate, words, bool(shared))


def with_seed(mask_captures: tuple, seed: jax.Array | None) -> tuple:
    """The mask_mod's captured arrays and, with dropout, the seed after them."""
    return tuple(mask_captures) if seed is None else (*mask_captures, seed)


def split(p, mask_captures):
    """(the mask_mod's captured arrays, the seed or None) of problem p's call."""
    if not p.dropout:
        return mask_captures, None
    return mask_captures[:-1], mask_captures[-1]


def threshold(rate: float) -> int:
    """Kept where the hash, unsigned, is >= this."""
    return min(round(rate * 2 ** 32), 2 ** 32 - 1)


def _mix(x):
    x = x ^ lax.shift_right_logical(x, jnp.int32(16))
    x = x * jnp.int32(_MIX1)
    x = x ^ lax.shift_right_logical(x, jnp.int32(13))
    x = x * jnp.int32(_MIX2)
    return x ^ lax.shift_right_logical(x, jnp.int32(16))


def kept(p, seed0, seed1, b, h, q_idx, kv_idx):
    """Whether each weight of problem p's call at (b, h, q_idx, kv_idx) is kept (broadcast
    int32 positions; seed0, seed1 the seed's words). With p.dropout_shared every batch and head
    draws the same mask (Flax's broadcast_dropout)."""
    head = _head(p, seed0, seed1, b, h)
    # per row and per key position: vectors in a kernel's tile, mixed once each
    return kept_from_words(p, _row_word(head, q_idx), _column_word(head, kv_idx))


def word_tables(p, seed) -> tuple[jax.Array, jax.Array]:
    """The row words [Bd, Hd, L] and key words [Bd, Hd, S] (int32) of `kept` for the call's
    `seed`, Bd = B and Hd = Hq (1 and 1 with p.dropout_shared): for kernels that read them
    from memory by position rather than hash positions in their tiles (pallas_mosaic_gpu)."""
    batches, heads = (1, 1) if p.dropout_shared else (p.B, p.Hq)
    head = _head(p, seed[0], seed[1], jnp.arange(batches, dtype=jnp.int32)[:, None, None],
                 jnp.arange(heads, dtype=jnp.int32)[None, :, None])
    return (_row_word(head, jnp.arange(p.L, dtype=jnp.int32)),
            _column_word(head, jnp.arange(p.S, dtype=jnp.int32)))


def kept_from_words(p, row, column):
    """`kept` from a weight's row word and key word (broadcast int32)."""
    bits = (row ^ column) * jnp.int32(_MIX1)
    bits = (bits ^ lax.shift_right_logical(bits, jnp.int32(15))) * jnp.int32(_MIX2)
    return (lax.convert_element_type(bits, jnp.uint32)
            >= jnp.uint32(threshold(p.dropout)))


def _head(p, seed0, seed1, b, h):
    # (uint32 seed words become the int32 of the same bits)
    seed0, seed1, b, h = (lax.convert_element_type(x, jnp.int32) for x in (seed0, seed1, b, h))
    if p.dropout_shared:
        b = h = jnp.int32(0)
    return _mix(seed0 ^ _mix(seed1 + (b * jnp.int32(p.Hq) + h) * jnp.int32(_GOLDEN)))


def _row_word(head, q_idx):
    return _mix(head ^ (lax.convert_element_type(q_idx, jnp.int32) * jnp.int32(_MIX2)))


def _column_word(head, kv_idx):
    return _mix((head ^ jnp.int32(_GOLDEN))
                + lax.convert_element_type(kv_idx, jnp.int32) * jnp.int32(_GOLDEN))


def _weights_scale(p) -> float:
    """1 / (1 - rate): what kept weights are multiplied by."""
    return 1.0 / (1.0 - p.dropout)


def dropped(p, keep, x):
    """x (the weights P, or dP) through the dropout mask `keep`: kept entries scaled by
    1 / (1 - rate), the others 0; x itself where keep is None (no dropout)."""
    if keep is None:
        return x
    return jnp.where(keep, x * _weights_scale(p), 0.0)
