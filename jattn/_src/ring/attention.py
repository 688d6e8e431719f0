"""Context-parallel FlexAttention: a ring of devices under shard_map.

Each device holds a shard of q, k and v along the sequence. At ring step s every device attends
its queries to the K/V of the device s places before it, sent from there (`lax.ppermute`)
while the previous step computes; the partial results merge through their log-sum-exps. The
mods see global positions.
A (query shard, key shard) pair whose BlockMask is empty launches no kernel: under a causal
mask with the contiguous layout that is almost half of them. (Of a step that attends a few
query blocks, an empty pair runs its small kernels instead: skipping them costs a host
round trip.)

The backward is a ring too (a custom_vjp): K/V go round again, each device computing its
pair's part (flex_attention's backward from the merged output and LSE, which is exact for a
slice of the keys) and sending the dK/dV part straight back to the shard's device. Only this
device's shards and the pairs' block lists are kept for it.

Steps whose pairs are empty on every device (`schedule`) are left out, forward and backward,
and of a step that runs only the key blocks its pairs visit are sent and only the query blocks
its pairs visit are attended.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jattn._src.attention.api import flex_attention, flex_attention_backward
from jattn._src.attention.sinks import checked_sinks, with_sinks
from jattn._src.masks.block_mask import BlockMask
from jattn._src.mesh_axes import aligned, summed_to_vary_like
from jattn._src.ring import gathered
from jattn._src.ring import strategy as strategies
from jattn._src.ring.arguments import check_whole_mask, checked_token_arrays, mask_mod_of
from jattn._src.ring.layout import check_layout
from jattn._src.ring.pair import Pair, RingMods, visited_blocks
from jattn._src.ring.schedule import RingSchedule, ring_schedule, runs

_FN = "ring_flex_attention"


@dataclasses.dataclass(frozen=True, eq=False)
class _Ring:
    """Static description of one ring call (the custom_vjp's nondifferentiable argument)."""

    mods: RingMods
    axis_name: str
    layout: str
    scale: float | None
    enable_gqa: bool
    implementation: str | None
    block_size: int
    cut_block: tuple[int, int] | None  # the given whole-sequence BlockMask's block size
    schedule: RingSchedule  # the steps some device has work at, and every device

    def pair(self, i: int, score_caps, mask_caps, tokens, tokens_in_hand, shard: int):
        """The Pair of the i-th scheduled step: this device's queries, the keys in hand."""
        return Pair.make(self.mods, **self._devices(self.schedule.steps[i]), shard=shard,
                         layout=self.layout, score_caps=score_caps, mask_caps=mask_caps,
                         tokens=tokens, tokens_in_hand=tokens_in_hand,
                         kv_local=self.schedule.kept_positions(i),
                         q_local=self.schedule.row_positions(i))

    def _devices(self, step: int) -> dict:
        n = lax.axis_size(self.axis_name)
        if n == 1:  # a constant index: the pair's mods then read no device index, so the
            return dict(me=0, origin=0, num_devices=1)  # call runs where flex_attention's does
        me = lax.axis_index(self.axis_name)
        return dict(me=me, origin=lax.rem(me - step + n, np.int32(n)), num_devices=n)

    def pair_block_mask(self, i: int, pair: Pair, whole_mask, tables, B: int, Hq: int,
                        shard: int):
        """The pair's BlockMask: cut from the whole sequence's block tables where the call
        gave a BlockMask (on one device, the pair is the whole sequence), else built from the
        mask_mod (None: every key attends)."""
        if whole_mask is None:
            return pair.block_mask(self.mods, B, Hq, shard, self.block_size)
        if tables is None:
            return dataclasses.replace(whole_mask, mask_mod=pair.mask)
        return pair.cut_block_mask(tables, **self._devices(self.schedule.steps[i]),
                                   shard=shard, layout=self.layout, block_size=self.cut_block,
                                   kv_local=self.schedule.kept_positions(i),
                                   q_local=self.schedule.row_positions(i))

    def fetch(self, i: int, k, v, tokens) -> list:
        """[k, v, *tokens] of the i-th scheduled step: of the shard `step` devices before, the
        key positions its pairs visit (`RingSchedule.kept`), sent from there."""
        positions = self.schedule.kept_positions(i)
        if positions is not None:
            k, v = (_taken(x, positions, 2) for x in (k, v))
            tokens = [_taken(t, positions, t.ndim - 1) for t in tokens]
        return self.pass_on(self.schedule.steps[i], k, v, *tokens)

    def rows(self, i: int, *xs) -> list:
        """xs (sequence on axis 2) at the query positions the i-th step attends."""
        positions = self.schedule.row_positions(i)
        return list(xs) if positions is None else [_taken(x, positions, 2) for x in xs]

    def returned(self, i: int, parts) -> list:
        """The i-th step's dK/dV parts sent back to the device of their shard (at their
        positions there: `kept_positions`)."""
        return self.pass_on(-self.schedule.steps[i], *parts)

    def attended(self, i: int, has_blocks, attend: Callable, skip: Callable, *args):
        """attend(*args) for the i-th scheduled step, or skip(*args) on a device whose pair
        visits no block (`has_blocks`, traced): tested only at steps that attend whole
        shards where some device's pair may be empty. The test is a conditional whose
        predicate a GPU's host reads, stalling the launches behind it: it pays where it
        spares kernels writing whole shards of zeros, not a few query blocks'."""
        if (self.schedule.steps[i] in self.schedule.everywhere
                or self.schedule.row_positions(i) is not None):
            return attend(*args)
        return lax.cond(has_blocks, attend, skip, *args)

    def pair_typed(self, xs, *operands) -> list:
        """xs cast to vary over every mesh axis a pair's result may: the operands' and the
        ring's own (the pairs' mods read the device index), so both branches of a skip agree."""
        return list(aligned(*xs, *operands, lax.axis_index(self.axis_name))[:len(xs)])

    def pass_on(self, places: int, *xs):
        """xs sent `places` devices on along the ring (received from as many before); as
        they are for 0 places."""
        n = lax.axis_size(self.axis_name)
        if places % n == 0:
            return list(xs)
        return [lax.ppermute(x, self.axis_name, [(i, (i + places) % n) for i in range(n)])
                for x in xs]


def _taken(x, positions: np.ndarray, axis: int):
    """x at the sorted static `positions` along `axis` (slices of its runs)."""
    return jnp.concatenate([lax.slice_in_dim(x, int(run[0]), int(run[-1]) + 1, axis=axis)
                            for run in runs(positions)], axis=axis)


def _put(into, x, positions: np.ndarray, axis: int):
    """`into` holding x at the sorted static `positions` along `axis`."""
    out, x = aligned(into, x)
    start = 0
    for run in runs(positions):
        piece = lax.slice_in_dim(x, start, start + run.size, axis=axis)
        out = lax.dynamic_update_slice_in_dim(out, piece, int(run[0]), axis=axis)
        start += run.size
    return out


def _updated(totals, parts, positions: np.ndarray | None, combine: Callable) -> list:
    """totals with combine(totals there, parts) at the sorted static `positions` along axis 2
    (None: everywhere), each in its combined result's dtype."""
    if positions is None:
        return list(combine(totals, parts))
    combined = combine([_taken(total, positions, 2) for total in totals], parts)
    # materialised before the totals are written: fused into the writes, the reads of the
    # totals' rows would make XLA copy each whole total to update it
    combined = lax.optimization_barrier(combined)
    return [_put(total.astype(x.dtype), x, positions, 2) for total, x in zip(totals, combined)]


def _accumulated(totals, parts, positions: np.ndarray | None, dtype, *, empty: Callable,
                 combine: Callable) -> list:
    """The ring's running totals (output and LSE; dQ; dK/dV) after a step's parts at
    `positions` of the shard (axis 2; None: all of it). Before the first part they are None:
    a first part over the whole shard becomes them as it is (in the inputs' dtype, as the
    kernels write it), else they start as empty(dtype). combine(dtype) merges the totals there
    with the parts in `_accumulating`'s dtype and returns them in dtype: that one while steps
    remain, the inputs' dtype after the last (rounded once; a whole-shard total is converted
    only where an earlier step merges some rows into it)."""
    if totals is None:
        if positions is None:
            return list(parts)
        totals = empty(dtype)
    return _updated(totals, parts, positions, combine(dtype))


def _accumulating(dtype):
    """The dtype partial results of `dtype` are merged and summed in: float32, or float64."""
    return jnp.promote_types(dtype, jnp.float32)


def _summed(dtype):
    """combine for _updated: the sums of totals and parts (in `_accumulating(dtype)`), in
    dtype."""
    acc = _accumulating(dtype)
    return lambda totals, parts: [(total.astype(acc) + part.astype(acc)).astype(dtype)
                                  for total, part in zip(totals, parts)]


def _merge(out, lse, step_out, step_lse, dtype):
    """Two partial attentions over disjoint keys, merged through their LSEs (out in dtype)."""
    new = jnp.logaddexp(lse, step_lse)
    finite = jnp.isfinite(new)
    old_weight = jnp.where(finite, jnp.exp(lse - jnp.where(finite, new, 0.0)), 0.0)
    step_weight = jnp.where(finite, jnp.exp(step_lse - jnp.where(finite, new, 0.0)), 0.0)
    acc = _accumulating(dtype)
    out = (out.astype(acc) * old_weight[..., None].astype(acc)
           + step_out.astype(acc) * step_weight[..., None].astype(acc))
    return out.astype(dtype), new


def _nothing_attended(B: int, Hq: int, Lc: int, Ev: int, dtype):
    """(out in dtype, lse) of queries that attend no key: zeros and -inf."""
    return (jnp.zeros((B, Hq, Lc, Ev), dtype),
            jnp.full((B, Hq, Lc), -jnp.inf, _accumulating(dtype)))


def _dense_tables(whole_mask, num_devices: int):
    """(partial, full or None) [Bm, Hm, nQ, nKV] bool tables of the whole sequence's
    BlockMask to cut the pairs' from; None without one, or on one device (nothing to cut)."""
    if whole_mask is None or num_devices == 1:
        return None
    full = whole_mask.full_blocks() if whole_mask.full_kv_num_blocks is not None else None
    return whole_mask.partial_blocks(), full


def _forward(ring: _Ring, q, k, v, score_caps, mask_caps, tokens, whole_mask):
    """(out [B, Hq, Lc, Ev] of q's dtype, lse [B, Hq, Lc] float32, pairs launched on this
    device: int32, each scheduled step's BlockMask without its mask_mod, or None)."""
    n = lax.axis_size(ring.axis_name)
    (B, Hq, Lc, _), Ev = q.shape, v.shape[-1]
    out = lse = None  # (the first step's whole-shard result, where it is one)
    launched, block_masks = jnp.int32(0), []
    tables = _dense_tables(whole_mask, n)
    steps = ring.schedule.steps
    in_hand = ring.fetch(0, k, v, tokens) if steps else None
    for i in range(len(steps)):
        k_in, v_in, *tokens_in = in_hand
        pair = ring.pair(i, score_caps, mask_caps, tokens, tokens_in, Lc)
        block_mask = ring.pair_block_mask(i, pair, whole_mask, tables, B, Hq, Lc)
        blocks = visited_blocks(block_mask)
        q_rows, = ring.rows(i, q)

        def attend(k, v, q=q_rows, pair=pair, block_mask=block_mask):
            step_out, step_lse = flex_attention(q, k, v, pair.score, block_mask,
                                                scale=ring.scale, enable_gqa=ring.enable_gqa,
                                                return_lse=True,
                                                implementation=ring.implementation)
            return tuple(ring.pair_typed([step_out, step_lse], q, k, v))

        def skip(k, v, q=q_rows):  # what attend gives for no keys
            zero, = ring.pair_typed([jnp.zeros(q.shape[:3] + (Ev,), q.dtype)], q, k, v)
            return zero, zero[..., 0].astype(_accumulating(q.dtype)) - jnp.inf

        # The next step's keys are sent while this one's are attended to.
        if i + 1 < len(steps):
            in_hand = ring.fetch(i + 1, k, v, tokens)
        step = ring.attended(i, blocks > 0, attend, skip, k_in, v_in)
        out, lse = _accumulated(
            None if out is None else (out, lse), step, ring.schedule.row_positions(i),
            q.dtype if i + 1 == len(steps) else _accumulating(q.dtype),
            empty=lambda dtype: _nothing_attended(B, Hq, Lc, Ev, dtype),
            combine=lambda dtype: lambda old, new: _merge(*old, *new, dtype))
        launched = launched + (blocks > 0).astype(jnp.int32)
        block_masks.append(None if block_mask is None else
                           dataclasses.replace(block_mask, mask_mod=None))
    if out is None:  # no step has work anywhere
        out, lse = _nothing_attended(B, Hq, Lc, Ev, q.dtype)
    return out.astype(q.dtype), lse, launched, block_masks


def _backward(ring: _Ring, residuals, d_out, d_lse):
    """(dq, dk, dv, d_score_caps) of the ring from its saved shards, output and LSE."""
    q, k, v, score_caps, mask_caps, tokens, out, lse, block_masks = residuals
    Lc = q.shape[2]
    # The captures' gradients are summed over the devices after the last pair: inside a
    # pair's backward (a lax.cond branch some devices skip) that sum would deadlock, so the
    # pairs see the captures as varying over q's axes and sum nothing.
    varying_caps = aligned(q, *score_caps)[1:]
    floats = [jnp.issubdtype(jnp.result_type(c), jnp.floating) for c in score_caps]
    # [dQ] and [dK, dV]: None before the first part (`_accumulated`)
    dq = dkv = None
    d_caps = ring.pair_typed([jnp.zeros(jnp.shape(c), _accumulating(jnp.result_type(c)))
                              for c, f in zip(score_caps, floats) if f], q, k, v)
    steps = ring.schedule.steps
    in_hand = ring.fetch(0, k, v, tokens) if steps else None
    for i in range(len(steps)):
        k_in, v_in, *tokens_in = in_hand
        pair = ring.pair(i, varying_caps, mask_caps, tokens, tokens_in, Lc)
        saved = block_masks[i]
        block_mask = None if saved is None else dataclasses.replace(saved, mask_mod=pair.mask)
        if i + 1 < len(steps):
            in_hand = ring.fetch(i + 1, k, v, tokens)

        rows = ring.rows(i, q, out, lse, d_out, d_lse)

        def attend(k, v, pair=pair, block_mask=block_mask, rows=rows):
            q, out, lse, d_out, d_lse = rows
            dq_p, dk_p, dv_p, d_caps_p = flex_attention_backward(
                q, k, v, out, lse, d_out, d_lse, pair.score, block_mask,
                score_captures=varying_caps, scale=ring.scale, enable_gqa=ring.enable_gqa,
                implementation=ring.implementation)
            parts = [dq_p, dk_p, dv_p,
                     *(d.astype(_accumulating(d.dtype)) for d, f in zip(d_caps_p, floats)
                       if f)]
            return ring.pair_typed(parts, q, k, v)

        def skip(k, v, q=rows[0]):
            return ring.pair_typed([jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v),
                                    *(jnp.zeros_like(x) for x in d_caps)],
                                   q, k, v)

        parts = ring.attended(i, visited_blocks(block_mask) > 0, attend, skip, k_in, v_in)
        dtype = q.dtype if i + 1 == len(steps) else _accumulating(q.dtype)
        dq = _accumulated(dq, parts[:1], ring.schedule.row_positions(i), dtype,
                          empty=lambda dtype: [jnp.zeros(q.shape, dtype)], combine=_summed)
        # the dK/dV part goes straight back to the keys' device (sent while the next step
        # computes)
        dkv = _accumulated(dkv, ring.returned(i, parts[1:3]), ring.schedule.kept_positions(i),
                           dtype, empty=lambda dtype: [jnp.zeros(k.shape, dtype),
                                                       jnp.zeros(v.shape, dtype)],
                           combine=_summed)
        d_caps = [total + part for total, part in zip(d_caps, parts[3:])]
    dq, dk, dv = (ring.pair_typed([jnp.zeros_like(x)], x)[0] if d is None else d
                  for d, x in zip((*(dq or [None]), *(dkv or [None, None])), (q, k, v)))
    grads = [summed_to_vary_like(d.astype(x.dtype), x) for d, x in ((dq, q), (dk, k), (dv, v))]
    float_grads = iter(d_caps)
    cap_grads = tuple(summed_to_vary_like(next(float_grads).astype(jnp.result_type(c)), c)
                      if f else None for c, f in zip(score_caps, floats))
    return (*grads, cap_grads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring: _Ring, q, k, v, score_caps, mask_caps, tokens, whole_mask):
    return _forward(ring, q, k, v, score_caps, mask_caps, tokens, whole_mask)[:2]


