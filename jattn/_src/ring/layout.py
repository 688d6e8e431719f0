"""Where each device's sequence shard sits in the global sequence, and the zigzag reordering.

contiguous: device i holds positions [i·c, (i+1)·c) of a sequence split into n chunks of c.
zigzag: the sequence is split into 2n chunks of c/2; device i holds chunks i and 2n−1−i, so
under a causal mask every device has the same amount of work (an early chunk and a late one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str, shard_length: int, fn: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: `layout` must be one of {LAYOUTS}, got {layout!r}.")
    if layout == "zigzag" and shard_length % 2:
        raise ValueError(f"{fn}: layout='zigzag' splits each device's shard in two halves, so "
                         f"its length must be even, got {shard_length}.")


def global_positions(local, device, num_devices: int, shard_length: int, layout: str, xp=jnp):
    """The global positions of local indices `local` (int32 array) of the shard held by
    `device` (an int or a traced int32 scalar); xp=np: of a known device, by numpy."""
    if layout == "contiguous":
        return local + device * shard_length
    half = shard_length // 2
    late = 2 * num_devices - 1 - device
    return xp.where(local < half, local + device * half, local - half + late * half)


def _zigzag_order(num_devices: int) -> list[int]:
    """The original chunk index of each zigzag chunk: 0, 2n−1, 1, 2n−2, ..."""
    return [c for i in range(num_devices) for c in (i, 2 * num_devices - 1 - i)]


def _chunks_taken(x: jax.Array, order, axis: int) -> jax.Array:
    """x's `axis` cut into len(order) equal chunks, the chunks order[0], order[1], ... in turn
    (one gather: splitting and concatenating 2n slices compiles far slower)."""
    axis = axis % x.ndim
    shape = x.shape
    chunked = x.reshape(shape[:axis] + (len(order), shape[axis] // len(order)) + shape[axis + 1:])
    return jnp.take(chunked, np.asarray(order), axis=axis).reshape(shape)


def _check_split(x: jax.Array, num_devices: int, axis: int, fn: str) -> None:
    length = x.shape[axis]
    if num_devices < 1 or length % (2 * num_devices):
        raise ValueError(f"{fn}: the sequence axis {axis} of length {length} must split into "
                         f"2 x num_devices = {2 * num_devices} equal chunks (x {x.shape}).")


def to_zigzag(x: jax.Array, num_devices: int, axis: int = 2) -> jax.Array:
    """x with its sequence axis reordered so that sharding it evenly over `num_devices` gives
    device i the chunks i and 2·num_devices−1−i of the original order (layout="zigzag").

    Args:
      x: any array whose `axis` (default 2, as in [B, H, L, E]) has a length divisible by
        2·num_devices.
      num_devices: the size of the mesh axis the sequence is sharded over.
      axis: the sequence axis.

    Returns:
      An array of x's shape and dtype; `from_zigzag` undoes it.

    Example::

        x = jnp.arange(8)[None, None, :, None]        # [B, H, L, E], positions 0..7
        print(jattn.to_zigzag(x, 2)[0, 0, :, 0])       # [0 1 6 7 2 3 4 5]
    """
    _check_split(x, num_devices, axis, "to_zigzag")
    return _chunks_taken(x, _zigzag_order(num_devices), axis)


def from_zigzag(x: jax.Array, num_devices: int, axis: int = 2) -> jax.Array:
    """The inverse of `to_zigzag`: a zigzag-ordered sequence axis back in its original order.

    Args:
      x: an array in the zigzag order along `axis` (default 2).
      num_devices: the size of the mesh axis, as given to `to_zigzag`.
      axis: the sequence axis.

    Returns:
      An array of x's shape and dtype.

    Example::

        x = jnp.arange(8)[None, None, :, None]
        print(jattn.from_zigzag(jattn.to_zigzag(x, 2), 2)[0, 0, :, 0])   # [0 1 2 3 4 5 6 7]
    """
    _check_split(x, num_devices, axis, "from_zigzag")
    return _chunks_taken(x, np.argsort(_zigzag_order(num_devices)), axis)
