"""Flex attention through XLA: a scan over key/value blocks with an online softmax.

Memory is O(L · block) per step, never L x S. One step is one BlockMask column of blocks, so
the block tables (partial / full) apply directly. Query heads are grouped by their kv head
([B, Hkv, G, L, ...]) so K and V are never repeated. The backward recomputes scores block by
block and also yields gradients for arrays captured by score_mod (through `jax.vjp` of the mod).

A key a query does not read (outside its blocks, or given zero weight) cannot affect it, NaN
included: products with K and V never multiply a zero weight by a non-finite row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jattn._src import deterministic
from jattn._src.attention import dropout
from jattn._src.attention.common import Mods, Problem
from jattn._src.constants import MASK_VALUE
from jattn._src.masks.block_mask import MaskLists
from jattn._src.mesh_axes import aligned
from jattn._src.tiling import cdiv


# The pullback of score_mod for gradients of captured arrays: scatter-adds summed in integers,
# so the gradients are bitwise reproducible on the GPU (benchmarks swap in jax.vjp to time it).
capture_vjp = deterministic.vjp


def specialise(p: Problem, *, score_mod, mask_mod, score_set, mask_set, block_mask,
               config) -> Problem:
    """p as it is: XLA runs every pass on the mods traced at its block (p.xla)."""
    del score_mod, mask_mod, score_set, mask_set, block_mask, config
    return p


def block_signature(B: int, Hkv: int, groups: int, L: int, block: int,
                    score_dtype=jnp.float32):
    """Argument shapes of score_mod / mask_mod on one XLA block [B, Hkv, G, L, block]."""
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    score = jax.ShapeDtypeStruct((B, Hkv, groups, L, block), score_dtype)
    return score, (i32(B, 1, 1, 1, 1), i32(1, Hkv, groups, 1, 1), i32(1, 1, 1, L, 1),
                   i32(1, 1, 1, 1, block))


def _indices(p: Problem, j):
    """(b, h, q_idx, kv_idx) of key block j, broadcasting to [B, Hkv, G, L, block]."""
    b = jnp.arange(p.B, dtype=jnp.int32)[:, None, None, None, None]
    h = jnp.arange(p.Hq, dtype=jnp.int32).reshape(1, p.Hkv, p.groups, 1, 1)
    q = jnp.arange(p.L, dtype=jnp.int32)[None, None, None, :, None]
    kv = j * p.mask_block[1] + jnp.arange(p.mask_block[1], dtype=jnp.int32)
    return b, h, q, kv[None, None, None, None, :]


def _blocked_kv(p: Problem, x: jax.Array) -> jax.Array:
    """[Bk, Hkv, S, D] -> [nKV, B, Hkv, block, D], zero-padded to whole blocks."""
    bk = p.mask_block[1]
    n = cdiv(p.S, bk)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, n * bk - p.S), (0, 0)))
    x = jnp.broadcast_to(x, (p.B, *x.shape[1:]))
    return jnp.moveaxis(x.reshape(p.B, p.Hkv, n, bk, x.shape[-1]), 2, 0)


def _rows_of(p: Problem, table: jax.Array) -> jax.Array:
    """A [Bm, Hm, nQ] block column -> [Bm, Hkv|1, G|1, L, 1] per query row."""
    if p.mask_heads == p.Hq:
        table = table.reshape(table.shape[0], p.Hkv, p.groups, -1)
    else:
        table = table[:, :, None, :]
    return table[..., jnp.arange(p.L) // p.mask_block[0]][..., None]


def _scores(p: Problem, mods: Mods, score_captures, mask_captures, qg, k_block, partial, full,
            j):
    """Raw and modded scores of one block and its keep mask."""
    b, h, q, kv = _indices(p, j)
    raw = jnp.einsum("bhgle,bhke->bhglk", qg, k_block,
                     preferred_element_type=p.compute_dtype) * p.scale
    s = raw if mods.score is None else mods.score(score_captures, raw, b, h, q, kv)[0]
    attends = _rows_of(p, full)
    if mods.mask is not None:
        attends = attends | (_rows_of(p, partial) & mods.mask(mask_captures, b, h, q, kv)[0])
    else:
        attends = attends | _rows_of(p, partial)
    keep = attends & (kv < p.S)
    return raw, s, keep


def _kept(p: Problem, seed, j):
    """The dropout mask of key block j [B, Hkv, G, L, block] (None without dropout)."""
    if seed is None:
        return None
    return dropout.kept(p, seed[0], seed[1], *_indices(p, j))


def _block_columns(lists: MaskLists):
    return [jnp.moveaxis(t, -1, 0) for t in lists.dense()]  # [nKV, Bm, Hm, nQ] each


def _weighted_rows(weights, rows, spec: str, **einsum_options):
    """einsum(spec, weights [B, Hkv, G, L, block], rows [B, Hkv, block, D]) where a zero weight
    never meets a non-finite row (0 * NaN is NaN): rows with NaN or inf count only where
    weighted, and then make the result NaN. Costs one isfinite pass unless a block has one."""
    finite = jnp.isfinite(rows).all(axis=-1)  # [B, Hkv, block]

    def guarded():
        clean = jnp.where(finite[..., None], rows, 0)
        out = jnp.einsum(spec, weights, clean, **einsum_options)
        read = ((weights != 0) & ~finite[:, :, None, None, :]).any(axis=-1, keepdims=True)
        return jnp.where(read, jnp.nan, out).astype(out.dtype)

    return lax.cond(finite.all(), lambda: jnp.einsum(spec, weights, rows, **einsum_options),
                    guarded)


def _zeros(shape, dtype, *inputs) -> jax.Array:
    """Zeros of `shape` that, under shard_map, vary over every mesh axis one of `inputs` varies
    over: a scan's initial carry must have the type of the carry its step computes from them.
    Outside shard_map, plain zeros."""
    return aligned(jnp.zeros(shape, dtype), *inputs)[0]


def forward(p: Problem, q, k, v, lists: MaskLists, score_caps: Sequence[Any],
            mask_caps: Sequence[Any]):
    """(out [B, Hq, L, Ev] of q.dtype, lse [B, Hq, L] of p.compute_dtype, natural log), and
    with p.max_scores each row's largest score [B, Hq, L] (-inf where it attends to nothing)."""
    qg = q.reshape(p.B, p.Hkv, p.groups, p.L, p.E)
    shape = (p.B, p.Hkv, p.groups, p.L)
    mask_caps, seed = dropout.split(p, mask_caps)

    def step(carry, xs):
        m, l, acc = carry
        j, k_block, v_block, partial_j, full_j = xs
        _, s, keep = _scores(p, p.xla, score_caps, mask_caps, qg, k_block, partial_j,
                             full_j, j)
        s = jnp.where(keep, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        e = jnp.where(keep, jnp.exp(s - m_new[..., None]), 0.0)
        l = alpha * l + e.sum(axis=-1)  # (dropout leaves the softmax's denominator)
        kept = _kept(p, seed, j)
        weights = e if kept is None else jnp.where(kept, e, 0.0)
        acc = alpha[..., None] * acc + _weighted_rows(
            weights.astype(v.dtype), v_block, "bhglk,bhke->bhgle",
            preferred_element_type=p.compute_dtype)
        return (m_new, l, acc), None

    inputs = (q, k, v, lists, score_caps, mask_caps, seed)
    acc = p.compute_dtype
    init = (_zeros(shape, acc, *inputs) + MASK_VALUE, _zeros(shape, acc, *inputs),
            _zeros((*shape, p.Ev), acc, *inputs))
    n_kv = cdiv(p.S, p.mask_block[1])
    xs = (jnp.arange(n_kv, dtype=jnp.int32), _blocked_kv(p, k), _blocked_kv(p, v),
          *_block_columns(lists))
    (m, l, acc), _ = lax.scan(step, init, xs)
    l_safe = jnp.where(l == 0, 1.0, l)
    # Kept weights are scaled by 1 / (1 - rate); the LSE stays the softmax's.
    norm = l_safe if seed is None else l_safe * (1.0 - p.dropout)
    out = (acc / norm[..., None]).astype(q.dtype).reshape(p.B, p.Hq, p.L, p.Ev)
    lse = jnp.where(l == 0, -jnp.inf, m + jnp.log(l_safe)).reshape(p.B, p.Hq, p.L)
    if p.max_scores:
        return out, lse, jnp.where(l == 0, -jnp.inf, m).reshape(p.B, p.Hq, p.L)
    return out, lse


def backward(p: Problem, res, d_out, d_lse):
    """(dq, dk, dv, d_score_captures) of the residuals `res` (attention.api)."""
    return gradients(p, res.q, res.k, res.v, res.lists, res.score_captures,
                     res.mask_captures, res.out, res.lse, d_out, d_lse, res.differentiated)


def gradients(p: Problem, q, k, v, lists: MaskLists, score_captures, mask_captures, out, lse,
              d_out, d_lse, differentiated: Sequence[bool], *, operand_grads: bool = True):
    """(dq, dk, dv, d_score_captures); dq/dk/dv are None when operand_grads is False.

    d_lse is the cotangent of the natural-log LSE (None: zero): it enters as delta - d_lse.
    Captured arrays get a gradient where `differentiated` says so (float ones only), None
    elsewhere.
    """
    group = lambda x: x.reshape(p.B, p.Hkv, p.groups, *x.shape[2:])  # noqa: E731
    qg, dog = group(q), group(d_out)
    mask_captures, seed = dropout.split(p, mask_captures)
    acc = p.compute_dtype
    delta = jnp.sum(out.astype(acc) * d_out.astype(acc), -1)
    delta = group(delta if d_lse is None else delta - d_lse)
    lse = group(lse)
    lse_safe = jnp.where(jnp.isneginf(lse), 0.0, lse)[..., None]
    score_captures = list(score_captures)
    learnable = [i for i, (c, wanted) in enumerate(zip(score_captures, differentiated))
                 if wanted and jnp.issubdtype(jnp.result_type(c), jnp.floating)]

    def with_learnable(values):
        captures = list(score_captures)
        for i, value in zip(learnable, values):
            captures[i] = value
        return captures

    def step(carry, xs):
        dq, d_caps = carry
        j, k_block, v_block, partial_j, full_j = xs
        raw, s, keep = _scores(p, p.xla, score_captures, mask_captures, qg, k_block, partial_j,
                               full_j, j)
        prob = jnp.where(keep, jnp.exp(s - lse_safe), 0.0)
        read = prob > 0  # where a key has no weight its gradients are 0, whatever K and V hold
        dp = jnp.einsum("bhgle,bhke->bhglk", dog, v_block, preferred_element_type=acc)
        kept = _kept(p, seed, j)
        # dP' = dO·Vᵀ reaches P through keep / (1 - rate)
        weights, dp = dropout.dropped(p, kept, prob), dropout.dropped(p, kept, dp)
        ds = jnp.where(read, prob * (dp - delta[..., None]), 0.0)
        if p.xla.score is not None:
            b, h, q_idx, kv = _indices(p, j)

            def mod(r, values):
                return p.xla.score(with_learnable(values), r, b, h, q_idx, kv)[0]

            # Unread scores (maybe NaN from a NaN key) enter the mod's derivative as 0.
            _, mod_vjp = capture_vjp(mod, jnp.where(read, raw, 0.0),
                                     [score_captures[i] for i in learnable])
            ds, d_caps_j = mod_vjp(ds)
            d_caps = jax.tree.map(jnp.add, d_caps, d_caps_j)
        ds = jnp.where(read, ds, 0.0)
        if not operand_grads:
            return (dq, d_caps), None
        dq = dq + _weighted_rows(ds, k_block.astype(acc), "bhglk,bhke->bhgle") * p.scale
        dk = jnp.einsum("bhglk,bhgle->bhke", ds, qg.astype(acc)) * p.scale
        dv = jnp.einsum("bhglk,bhgle->bhke", weights.astype(v.dtype), dog,
                        preferred_element_type=acc)
        return (dq, d_caps), (dk, dv)

    inputs = (q, k, v, lists, score_captures, mask_captures, seed, out, lse, d_out, d_lse)
    # A capture's gradient per block has the capture's own type (under shard_map, the pullback
    # of a replicated array sums the devices' parts), and so does their sum.
    zeros_caps = [_zeros(jnp.shape(score_captures[i]), jnp.result_type(score_captures[i]),
                         score_captures[i]) for i in learnable]
    dq0 = _zeros((p.B, p.Hkv, p.groups, p.L, p.E), acc, *inputs)
    n_kv = cdiv(p.S, p.mask_block[1])
    xs = (jnp.arange(n_kv, dtype=jnp.int32), _blocked_kv(p, k), _blocked_kv(p, v),
          *_block_columns(lists))
    (dq, d_caps), per_block = lax.scan(step, (dq0, zeros_caps), xs)
    d_caps = dict(zip(learnable, d_caps))
    d_caps = [d_caps.get(i) for i in range(len(score_captures))]
    if not operand_grads:
        return None, None, None, d_caps

    def unblock(x, like):  # [nKV, B, Hkv, block, D] -> [Bk, Hkv, S, D]
        x = jnp.moveaxis(x, 0, 2).reshape(p.B, p.Hkv, -1, x.shape[-1])[:, :, :p.S]
        if p.kv_batch == 1:
            x = x.sum(axis=0, keepdims=True)
        return x.astype(like.dtype)

    dk, dv = per_block
    dq = dq.reshape(p.B, p.Hq, p.L, p.E).astype(q.dtype)
    return dq, unblock(dk, k), unblock(dv, v), d_caps


def tangents(p: Problem, residuals, linear):
    """The outputs' tangents (out, LSE, and zeros for the rows' largest scores) from the
    inputs' (`linear`: q, k, v and the score_mod's captured arrays, None where not
    differentiated): the JVP of this forward (a scan over key blocks)."""
    q, k, v, lists, score_caps, mask_caps, *_ = residuals
    d_caps = linear[3]
    moving = [i for i, t in enumerate(linear[:3]) if t is not None]
    learnable = [i for i, t in enumerate(d_caps) if t is not None]

    def run(operands, captures):
        qkv, caps = [q, k, v], list(score_caps)
        for i, x in zip(moving, operands):
            qkv[i] = x
        for i, x in zip(learnable, captures):
            caps[i] = x
        return forward(p, *qkv, lists, caps, mask_caps)

    primals = ([(q, k, v)[i] for i in moving], [score_caps[i] for i in learnable])
    _, tangents_out = jax.jvp(run, primals,
                              ([linear[i] for i in moving], [d_caps[i] for i in learnable]))
    return (*tangents_out[:2], *(jnp.zeros_like(t) for t in tangents_out[2:]))
