"""The flex attention kernels lower to Triton for CUDA, checked on any machine (no GPU needed)."""

import jax
import jax.numpy as jnp
import pytest

import jattn
from jattn._src import hardware
from tests.helpers import lower_for_cuda


@pytest.fixture
def as_if_on_gpu(monkeypatch):
    """Selects the Pallas-Triton path without a GPU (only lowering runs, nothing executes)."""
    monkeypatch.setattr(hardware, "has_cuda", lambda: True)


def _spec(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("E,Ev,ragged", [(128, 128, False), (80, 64, True), (64, 64, True)])
def test_forward_and_backward_lower(as_if_on_gpu, E, Ev, ragged):
    B, Hq, Hkv = 2, 8, 2
    L, S = (1000, 1030) if ragged else (1024, 1024)
    table = jnp.zeros((Hq, 255))                 # not a power of two: read element-wise
    segments = jnp.zeros((max(L, S),), jnp.int32)  # an id for every query and key
    mask = jattn.masks.and_masks(jattn.masks.causal_mask, jattn.masks.document_mask(segments))
    block_mask = jattn.create_block_mask(mask, None, None, L, S)

    def attention(q, k, v, table):
        return jattn.flex_attention(q, k, v, jattn.mods.relative_position_bias(table),
                                    block_mask, enable_gqa=True, return_lse=True,
                                    implementation="pallas_triton")

    def gradients(q, k, v, table):
        cotangent = (jnp.ones((B, Hq, L, Ev), jnp.bfloat16), jnp.ones((B, Hq, L)))
        return jax.vjp(attention, q, k, v, table)[1](cotangent)

    args = (_spec(B, Hq, L, E), _spec(B, Hkv, S, E), _spec(B, Hkv, S, Ev), table)
    assert "jattn_flex_fwd" in lower_for_cuda(attention, *args)
    text = lower_for_cuda(gradients, *args)
    assert all(f"jattn_flex_bwd_{name}" in text for name in ("delta", "dq", "dkdv"))


def test_softcap_alibi_full_attention_lowers(as_if_on_gpu):
    """(with the rows' largest scores as a third output)"""
    slopes = jattn.mods.alibi_slopes(16)

    def attention(q, k, v):
        mod = lambda s, b, h, qi, ki: jattn.mods.softcap(30.0)(
            jattn.mods.alibi(slopes)(s, b, h, qi, ki), b, h, qi, ki)
        return jattn.flex_attention(q, k, v, mod, implementation="pallas_triton",
                                    return_max_scores=True)

    args = [_spec(1, 16, 512, 64, dtype=jnp.float16)] * 3
    assert "jattn_flex_fwd" in lower_for_cuda(attention, *args)


def test_dropout_lowers(as_if_on_gpu):
    """The mask's int32 hash (wrapping products, logical shifts) and the seed's scalar reads,
    forward and backward, the key an argument."""
    def gradients(q, k, v, key):
        def attention(q, k, v):
            return jattn.flex_attention(q, k, v, jattn.mods.softcap(20.0),
                                        implementation="pallas_triton", dropout_rate=0.1,
                                        dropout_key=key)
        return jax.vjp(attention, q, k, v)[1](jnp.ones((1, 4, 384, 64), jnp.bfloat16))

    text = lower_for_cuda(gradients, *[_spec(1, 4, 384, 64)] * 3, jax.random.key(0))
    assert all(f"jattn_flex_{name}" in text for name in ("fwd", "bwd_dq", "bwd_dkdv"))


@pytest.mark.parametrize("E", [128, 64])
def test_forward_mode_tangent_kernel_lowers(as_if_on_gpu, E):
    """jax.jvp runs jattn_flex_jvp (not the XLA JVP) where no captured array moves: a softcap
    score_mod (its derivative inside the kernel), a table it reads, a causal BlockMask, GQA,
    dropout, tangents of q and v only."""
    table = jnp.zeros((8, 255))

    def tangents(q, k, v, dq, dv, key):
        def attention(q, v):
            mod = lambda s, b, h, qi, ki: jattn.mods.softcap(20.0)(
                s + table[h, (ki - qi) % 255], b, h, qi, ki)
            return jattn.flex_attention(q, k, v, mod, mask, enable_gqa=True, return_lse=True,
                                        implementation="pallas_triton", dropout_rate=0.1,
                                        dropout_key=key)
        return jax.jvp(attention, (q, v), (dq, dv))[1]

    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 1000, 1000)
    q, kv = _spec(2, 8, 1000, E), _spec(2, 2, 1000, E)
    text = lower_for_cuda(tangents, q, kv, kv, q, kv, jax.random.key(0))
    assert "jattn_flex_jvp" in text and "jattn_flex_fwd" in text
