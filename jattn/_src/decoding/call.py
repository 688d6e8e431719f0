"""A checked flex_decode call, as every backend of the op receives it.

Each backend module registered for flex_decode (decoding/xla.py, decoding/pallas_triton.py)
has the entry point of `DecodeBackend`, so that the op calls `implementation.module.decode` and
never asks which backend it has. Adding a backend to flex_decode is a module with that function
and a registry line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax

from jattn._src import guards
from jattn._src.decoding.paged import PagedKVCache
from jattn._src.masks.block_mask import BlockMask


class CacheDims(NamedTuple):
    """The cache's dimensions: heads, capacity, head dims, batch, and for a paged cache the
    page size and pool size (None for a contiguous one)."""

    Hkv: int
    S: int
    E: int
    Ev: int
    kv_batch: int
    page_size: int | None
    num_pages: int | None


class DecodeCall(NamedTuple):
    """flex_decode's arguments once checked.

    k, v: the contiguous cache, or (with `cache`) None; kv_len: int32 [B] (S everywhere when
    the caller gave none); static_length: the caller gave no kv_len; checked: the host held
    kv_len (and the page table) and found them good, so the program need not look for bad
    sequences; state: the mods' guards record (guards.read_state), for eager plans.
    """

    q: jax.Array
    k: jax.Array | None
    v: jax.Array | None
    cache: PagedKVCache | None
    score_mod: Callable | None
    block_mask: BlockMask | None
    dims: CacheDims
    kv_len: Any
    static_length: bool
    checked: bool
    scale: float
    config: Any
    implementation: Any
    precision: str | None
    state: guards.State


class DecodeBackend(Protocol):
    """What a backend module of flex_decode provides."""

    def decode(self, call: DecodeCall):
        """(out [B, Hq, Lq, Ev] of q's dtype, lse [B, Hq, Lq] float32) of a checked call
        with at least one query, key and sequence."""


def bad_lengths(xp, lengths, S: int, page_size: int | None, num_pages: int | None, table):
    """[B] bool: lengths outside [0, S] or reaching a page that is unassigned or outside the
    pool (a paged cache: page_size, num_pages and its table); xp: numpy for values on the
    host, jax.numpy in a program."""
    bad = (lengths < 0) | (lengths > S)
    if table is not None:
        needed = xp.arange(table.shape[1]) < ((lengths + page_size - 1) // page_size)[:, None]
        outside = (table < 0) | (table >= num_pages)
        bad = bad | (needed & outside).any(axis=1)
    return bad


@jax.custom_jvp
def no_gradient(arrays):
    """arrays, refusing to be differentiated in either mode (flex_decode is an inference
    kernel)."""
    return arrays


@no_gradient.defjvp
def _no_gradient_jvp(primals, tangents):
    raise NotImplementedError(
        "flex_decode has no gradient (nor forward-mode derivative): it is an inference kernel. "
        "Differentiate jattn.flex_attention instead (same q, k, v, score_mod and BlockMask; "
        "for decode-style positions pass the query offset through score_mod/mask_mod).")
