"""Which strategy shares the keys among the devices: the caller's, or for "auto" the one
measured faster for the call's mask, layout, heads and devices.

Measured on two and four H200s (forward + backward, B1 H16 D128 bf16, 32k and 128k tokens;
docs/context_parallel.md): the ring led wherever every device's queries visit about as many
blocks and the mask is sparse (documents in either layout: it skips the steps the mask leaves
empty and overlaps its transfers with the pairs' kernels), and under causal zigzag on two
devices; the heads all-to-all led where the work is unequal (causal under the contiguous
layout: 1.87x one GPU against the ring's 1.27x at 32k on two), and under causal zigzag on four
(3.48x against 3.14x at 32k), where each of the ring's four steps is a quarter-size kernel with
a merge after it while the heads strategy runs one kernel over the whole sequence. The
all-gather led on no row measured.
"""

from __future__ import annotations

from jattn._src.masks.block_mask import BlockMask
from jattn._src.ring.schedule import visited_share, work_balance

STRATEGIES = ("auto", "ring", "all_gather", "heads")

# The ring's devices wait for the one with the most work; above this share over the mean the
# heads strategy's equal split pays for its two all-to-alls (contiguous causal: 1.5).
RING_BALANCE = 1.25
# A mask visiting at least this share of the blocks (causal: about half) is dense: its ring
# steps are big kernels the heads strategy's all-to-alls are small against, and from this many
# devices on the heads strategy's one kernel beats the ring's steps and merges even at equal
# work (causal zigzag: 1.11x faster at 32k, 1.02x at 128k on four; on two the ring's 1.04x /
# 1.00x faster). Documents of 4k tokens visit 6% of the blocks at 32k.
DENSE_SHARE = 0.25
DENSE_HEADS_FROM = 4


def check(fn: str, strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"{fn}: `strategy` must be one of {STRATEGIES}, got {strategy!r}.")


def resolved(strategy: str, *, block_mask: BlockMask | None, has_mask_mod: bool,
             num_devices: int, layout: str, heads: int, kv_heads: int) -> str:
    """The strategy that runs: `strategy` itself, or for "auto" the ring where the whole
    sequence's BlockMask (its values known) gives the devices' queries equal work within
    RING_BALANCE, unless it is dense and the devices DENSE_HEADS_FROM or more, or where the
    heads do not divide by the devices; the heads elsewhere (a mask_mod's or a traced
    BlockMask's balance is unknown)."""
    if strategy != "auto":
        return strategy
    if num_devices == 1 or heads % num_devices or kv_heads % num_devices:
        return "ring"
    if block_mask is None and has_mask_mod:
        return "heads"
    balance = work_balance(block_mask, num_devices, layout)
    if balance is None or balance > RING_BALANCE:
        return "heads"
    dense = visited_share(block_mask) >= DENSE_SHARE
    return "heads" if dense and num_devices >= DENSE_HEADS_FROM else "ring"
