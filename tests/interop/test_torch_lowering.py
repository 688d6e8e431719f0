"""Torch-written mods, translated, lower into the Triton flex kernels for CUDA (checked on any
machine): chained and nested indexing become the kernels' indexed loads, not gathers."""

import jax
import jax.numpy as jnp
import pytest

import jattn
from jattn._src import hardware
from tests.helpers import lower_for_cuda

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")
from interop import _capture  # noqa: E402

B, H, L, E = 2, 4, 256, 64
BIAS = torch.randn(B, H, L, L)
DOCS = torch.arange(L, dtype=torch.int32) // 37
OFFSETS = torch.arange(0, L, 37, dtype=torch.int32)
SLOPES = torch.exp2(-torch.arange(1, H + 1.0))

SCORE_MODS = {
    "alibi": lambda s, b, h, q, kv: s + SLOPES[h] * (kv - q),
    "chained_index": lambda s, b, h, q, kv: s + BIAS[b][h][q][kv],
    "nested_gather": lambda s, b, h, q, kv: s + (q - OFFSETS[DOCS[q]]).to(s.dtype) * 0.01,
    "activations": lambda s, b, h, q, kv: torch.tan(s / 8) + torch.nn.functional.silu(s)
    + torch.nn.functional.gelu(s, approximate="tanh"),
    "full_like_shifts": lambda s, b, h, q, kv: torch.where(
        ((q >> 2) & 1) == 0, s, torch.full_like(s, -1e4)),
}
MASK = flex.and_masks(lambda b, h, q, kv: q >= kv, lambda b, h, q, kv: DOCS[q] == DOCS[kv])


@pytest.fixture
def as_if_on_gpu(monkeypatch):
    monkeypatch.setattr(hardware, "has_cuda", lambda: True)


def _jax(mod, kind):
    translation, tensors = _capture.capture(mod, kind)
    return translation.mod, [jnp.asarray(t.numpy()) for t in tensors]


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_translated_mods_lower_into_the_kernels(as_if_on_gpu, name):
    score, score_arrays = _jax(SCORE_MODS[name], "score")
    mask, mask_arrays = _jax(MASK, "mask")

    def attention(q, k, v, score_arrays, mask_arrays):
        block_mask = jattn.create_block_mask(mask.bind(mask_arrays), None, None, L, L)
        return jattn.flex_attention(q, k, v, score.bind(score_arrays), block_mask,
                                    implementation="pallas_triton")

    def gradients(q, k, v, score_arrays, mask_arrays):
        return jax.grad(lambda *x: attention(*x, mask_arrays).astype(jnp.float32).sum(),
                        argnums=(0, 1, 2))(q, k, v, score_arrays)

    spec = jax.ShapeDtypeStruct((B, H, L, E), jnp.bfloat16)
    args = (spec, spec, spec, score_arrays, mask_arrays)
    assert "jattn_flex_fwd" in lower_for_cuda(attention, *args)
    assert "jattn_flex_bwd_dq" in lower_for_cuda(gradients, *args)
