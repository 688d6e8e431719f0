"""Mask mods for `jattn.create_block_mask` and `jattn.flex_attention`.

A mask mod is `mask_mod(b, h, q_idx, kv_idx) -> bool` on broadcastable int32 index arrays:
True where query `q_idx` may attend to key `kv_idx`.

    noop_mask           every pair attends
    causal_mask         q_idx >= kv_idx
    sliding_window(w)   causal, and at most w - 1 positions back
    prefix_lm(n)        causal, plus the first n keys attended by every query
    document_mask(ids)  within one document: ids[q_idx] == ids[kv_idx] (ids [L] or [B, L])
    and_masks(*mods)    all of the mods
    or_masks(*mods)     any of the mods

Example::

    mask = jattn.create_block_mask(jattn.masks.sliding_window(256), None, None, 4096, 4096)
    print(mask.shape)  # (1, 1, 4096, 4096)
"""

from jattn._src.masks.mods import and_masks as and_masks
from jattn._src.masks.mods import causal_mask as causal_mask
from jattn._src.masks.mods import document_mask as document_mask
from jattn._src.masks.mods import noop_mask as noop_mask
from jattn._src.masks.mods import or_masks as or_masks
from jattn._src.masks.mods import prefix_lm as prefix_lm
from jattn._src.masks.mods import sliding_window as sliding_window

__all__ = ["and_masks", "causal_mask", "document_mask", "noop_mask", "or_masks", "prefix_lm",
           "sliding_window"]