def _ring_attention_fwd(ring: _Ring, q, k, v, score_caps, mask_caps, tokens, whole_mask):
    out, lse, _, block_masks = _forward(ring, q, k, v, score_caps, mask_caps, tokens,
                                        whole_mask)
    return (out, lse), (q, k, v, score_caps, mask_caps, tokens, out, lse, block_masks)


def _ring_attention_bwd(ring: _Ring, residuals, cotangents):
    dq, dk, dv, d_score_caps = _backward(ring, residuals, *cotangents)
    return dq, dk, dv, d_score_caps, None, None, None


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


def _checked(q, k, mask_mod, *, axis_name, layout, token_arrays, block_mask):
    """The call's mask_mod (the BlockMask's, if given) and token arrays, checked."""
    try:
        lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"{_FN}: `axis_name` {axis_name!r} is not an axis of the mesh it runs over: call "
            "it inside jax.shard_map over a mesh with that axis (the one q, k and v are "
            "sharded along), or call jattn.sharded_flex_attention on global arrays.") from None
    Lc, Sc = q.shape[2], k.shape[2]
    check_layout(layout, Lc, _FN)
    if Lc != Sc:
        raise ValueError(f"{_FN}: q's shard has {Lc} positions and k/v's {Sc}; the ring needs "
                         f"equal shards of one sequence (q {q.shape}, k {k.shape}).")
    mask_mod = mask_mod_of(_FN, mask_mod, block_mask, "sequence")
    check_whole_mask(_FN, block_mask, q, lax.axis_size(axis_name), layout)
    tokens = checked_token_arrays(_FN, token_arrays, Lc, "is sharded like q along its last "
                                  f"axis, which must be this device's {Lc} positions")
    return mask_mod, tokens


