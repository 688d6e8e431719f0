"""Agreement with torch.nn.attention.flex_attention (CPU eager) on the same mods."""

import numpy as np
import pytest

import jattn

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")


def test_matches_torch_flex_attention_causal_alibi():
    rng = np.random.default_rng(0)
    B, H, L, E = 1, 4, 128, 32
    q, k, v = (rng.standard_normal((B, H, L, E)).astype(np.float32) for _ in range(3))
    slopes = np.asarray(jattn.mods.alibi_slopes(H))
    torch_slopes = torch.tensor(slopes)

    def torch_mod(score, b, h, q_idx, kv_idx):
        return score + torch_slopes[h] * (kv_idx - q_idx)

    def torch_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    torch_block_mask = flex.create_block_mask(torch_mask, None, None, L, L, device="cpu")
    expected = flex.flex_attention(*(torch.tensor(x) for x in (q, k, v)),
                                   score_mod=torch_mod, block_mask=torch_block_mask)
    block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)
    out = jattn.flex_attention(q, k, v, jattn.mods.alibi(slopes), block_mask,
                               implementation="xla")
    np.testing.assert_allclose(np.asarray(out), expected.numpy(), rtol=2e-5, atol=2e-5)
