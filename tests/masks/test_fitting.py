"""BlockMasks of any block size attend as their mask says: blocks past the sequence, blocks
below the kernels' 16 and blocks that are no multiple of 16 (as torch accepts them), in the
forward, the backward and decoding, on every implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src import hardware
from tests.helpers import lower_for_cuda, random

L, S = 96, 80
SLIDING = jattn.masks.sliding_window(20)


def _sparse(b, h, q_idx, kv_idx):  # a mask whose blocks differ at every block size
    return SLIDING(b, h, q_idx, kv_idx) | (kv_idx % 7 == 0)


@pytest.mark.parametrize("impl,block_size", [
    ("xla", (1, 64)), ("xla", (24, 40)), ("interpret", (8, 8)), ("interpret", (256, 16)),
    *(pytest.param("pallas_triton", block, marks=pytest.mark.gpu)
      for block in ((1, 64), (8, 8), (24, 40), (256, 16)))])
def test_any_block_size_attends_as_sixteen(impl, block_size):
    rng = np.random.default_rng(0)
    q, k, v = (random(rng, (1, 2, n, 16)) for n in (L, S, S))
    cotangent = random(rng, (1, 2, L, 16))
    reference = jattn.create_block_mask(_sparse, None, None, L, S, block_size=16)
    mask = jattn.create_block_mask(_sparse, None, None, L, S, block_size=block_size)
    assert mask.block_size == block_size

    def run(mask):
        def loss(q, k, v):
            out = jattn.flex_attention(q, k, v, block_mask=mask, implementation=impl,
                                       precision="highest")  # (TF32 differs by tile on GPUs)
            return jnp.sum(out * cotangent), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, out), grads = run(mask)
    (_, expected), expected_grads = run(reference)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    for g, e in zip(grads, expected_grads):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["interpret", pytest.param("pallas_triton",
                                                              marks=pytest.mark.gpu)])
def test_decoding_with_one_query_per_block(impl):
    rng = np.random.default_rng(1)
    q, cache = random(rng, (2, 4, 1, 16)), random(rng, (2, 2, 128, 16))
    lengths = jnp.array([50, 128])
    outs = [jattn.flex_decode(q, cache, cache, block_mask=jattn.create_block_mask(
        _sparse, None, None, 128, 128, block_size=block), kv_len=lengths, implementation=impl,
        precision="highest") for block in ((1, 64), (16, 64))]
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)


def test_small_blocks_lower_for_cuda(monkeypatch):
    monkeypatch.setattr(hardware, "has_cuda", lambda: True)
    mask = jattn.create_block_mask(_sparse, None, None, 256, 256, block_size=(1, 64))
    spec = jax.ShapeDtypeStruct((1, 2, 256, 64), jnp.bfloat16)

    def attention(q):
        return jattn.flex_attention(q, q, q, block_mask=mask, implementation="pallas_triton")

    assert "jattn_flex_fwd" in lower_for_cuda(attention, spec)


def test_legal_blocks_are_multiples_of_sixteen():
    from jattn._src.masks.fitting import legal_block
    for block, length in ((100, 64), (256, 64), (24, 100), (1, 64), (120, 100), (2**20, 300)):
        legal = legal_block(block, length)
        assert legal % 16 == 0 and (legal >= length if block >= length else legal % block == 0)
