"""Mask mods for `jattn.create_block_mask` and `jattn.flex_attention`."""

from jattn._src.masks.mods import and_masks as and_masks
from jattn._src.masks.mods import causal_mask as causal_mask
from jattn._src.masks.mods import document_mask as document_mask
from jattn._src.masks.mods import noop_mask as noop_mask
from jattn._src.masks.mods import or_masks as or_masks
from jattn._src.masks.mods import prefix_lm as prefix_lm
from jattn._src.masks.mods import sliding_window as sliding_window