def _setup(q, score_mod, mask_mod, tokens, *, axis_name, layout, scale, enable_gqa,
           implementation, block_size, block_mask, schedule=None):
    """(_Ring, score_mod's captures, mask_mod's captures) of the call whose mask_mod and
    token arrays `_checked` gave; the ring's steps `schedule`, or (None) those
    `ring_schedule` finds in block_mask."""
    n, Lc = lax.axis_size(axis_name), q.shape[2]
    views = [jax.ShapeDtypeStruct(x.shape[:-1] + (n * Lc,), x.dtype) for x in tokens]
    mods, score_caps, mask_caps = RingMods.of(score_mod, mask_mod, views)
    if schedule is None:
        schedule = ring_schedule(block_mask, n, layout)
    ring = _Ring(mods, axis_name, layout, scale, enable_gqa, implementation, block_size,
                 None if block_mask is None else block_mask.block_size, schedule)
    return ring, tuple(score_caps), tuple(mask_caps)


def ring_steps(q, k, v, score_mod=None, mask_mod=None, *, axis_name: str, layout: str, scale,
               enable_gqa: bool, implementation, block_size: int, token_arrays=(),
               block_mask=None):
    """(out [B, Hq, Lc, Ev] of q's dtype, lse [B, Hq, Lc] float32, pairs launched on this
    device: int32) of ring_flex_attention inside shard_map, not differentiable."""
    mask_mod, tokens = _checked(q, k, mask_mod, axis_name=axis_name, layout=layout,
                                token_arrays=token_arrays, block_mask=block_mask)
    ring, score_caps, mask_caps = _setup(
        q, score_mod, mask_mod, tokens, axis_name=axis_name, layout=layout, scale=scale,
        enable_gqa=enable_gqa, implementation=implementation, block_size=block_size,
        block_mask=block_mask)
    return _forward(ring, q, k, v, score_caps, mask_caps, tuple(tokens), block_mask)[:3]


