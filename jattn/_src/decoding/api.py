"""Public flex decoding: validation, positions and lengths, backend choice, cached programs."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jattn._src import backends, guards, index_bounds
from jattn._src.attention.common import canonical_scale
from jattn._src.attention.sinks import checked_sinks, with_sinks
from jattn._src.attention.split_kv_config import DecodeConfig
from jattn._src.decoding import pallas_triton, xla
from jattn._src.decoding.call import CacheDims, DecodeCall, bad_lengths
from jattn._src.decoding.paged import PagedKVCache, concrete
from jattn._src.masks.block_mask import BlockMask, check_block_counts
from jattn._src.masks.fitting import fitted
from jattn._src.precision import canonical as canonical_precision

_OP = "flex_decode"
# The split-KV kernel runs a few queries per sequence; the XLA implementation (and longer query
# blocks on any backend) runs flex_attention over the cache. Each module's `decode(call)`.
backends.register_xla_and_kernels(_OP, xla, pallas_triton, config_class=DecodeConfig)

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------

def _kv_shapes(q, k, v):
    """(Hkv, S, E, Ev, kv_batch, page_size, num_pages) of contiguous k/v or a PagedKVCache."""
    if isinstance(k, PagedKVCache):
        if v is not None:
            raise ValueError("flex_decode: with a PagedKVCache as `k`, pass v=None (the cache "
                             "holds both pools).")
        k.check()
        if k.batch != q.shape[0]:
            raise ValueError(f"flex_decode: the page table has {k.batch} rows but q has batch "
                             f"{q.shape[0]}.")
        return (k.num_kv_heads, k.capacity, k.k_pages.shape[3], k.v_pages.shape[3], 1,
                k.page_size, k.num_pages), k.k_pages.dtype
    for name, x in (("k", k), ("v", v)):
        if x is None or jnp.ndim(x) != 4:
            raise ValueError(f"flex_decode: `{name}` must be [batch, kv_heads, length, dim] (or "
                             f"`k` a PagedKVCache), got {None if x is None else jnp.shape(x)}.")
    if k.shape[:3] != v.shape[:3] or k.shape[0] not in (q.shape[0], 1):
        raise ValueError(f"flex_decode: k {k.shape} and v {v.shape} must agree on batch, heads "
                         f"and length, with batch {q.shape[0]} (q's) or 1.")
    if k.dtype != v.dtype:
        raise TypeError(f"flex_decode: k ({k.dtype}) and v ({v.dtype}) must share a dtype.")
    _, Hkv, S, E = k.shape
    return (Hkv, S, E, v.shape[3], k.shape[0], None, None), k.dtype


def _check_heads_and_dtypes(q, Hkv: int, E: int, Ev: int, kv_dtype) -> None:
    if q.dtype not in _DTYPES or q.dtype != kv_dtype:
        raise TypeError(f"flex_decode: q ({q.dtype}) and k/v ({kv_dtype}) must share one of "
                        "bfloat16, float16, float32.")
    if 0 in (q.shape[1], Hkv, E, Ev):
        raise ValueError(f"flex_decode: q and k/v need at least one head and a head dim of at "
                         f"least 1, got q {q.shape}, {Hkv} kv heads and head dims {E} (k) and "
                         f"{Ev} (v).")
    if q.shape[1] % Hkv:
        raise ValueError(f"flex_decode: query heads {q.shape[1]} must be a multiple of kv heads "
                         f"{Hkv} (q {q.shape}).")
    if q.shape[3] != E:
        raise ValueError(f"flex_decode: q's head dim {q.shape[3]} differs from k's {E}.")


def _lengths(kv_len, B: int, S: int, cache: PagedKVCache | None):
    """(kv_len as int32 [B] (S everywhere for None), its values on the host or None): values
    the host holds (an int, numpy, a JAX array on the CPU) are checked here and bad ones raise:
    a length outside [0, S], or, with a cache, a page below the length that is unassigned or
    outside the pool. Others (traced, or on an accelerator, which the host would wait for) are
    checked by the program, which makes the rows of bad sequences NaN (host values None)."""
    if type(B) is not int:  # a symbolic batch (jax.export): lengths are checked in the program
        return jnp.broadcast_to(jnp.asarray(S if kv_len is None else kv_len, jnp.int32), (B,)), None
    if kv_len is None:
        # numpy: under jit a constant, not a broadcast XLA runs as a kernel of its own per call
        kv_len = np.full((B,), S, np.int32)
        if cache is None:
            return kv_len, kv_len
    elif not isinstance(kv_len, (int, np.integer)) and (
            not hasattr(kv_len, "dtype") or not jnp.issubdtype(kv_len.dtype, jnp.integer)
            or jnp.ndim(kv_len) > 1 or (jnp.ndim(kv_len) == 1 and jnp.shape(kv_len)[0] not in (
                1, B))):
        raise ValueError(f"flex_decode: `kv_len` must be an int scalar or [{B}] array, got "
                         f"{getattr(kv_len, 'dtype', type(kv_len).__name__)}"
                         f"{list(jnp.shape(kv_len))}.")
    table = None if cache is None else cache.page_table
    known = [_on_host(kv_len), None if table is None else _on_host(table)]
    if not any(x is None for x in known[:1 + (cache is not None)]):
        lengths = np.broadcast_to(known[0].astype(np.int32), (B,))
        page_size, num_pages = (None, None) if cache is None else (cache.page_size,
                                                                     cache.num_pages)
        bad = bad_lengths(np, lengths, S, page_size, num_pages, known[1])
        if bad.any():
            b = int(np.argmax(bad))
            raise ValueError(f"flex_decode: kv_len[{b}] = {int(lengths[b])} is outside [0, {S}] "
                             "(the cache length) or reaches a page the page table leaves "
                             "unassigned or points outside the pool.")
        if isinstance(kv_len, jax.Array) and kv_len.dtype == jnp.int32 and kv_len.shape == (B,):
            return kv_len, lengths  # already an array as the kernels read it
        lengths = np.ascontiguousarray(lengths)
        return lengths, lengths
    if not (isinstance(kv_len, jax.Array) and kv_len.dtype == jnp.int32
            and kv_len.shape == (B,)):
        kv_len = jnp.broadcast_to(jnp.asarray(kv_len).astype(jnp.int32), (B,))
    return kv_len, None


def _query_positions(lengths: np.ndarray | None, Lq: int) -> tuple[int, int] | None:
    """The first and last query positions (kv_len - Lq + i) a call certainly has, for the
    read checks; None where the lengths are not on the host (or a position is negative)."""
    if lengths is None or lengths.size == 0 or int(lengths.min()) < Lq:
        return None
    return int(lengths.min()) - Lq, int(lengths.max()) - 1


def _on_host(x) -> np.ndarray | None:
    """x as numpy where the host has its value for free; None for a traced value or an array
    on an accelerator."""
    if isinstance(x, jax.Array) and (isinstance(x, jax.core.Tracer) or any(
            d.platform != "cpu" for d in x.devices())):
        return None
    return concrete(x)


def _check_block_mask(block_mask, B: int, Hq: int, S: int) -> None:
    if not isinstance(block_mask, BlockMask):
        raise TypeError("flex_decode: `block_mask` must be a jattn.BlockMask, got "
                        f"{type(block_mask).__name__}.")
    check_block_counts(block_mask, "flex_decode")
    Bm, Hm, Q_LEN, KV_LEN = block_mask.shape
    if KV_LEN != S or Q_LEN < S:
        raise ValueError(f"flex_decode: block_mask covers (Q_LEN={Q_LEN}, KV_LEN={KV_LEN}); a "
                         f"decode mask is indexed by absolute positions, so build it for "
                         f"({S}, {S}), the cache length (e.g. create_block_mask(mask_mod, B, H, "
                         f"{S}, {S})).")
    if Bm not in (1, B) or Hm not in (1, Hq):
        raise ValueError(f"flex_decode: block_mask batch/heads ({Bm}, {Hm}) must be 1 or match "
                         f"q's ({B}, {Hq}).")


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------

def flex_decode(q: jax.Array, k, v, score_mod: Callable | None = None,
                block_mask: BlockMask | None = None, *, kv_len=None, scale: float | None = None,
                return_lse: bool = False, config: DecodeConfig | None = None,
                implementation: str | None = None, precision: str | None = None,
                sinks: jax.Array | None = None):
    """Attention of a few new queries per sequence over a KV cache (decoding), split over keys.

        cache positions of sequence b:  0 1 2 ... kv_len[b]-Lq ... kv_len[b]-1 | kv_len[b] ... S-1
        queries (Lq = 3):                            q0         q1    q2       |  (not read)

    Args:
      q: [B, Hq, Lq, E], Lq small (1-16 run the decode kernel; longer blocks fall back to
        flex_attention over the whole cache). Query i of sequence b is at position
        kv_len[b] - Lq + i; score_mod and mask_mod receive that position as q_idx.
      k, v: a contiguous cache [B|1, Hkv, S, E] and [B|1, Hkv, S, Ev], or k a PagedKVCache (S:
        its capacity) and v None. bfloat16, float16 or float32, q's dtype; Hq % Hkv == 0.
      score_mod: `f(score, b, h, q_idx, kv_idx)` as in flex_attention (arrays it closes over
        become kernel inputs).
      block_mask: a BlockMask built for (S, S), the cache length, at logical positions (also
        for a paged cache): each query uses the row of its position; partial blocks apply the
        mask_mod, full blocks skip it. Batch and heads 1 or (B, Hq); a per-head mask gives every
        query head its own program (K/V read once per head instead of per kv head).
      kv_len: int [B] (or scalar) valid keys per sequence, at most S (default S). Keys at and
        past it are never read, so stale or unassigned cache slots are harmless.
      scale: default 1/sqrt(E). return_lse: also return the natural-log LSE [B, Hq, Lq].
      config: a DecodeConfig (None: heuristic; the split count from the device's SMs).
      implementation: "pallas_triton", "xla" or "interpret" (default: $JATTN_IMPLEMENTATION,
        else by platform; `jattn.explain` says which and why).
      precision: float32 products, as in flex_attention (None: the caller's setting).
      sinks: attention sinks [Hq], one logit per query head, as in flex_attention.

    Returns:
      out [B, Hq, Lq, Ev] of q's dtype (and the LSE). A query that attends to nothing (kv_len 0,
      or a position below 0) gives 0 and LSE -inf. Paged and contiguous caches with the same
      contents give bitwise equal results for the same config.

    Example::

        # one new token per sequence, caches of different lengths
        q = jnp.ones((2, 8, 1, 64), jnp.bfloat16)  # q [B, Hq, 1, E]
        k_cache = v_cache = jnp.ones((2, 2, 256, 64), jnp.bfloat16)  # [B, Hkv, S, E]
        lengths = jnp.array([100, 256])
        out = jattn.flex_decode(q, k_cache, v_cache, kv_len=lengths)
        print(out.shape)  # (2, 8, 1, 64)

    Bad values raise ValueError where the host holds them (an int, numpy, arrays on the CPU):
    kv_len outside [0, S], a page below kv_len unassigned or outside the pool. Under jit, and
    for arrays on an accelerator (not read back: the host would wait for the device on every
    call), the rows of such a sequence come out NaN; nothing is read or written out of bounds
    either way. Not differentiable: jax.grad raises (use flex_attention to train).
    """
    q = q if isinstance(q, jax.Array) else jnp.asarray(q)
    cache = k if isinstance(k, PagedKVCache) else None
    if cache is None and k is not None and v is not None:
        k, v = (x if isinstance(x, jax.Array) else jnp.asarray(x) for x in (k, v))
    dims = _checked_dims(q, k, v, score_mod, block_mask, config)
    sinks = checked_sinks(_OP, sinks, q.shape[1])
    block_mask = None if block_mask is None else fitted(block_mask)  # the kernels' blocks
    B, Hq, Lq, E = q.shape
    implementation = backends.resolve(_OP, implementation, dtype=q.dtype, head_dim=E,
                                      value_dim=dims.Ev)
    scale = canonical_scale(_OP, scale, E)
    precision = canonical_precision(_OP, precision)
    static_length = kv_len is None
    kv_len, host_lengths = _lengths(kv_len, B, dims.S, cache)
    checked = host_lengths is not None
    state = guards.read_state(score_mod, None if block_mask is None else block_mask.mask_mod)
    _check_reads(score_mod, block_mask, state, q.shape, dims.S, host_lengths)

    if 0 in (B, Lq, dims.S):  # nothing to compute: empty, or no key to attend to
        out = jnp.zeros_like(q, shape=(B, Hq, Lq, dims.Ev))  # (on q's device)
        lse = jnp.full_like(q, -jnp.inf, jnp.float32, shape=(B, Hq, Lq))
    else:
        out, lse = implementation.module.decode(DecodeCall(
            q, k, v, cache, score_mod, block_mask, dims, kv_len, static_length, checked, scale,
            config, implementation, precision, state))
    if sinks is not None:
        out, lse = with_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


def _check_reads(score_mod, block_mask, state: guards.State, q_shape, S: int,
                 host_lengths: np.ndarray | None) -> None:
    """index_bounds' check of the mods' reads at the call's positions (the query positions
    where the host holds kv_len), skipped for mods already checked at these sizes."""
    B, Hq, Lq, _ = q_shape
    mask_mod = None if block_mask is None else block_mask.mask_mod
    index_bounds.check_mods(
        _OP, [("score_mod", score_mod, state.record), ("mask_mod", mask_mod, state.record)],
        dict(b=B, h=Hq, q_idx=_query_positions(host_lengths, Lq), kv_idx=S))


def _checked_dims(q, k, v, score_mod, block_mask, config) -> CacheDims:
    """The call's checks (clear errors for bad arguments) and the cache's dimensions."""
    if q.ndim != 4:
        raise ValueError(f"flex_decode: `q` must be [batch, heads, queries, dim], got {q.shape}.")
    shapes, kv_dtype = _kv_shapes(q, k, v)
    dims = CacheDims(*shapes)
    _check_heads_and_dtypes(q, dims.Hkv, dims.E, dims.Ev, kv_dtype)
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"flex_decode: `score_mod` must be callable, got {score_mod!r}.")
    if config is not None and not isinstance(config, DecodeConfig):
        raise TypeError(f"flex_decode: `config` must be a DecodeConfig, got {config!r}.")
    if block_mask is not None:
        _check_block_mask(block_mask, q.shape[0], q.shape[1], dims.S)
    return dims


