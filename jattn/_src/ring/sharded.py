"""FlexAttention on global arrays sharded over a mesh: shard_map called for the user.

The sequence axis goes around a ring (`ring_flex_attention`); batch and head axes need no
communication, each device attending its own batch rows and heads. The mods see global batch,
head and sequence indices wherever the axes are split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jattn._src.attention.api import flex_attention
from jattn._src.attention.sinks import checked_sinks
from jattn._src.masks.block_mask import BlockMask
from jattn._src.ring import blocks
from jattn._src.ring import strategy as strategies
from jattn._src.ring.arguments import checked_token_arrays, mask_mod_of
from jattn._src.ring.attention import scheduled_ring_attention
from jattn._src.ring.schedule import ring_schedule

_FN = "sharded_flex_attention"


def _offset(axis: str | None, local_size: int):
    """The global index of this device's first batch row or head along a mesh axis."""
    return 0 if axis is None else lax.axis_index(axis) * local_size


def _check_axes(mesh: Mesh, q, k, axes: dict[str, str | None]) -> None:
    for role, axis in axes.items():
        if axis is not None and axis not in mesh.axis_names:
            raise ValueError(f"{_FN}: `{role}` {axis!r} is not an axis of the mesh "
                             f"{mesh.axis_names}.")
    dims = {"batch_axis": (0, "batch"), "head_axis": (1, "heads"),
            "sequence_axis": (2, "length")}
    for role, axis in axes.items():
        if axis is None:
            continue
        dim, name = dims[role]
        size = mesh.shape[axis]
        for label, x in (("q", q), ("k", k)):
            if x.shape[dim] % size:
                raise ValueError(f"{_FN}: {label}'s {name} ({x.shape[dim]}, shape {x.shape}) "
                                 f"must divide evenly over the {size} devices of mesh axis "
                                 f"{axis!r}.")


