"""Score mods for `jattn.flex_attention`."""

from jattn._src.masks.mods import alibi as alibi
from jattn._src.masks.mods import alibi_slopes as alibi_slopes
from jattn._src.masks.mods import relative_position_bias as relative_position_bias
from jattn._src.masks.mods import softcap as softcap
