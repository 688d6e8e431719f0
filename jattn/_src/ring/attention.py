"""Context-parallel FlexAttention: a ring of devices under shard_map.

Each device holds a shard of q, k and v along the sequence. The K/V shards travel around the
ring (`lax.ppermute` to the next device) while each device attends its queries to the shard in
hand; the partial results merge through their log-sum-exps. The mods see global positions.
A (query shard, key shard) pair whose BlockMask is empty launches no kernel: under a causal
mask with the contiguous layout that is almost half of them. The backward is the ring's
autodiff: the per-pair flex_attention backwards, with dK/dV travelling back around the ring by
the transposed ppermutes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jattn._src.attention.api import flex_attention
from jattn._src.masks.create import create_block_mask
from jattn._src.mesh_axes import aligned
from jattn._src.ring.layout import check_layout, global_positions

_FN = "ring_flex_attention"


def uses_batch_or_head(mask_mod: Callable[..., Any]) -> tuple[bool, bool]:
    """Whether mask_mod's result depends on its b and h arguments (the BlockMask then needs
    those axes; otherwise one row of blocks serves every batch and head): called on indices
    of distinct broadcast shapes, its result has an axis of each argument it uses."""
    def index(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    shape = jax.eval_shape(mask_mod, index(2, 1, 1, 1), index(1, 3, 1, 1), index(1, 1, 5, 1),
                           index(1, 1, 1, 7)).shape
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    return padded[0] == 2, padded[1] == 3


def _reads_float_arrays(score_mod: Callable[..., Any] | None) -> bool:
    """Whether score_mod closes over floating-point arrays (learnable tables, slopes)."""
    if score_mod is None:
        return False
    index = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    closed = jax.make_jaxpr(score_mod)(jax.ShapeDtypeStruct((1, 1), jnp.float32), scalar,
                                       scalar, index, index)
    return any(jnp.issubdtype(jnp.result_type(c), jnp.floating)
               for c in getattr(closed, "consts", ()))


def _merge(out, lse, step_out, step_lse):
    """Two partial attentions over disjoint keys, merged through their LSEs (float32 out)."""
    new = jnp.logaddexp(lse, step_lse)
    finite = jnp.isfinite(new)
    old_weight = jnp.where(finite, jnp.exp(lse - jnp.where(finite, new, 0.0)), 0.0)
    step_weight = jnp.where(finite, jnp.exp(step_lse - jnp.where(finite, new, 0.0)), 0.0)
    out = out * old_weight[..., None] + step_out.astype(jnp.float32) * step_weight[..., None]
    return out, new


def ring_steps(q, k, v, score_mod, mask_mod, *, axis_name: str, layout: str, scale,
               enable_gqa: bool, implementation, block_size: int):
    """(out [B, Hq, Lc, Ev] of q's dtype, lse [B, Hq, Lc] float32, pairs launched on this
    device: int32) of ring_flex_attention inside shard_map."""
    n = lax.axis_size(axis_name)
    (B, Hq, Lc, _), (Sc, Ev) = q.shape, v.shape[2:]
    check_layout(layout, Lc, _FN)
    if Lc != Sc:
        raise ValueError(f"{_FN}: q's shard has {Lc} positions and k/v's {Sc}; the ring needs "
                         f"equal shards of one sequence (q {q.shape}, k {k.shape}).")
    me = lax.axis_index(axis_name)
    uses_b, uses_h = (False, False) if mask_mod is None else uses_batch_or_head(mask_mod)
    next_device = [(i, (i + 1) % n) for i in range(n)]
    # An empty pair is skipped by a lax.cond, whose branch only some devices take. The
    # gradient of a replicated float array the score_mod reads is summed over the devices
    # (a psum) inside flex_attention's backward, in that branch: devices skipping it would
    # leave the others waiting. Such mods attend every pair (an empty one costs a kernel
    # launch that finds no blocks).
    always_attend = _reads_float_arrays(score_mod)

    out = jnp.zeros((B, Hq, Lc, Ev), jnp.float32)
    lse = jnp.full((B, Hq, Lc), -jnp.inf, jnp.float32)
    launched = jnp.int32(0)
    for step in range(n):
        origin = lax.rem(me - step + n, n)  # the device whose K/V shard is in hand
        q_pos = functools.partial(global_positions, device=me, num_devices=n, shard_length=Lc,
                                  layout=layout)
        kv_pos = functools.partial(global_positions, device=origin, num_devices=n,
                                   shard_length=Sc, layout=layout)
        step_score = None if score_mod is None else (
            lambda s, b, h, qi, ki, q_pos=q_pos, kv_pos=kv_pos:
            score_mod(s, b, h, q_pos(qi), kv_pos(ki)))
        block_mask, blocks = None, jnp.int32(1)  # without a mask_mod every pair attends
        if mask_mod is not None:
            def step_mask(b, h, qi, ki, q_pos=q_pos, kv_pos=kv_pos):
                return mask_mod(b, h, q_pos(qi), kv_pos(ki))

            block_mask = create_block_mask(step_mask, B if uses_b else None,
                                           Hq if uses_h else None, Lc, Sc,
                                           block_size=block_size)
            lists = block_mask.lists()
            blocks = lists.kv_num_blocks.sum()
            if lists.has_full:
                blocks = blocks + lists.full_kv_num_blocks.sum()

        def attend(k, v, block_mask=block_mask, step_score=step_score):
            step_out, step_lse = flex_attention(q, k, v, step_score, block_mask, scale=scale,
                                                enable_gqa=enable_gqa, return_lse=True,
                                                implementation=implementation)
            return step_out.astype(jnp.float32), step_lse

        def skip(k, v):  # what attend gives for no keys, varying over the mesh as it does
            zero = aligned(jnp.zeros(out.shape, jnp.float32), q, k, v)[0]
            return zero, zero[..., 0] - jnp.inf

        # The next shard is sent on while this one is attended to: the two are independent.
        if step + 1 < n:
            next_k, next_v = (lax.ppermute(x, axis_name, next_device) for x in (k, v))
        if always_attend:
            step_out, step_lse = attend(k, v)
        else:
            step_out, step_lse = lax.cond(blocks > 0, attend, skip, k, v)
        out, lse = _merge(out, lse, step_out, step_lse)
        launched = launched + (1 if always_attend else (blocks > 0).astype(jnp.int32))
        if step + 1 < n:
            k, v = next_k, next_v
    return out.astype(q.dtype), lse, launched


def ring_flex_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                        score_mod: Callable[..., jax.Array] | None = None,
                        mask_mod: Callable[..., jax.Array] | None = None, *, axis_name: str,
                        layout: str = "contiguous", scale: float | None = None,
                        enable_gqa: bool = False, return_lse: bool = False,
                        implementation: str | None = None, block_size: int = 128):
    """flex_attention over a sequence sharded across the devices of a mesh axis (a ring).

    Call it inside `jax.shard_map` with q, k and v sharded along the sequence (axis 2) over
    mesh axis `axis_name`. The result is exactly `flex_attention` on the whole sequence, with
    global positions as `q_idx` / `kv_idx` in the mods, and this device's shard of it.

    Args:
      q: [B, Hq, Lc, E], this device's shard of the queries (Lc = L / devices).
      k, v: [B, Hkv, Lc, E] and [B, Hkv, Lc, Ev], its shards of the keys and values; q, k, v
        bfloat16, float16 or float32, one dtype.
      score_mod: `f(score, b, h, q_idx, kv_idx)` as in flex_attention, on global positions.
      mask_mod: `f(b, h, q_idx, kv_idx) -> bool` on global positions; None attends to every
        key. A BlockMask is built from it for every pair of shards, so a pair with nothing to
        attend to is skipped.
      axis_name: the mesh axis the sequence is sharded over.
      layout: "contiguous" (device i holds the i-th shard) or "zigzag" (device i holds chunks
        i and 2n−1−i of 2n: equal work per device under a causal mask; see `jattn.to_zigzag`).
      scale, enable_gqa, return_lse, implementation: as in flex_attention.
      block_size: the BlockMask block of each pair of shards (it must divide Lc).

    Returns:
      [B, Hq, Lc, Ev] of q's dtype, this device's shard of the output; with return_lse also
      its [B, Hq, Lc] float32 shard of the natural-log LSE. Differentiable in q, k, v and
      arrays the mods read (replicate globally indexed tables).

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
    out, lse, _ = ring_steps(q, k, v, score_mod, mask_mod, axis_name=axis_name, layout=layout,
                             scale=scale, enable_gqa=enable_gqa, implementation=implementation,
                             block_size=block_size)
    return (out, lse) if return_lse else out