def sharded_flex_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                           score_mod: Callable[..., jax.Array] | None = None,
                           mask_mod: Callable[..., jax.Array] | None = None, *, mesh: Mesh,
                           batch_axis: str | None = None, head_axis: str | None = None,
                           sequence_axis: str | None = None, layout: str = "contiguous",
                           scale: float | None = None, enable_gqa: bool = False,
                           return_lse: bool = False, implementation: str | None = None,
                           block_size: int = 128, token_arrays: Sequence[jax.Array] = (),
                           block_mask: BlockMask | None = None,
                           sinks: jax.Array | None = None, strategy: str = "auto"):
    """flex_attention on global q, k, v split over `mesh`: batch over `batch_axis`, heads
    over `head_axis`, the sequence over `sequence_axis` (a ring: `ring_flex_attention`).

    Call it on global arrays, eagerly or under `jax.jit`; it runs `jax.shard_map` over the mesh.
    With `layout="zigzag"` the sequence is expected in the zigzag order (`jattn.to_zigzag`).

    Args:
      q: [B, Hq, L, E]; k: [B, Hkv, L, E]; v: [B, Hkv, L, Ev]; each split axis divisible by its
        mesh axis' size (Hq and Hkv both, for heads).
      score_mod, mask_mod: as in flex_attention, on global batch, head and position indices.
      mesh: the device mesh; batch_axis, head_axis, sequence_axis: mesh axis names or None
        (not split). scale, enable_gqa, return_lse, implementation: as in flex_attention.
      layout, block_size: as in ring_flex_attention (block_size also for the BlockMask when
        the sequence is not split).
      token_arrays: per-token integer or bool arrays over the whole sequence, [..., L]
        (document ids, ...): the mods take one more argument per array, as in
        ring_flex_attention. Split with the sequence (the key side travelling with k),
        whole on every device otherwise.
      block_mask: instead of mask_mod, a BlockMask of the whole arrays ([B|1, Hq|1, L, L],
        from `jattn.create_block_mask`; its mask_mod on global indices): each device takes
        its batch rows' and heads' blocks, and the ring cuts each pair's from it (see
        ring_flex_attention), so no mask is evaluated to find them. Where its values are
        known (not traced: built outside the jitted function), the ring skips the steps it
        leaves empty on every device, transfers included.
      sinks: attention sinks [Hq], one logit per query head, as in flex_attention (split
        with the heads over `head_axis`).
      strategy: how the devices of `sequence_axis` share the keys: "auto" (the default),
        "ring", "all_gather" or "heads", as in ring_flex_attention (the heads this device
        holds split further for "heads"; "auto" judges a block_mask given outside jit).

    Returns:
      [B, Hq, L, Ev] (and the [B, Hq, L] LSE with return_lse), split as the inputs are.

    Example::

        from jax.sharding import Mesh
        mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
        q = k = v = jnp.ones((2, 4, 256, 32))                      # [B, H, L, E]
        out = jattn.sharded_flex_attention(q, k, v, mask_mod=jattn.masks.causal_mask,
                                           mesh=mesh, batch_axis="data")
        print(out.shape)                                            # (2, 4, 256, 32)
    """
    axes = {"batch_axis": batch_axis, "head_axis": head_axis, "sequence_axis": sequence_axis}
    _check_axes(mesh, q, k, axes)
    strategies.check(_FN, strategy)
    checked_token_arrays(_FN, token_arrays, q.shape[2],
                         f"has the sequence ({q.shape[2]} positions) as its last axis")
    mask_mod = mask_mod_of(_FN, mask_mod, block_mask, "arrays")
    spec = P(batch_axis, head_axis, sequence_axis)
    B_local = q.shape[0] // (1 if batch_axis is None else mesh.shape[batch_axis])
    H_local = q.shape[1] // (1 if head_axis is None else mesh.shape[head_axis])

    def global_mods(*tokens):
        """The mods on global batch and head indices; with `tokens`, reading them too."""
        b0, h0 = _offset(batch_axis, B_local), _offset(head_axis, H_local)
        score = None if score_mod is None else (
            lambda s, b, h, qi, ki, *more: score_mod(s, b + b0, h + h0, qi, ki, *tokens, *more))
        mask = None if mask_mod is None else (
            lambda b, h, qi, ki, *more: mask_mod(b + b0, h + h0, qi, ki, *tokens, *more))
        return score, mask

    def local_blocks(whole, mask):
        """This device's batch rows and heads of the whole BlockMask, reading `mask`."""
        return blocks.sliced(
            whole, mask,
            batch=None if batch_axis is None else (_offset(batch_axis, B_local), B_local),
            heads=None if head_axis is None else (_offset(head_axis, H_local), H_local))

    # (worked out here: inside shard_map the BlockMask is an argument, its values traced)
    if sequence_axis is not None:
        strategy = strategies.resolved(
            strategy, block_mask=block_mask, has_mask_mod=mask_mod is not None,
            num_devices=mesh.shape[sequence_axis], layout=layout, heads=H_local,
            kv_heads=k.shape[1] // (1 if head_axis is None else mesh.shape[head_axis]))
    schedule = None if sequence_axis is None or strategy != "ring" else ring_schedule(
        block_mask, mesh.shape[sequence_axis], layout)

    def local(q, k, v, whole, sinks, *tokens):
        if sequence_axis is not None:
            score, mask = global_mods()
            local_mask = None if whole is None else local_blocks(whole, mask)
            return scheduled_ring_attention(
                q, k, v, score, mask if whole is None else None, schedule,
                axis_name=sequence_axis, layout=layout, scale=scale, enable_gqa=enable_gqa,
                return_lse=True, implementation=implementation, block_size=block_size,
                token_arrays=tokens, block_mask=local_mask, sinks=sinks, strategy=strategy)
        score, mask = global_mods(*tokens)
        local_mask = (blocks.built(mask, *q.shape[:3], k.shape[2], block_size) if whole is None
                      else local_blocks(whole, mask))
        return flex_attention(q, k, v, score, local_mask, scale=scale, enable_gqa=enable_gqa,
                              return_lse=True, implementation=implementation, sinks=sinks)

    token_specs = tuple(P(*(None,) * (jnp.ndim(x) - 1), sequence_axis) for x in token_arrays)
    sinks = checked_sinks(_FN, sinks, q.shape[1])
    out, lse = jax.shard_map(local, mesh=mesh,
                             in_specs=(spec,) * 3 + (P(), P(head_axis)) + token_specs,
                             out_specs=(spec, spec))(q, k, v, block_mask, sinks, *token_arrays)
    return (out, lse) if return_lse else out