def ring_flex_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                        score_mod: Callable[..., jax.Array] | None = None,
                        mask_mod: Callable[..., jax.Array] | None = None, *, axis_name: str,
                        layout: str = "contiguous", scale: float | None = None,
                        enable_gqa: bool = False, return_lse: bool = False,
                        implementation: str | None = None, block_size: int = 128,
                        token_arrays: Sequence[jax.Array] = (),
                        block_mask: BlockMask | None = None, sinks: jax.Array | None = None,
                        strategy: str = "auto"):
    """flex_attention over a sequence sharded across the devices of a mesh axis (a ring, or
    another `strategy`).

    Call it inside `jax.shard_map` with q, k and v sharded along the sequence (axis 2) over
    mesh axis `axis_name`. The result is exactly `flex_attention` on the whole sequence, with
    global positions as `q_idx` / `kv_idx` in the mods, and this device's shard of it.

    Args:
      q: [B, Hq, Lc, E], this device's shard of the queries (Lc = L / devices).
      k, v: [B, Hkv, Lc, E] and [B, Hkv, Lc, Ev], its shards of the keys and values; q, k, v
        bfloat16, float16 or float32 (float64 with jax_enable_x64, on the xla
        implementation), one dtype.
      score_mod: `f(score, b, h, q_idx, kv_idx)` as in flex_attention, on global positions.
      mask_mod: `f(b, h, q_idx, kv_idx) -> bool` on global positions; None attends to every
        key. A BlockMask is built from it for every pair of shards, so a pair with nothing to
        attend to is skipped.
      axis_name: the mesh axis the sequence is sharded over.
      layout: "contiguous" (device i holds the i-th shard) or "zigzag" (device i holds chunks
        i and 2n−1−i of 2n: equal work per device under a causal mask; see `jattn.to_zigzag`).
      scale, enable_gqa, return_lse, implementation: as in flex_attention.
      block_size: the BlockMask block of each pair of shards (it must divide Lc).
      token_arrays: per-token integer or bool arrays (document ids, ...) sharded like q, each
        [..., Lc] with this device's positions on its last axis. Given, the mods take one
        more argument per array, `score_mod(score, b, h, q_idx, kv_idx, *tokens)` and
        `mask_mod(b, h, q_idx, kv_idx, *tokens)`, each the array over the whole sequence
        [..., L], to index with the global positions (`doc[q_idx] == doc[kv_idx]`). The key
        side's shard travels around the ring with k.
      block_mask: instead of mask_mod, a BlockMask of the whole sequence (built once for
        [B|1, Hq|1, L, L], e.g. by `jattn.create_block_mask` outside shard_map; its mask_mod
        on global positions, the sequence in its original order): each pair's blocks are cut
        from it, so no mask is evaluated to find them. Its blocks must tile each shard (each
        half shard for zigzag). Where its values are known while the ring is traced (built
        outside the jitted function and closed over), a ring step whose pairs it leaves
        empty on every device is skipped: no kernel and no transfer (packed documents
        within shards send nothing around the ring).
      sinks: attention sinks [Hq], one logit per query head, as in flex_attention, the same
        on every device of the ring (replicated): each device's rows count them once, and
        their gradient is the sum over the devices.
      strategy: how the devices share the keys. "ring": K/V go round the devices, a step at
        a time (above). "all_gather": each device gathers the whole sequence's K/V at once
        and attends its queries to them (the backward reduce-scatters dK/dV); cheap with
        few kv heads. "heads": an all-to-all trades the sequence shards for whole sequences
        of 1/n of the heads (Hq and Hkv must divide by the devices), flex_attention runs
        there, and the output returns to sequence shards (Ulysses). "auto" (the default):
        the ring where a whole-sequence `block_mask` with known values gives every device's
        queries about equal work (or no mask; or the heads do not divide), "heads"
        elsewhere, as measured on GPUs. The result and its gradients are the same for each
        (docs/context_parallel.md).

    Returns:
      [B, Hq, Lc, Ev] of q's dtype, this device's shard of the output; with return_lse also
      its [B, Hq, Lc] float32 shard of the natural-log LSE. Differentiable in q, k, v and
      float arrays the mods close over (replicate globally indexed tables: their gradient is
      the sum of every device's part). The backward is a ring as well.

    Example::

        from jax.sharding import Mesh, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
        q = k = v = jnp.ones((1, 2, 256, 32))                       # [B, H, L, E]
        attention = jax.shard_map(
            lambda q, k, v: jattn.ring_flex_attention(q, k, v, mask_mod=jattn.masks.causal_mask,
                                                      axis_name="seq"),
            mesh=mesh, in_specs=(P(None, None, "seq"),) * 3, out_specs=P(None, None, "seq"))
        print(jax.jit(attention)(q, k, v).shape)                    # (1, 2, 256, 32)
    """
    return scheduled_ring_attention(
        q, k, v, score_mod, mask_mod, None, axis_name=axis_name, layout=layout, scale=scale,
        enable_gqa=enable_gqa, return_lse=return_lse, implementation=implementation,
        block_size=block_size, token_arrays=token_arrays, block_mask=block_mask, sinks=sinks,
        strategy=strategy)


