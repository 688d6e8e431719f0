"""Which strategy shares the keys among the devices: the caller's, or for "auto" the one
measured faster for the call's mask, layout and heads.

Measured on two H200s (forward + backward, B1 H16 D128 bf16, 32k and 128k tokens;
docs/context_parallel.md): the ring led wherever every device's queries visit about as many
blocks (causal under zigzag, documents in either layout: it skips the steps the mask leaves
empty and overlaps its transfers with the pairs' kernels); the heads all-to-all led where they
do not (causal under the contiguous layout: 1.87x one GPU against the ring's 1.25x at 32k), as
it gives every device the whole sequence of its heads. The all-gather led on no row measured.
"""

from __future__ import annotations

from jattn._src.masks.block_mask import BlockMask
from jattn._src.ring.schedule import work_balance

STRATEGIES = ("auto", "ring", "all_gather", "heads")

# The ring's devices wait for the one with the most work; above this share over the mean the
# heads strategy's equal split pays for its two all-to-alls (contiguous causal: 1.5).
RING_BALANCE = 1.25


def check(fn: str, strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"{fn}: `strategy` must be one of {STRATEGIES}, got {strategy!r}.")


def resolved(strategy: str, *, block_mask: BlockMask | None, has_mask_mod: bool,
             num_devices: int, layout: str, heads: int, kv_heads: int) -> str:
    """The strategy that runs: `strategy` itself, or for "auto" the ring where the whole
    sequence's BlockMask (its values known) gives the devices' queries equal work within
    RING_BALANCE, or where the heads do not divide by the devices; the heads elsewhere (a
    mask_mod's or a traced BlockMask's balance is unknown)."""
    if strategy != "auto":
        return strategy
    if num_devices == 1 or heads % num_devices or kv_heads % num_devices:
        return "ring"
    if block_mask is None and has_mask_mod:
        return "heads"
    balance = work_balance(block_mask, num_devices, layout)
    return "ring" if balance is not None and balance <= RING_BALANCE else "heads"
