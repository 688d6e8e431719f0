"""Score mods for `jattn.flex_attention` and `jattn.flex_decode`.

A score mod is `score_mod(score, b, h, q_idx, kv_idx) -> score` on float32 scores (already
scaled) and broadcastable int32 indices; arrays it closes over are kernel inputs and receive
gradients.

    alibi(slopes)                  score + slopes[h] * (kv_idx - q_idx); slopes [H]
    alibi_slopes(H)                the standard ALiBi slopes, float32 [H]
    softcap(cap)                   cap * tanh(score / cap)
    relative_position_bias(table)  score + table[h, clip(kv_idx - q_idx, ±R) + R]; table [H, 2R+1]

Example::

    q = k = v = jnp.ones((1, 4, 128, 32), jnp.float32)  # [B, H, L, E]
    out = jattn.flex_attention(q, k, v, jattn.mods.alibi(jattn.mods.alibi_slopes(q.shape[1])))
    print(out.shape)  # (1, 4, 128, 32)
"""

from jattn._src.masks.mods import alibi as alibi
from jattn._src.masks.mods import alibi_slopes as alibi_slopes
from jattn._src.masks.mods import relative_position_bias as relative_position_bias
from jattn._src.masks.mods import softcap as softcap

__all__ = ["alibi", "alibi_slopes", "relative_position_bias", "softcap"]