def scheduled_ring_attention(q, k, v, score_mod, mask_mod, schedule: RingSchedule | None, *,
                             return_lse: bool, sinks, strategy: str = "auto", **options):
    """ring_flex_attention running the ring steps `schedule` (`ring_schedule` of the whole
    sequence's BlockMask where its values are known: sharded_flex_attention works it out
    before the mask enters shard_map as an argument), or (None) those it finds itself; or
    another `strategy` (`gathered`; "auto": `strategy.resolved`)."""
    strategies.check(_FN, strategy)
    checked_mask_mod, tokens = _checked(
        q, k, mask_mod, axis_name=options["axis_name"], layout=options["layout"],
        token_arrays=options["token_arrays"], block_mask=options["block_mask"])
    strategy = strategies.resolved(
        strategy, block_mask=options["block_mask"], has_mask_mod=mask_mod is not None,
        num_devices=lax.axis_size(options["axis_name"]), layout=options["layout"],
        heads=q.shape[1], kv_heads=k.shape[1])
    sinks = checked_sinks(_FN, sinks, q.shape[1])
    if strategy == "ring":
        ring, score_caps, mask_caps = _setup(
            q, score_mod, checked_mask_mod, tokens, schedule=schedule,
            **{key: value for key, value in options.items() if key != "token_arrays"})
        # (the pairs read the ring's own mods: the BlockMask enters the custom_vjp as its
        # lists alone, not with its mask_mod's leaves, which may be functions)
        whole = options["block_mask"]
        whole = None if whole is None else dataclasses.replace(whole, mask_mod=None)
        out, lse = _ring_attention(ring, q, k, v, score_caps, mask_caps, tuple(tokens), whole)
    else:
        out, lse = gathered.attention(strategy, q, k, v, score_mod, checked_mask_mod,
                                      **{**options, "token_arrays": tokens})
    if sinks is not None:
        out, lse = with_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out
