"""Empty dimensions give empty results (or zeros where nothing is summed) on every
implementation alike, and their gradients are zeros of the inputs' shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn


def _ones(*shape):
    return jnp.ones(shape, jnp.float32)


def test_a_block_past_the_sequence_holds_it_whole():
    """As torch: a block larger than the sequence is one block (built without padding)."""
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 64, 300,
                                   block_size=(2**20, 1024))
    assert mask.block_size == (2**20, 1024) and mask.num_blocks == (1, 1)
    q = jnp.ones((1, 1, 64, 16))
    k = jnp.asarray(np.random.default_rng(0).standard_normal((1, 1, 300, 16)), jnp.float32)
    causal = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 64, 300)
    np.testing.assert_allclose(jattn.flex_attention(q, k, k, block_mask=mask),
                               jattn.flex_attention(q, k, k, block_mask=causal), atol=1e-6)


@pytest.mark.parametrize("shape, kv_length", [((0, 2, 16, 8), 16), ((1, 2, 16, 8), 0)])
def test_empty_results_are_on_the_inputs_device(shape, kv_length):
    """Nothing to compute (an empty batch, no key): the zeros come back where the inputs are,
    as a computed result would, not on the default device."""
    device = jax.devices()[-1]
    q = jax.device_put(jnp.ones(shape), device)
    kv = jax.device_put(jnp.ones((*shape[:2], kv_length, shape[3])), device)
    out, lse = jattn.flex_attention(q, kv, kv, return_lse=True)
    assert out.devices() == lse.devices() == {device}
    cache = jax.device_put(jnp.ones((shape[0], shape[1], kv_length, shape[3])), device)
    decoded = jattn.flex_decode(q[:, :, :1], cache, cache)
    assert decoded.devices() == {device}


class EmptyDimensionsBackendTests:
    """What every backend of every op must do with empty dimensions: each backend's class below
    names it, and a new backend is one more class."""

    implementation: str

    @pytest.mark.parametrize("B, L, S", [(0, 32, 32), (1, 0, 32), (1, 32, 0)])
    def test_flex_attention(self, B, L, S):
        impl = self.implementation
        q, k, v = _ones(B, 2, L, 16), _ones(B, 2, S, 16), _ones(B, 2, S, 8)
        out, lse = jattn.flex_attention(q, k, v, lambda s, *_: s * 2, return_lse=True,
                                        implementation=impl)
        assert out.shape == (B, 2, L, 8) and lse.shape == (B, 2, L)
        np.testing.assert_array_equal(out, 0)
        assert np.isneginf(lse).all()
        grads = jax.grad(lambda q, k, v: jattn.flex_attention(q, k, v, implementation=impl).sum(),
                         argnums=(0, 1, 2))(q, k, v)
        for grad, x in zip(grads, (q, k, v)):
            assert grad.shape == x.shape and not np.asarray(grad).any()

    @pytest.mark.parametrize("B, Lq, S", [(0, 1, 32), (2, 0, 32), (2, 1, 0)])
    def test_flex_decode(self, B, Lq, S):
        impl = self.implementation
        out = jattn.flex_decode(_ones(B, 4, Lq, 16), _ones(B, 2, S, 16), _ones(B, 2, S, 16),
                                implementation=impl)
        assert out.shape == (B, 4, Lq, 16)
        np.testing.assert_array_equal(out, 0)

    @pytest.mark.parametrize("M, K, N", [(0, 32, 16), (16, 0, 16), (16, 32, 0)])
    def test_gemms(self, M, K, N):
        impl = self.implementation
        a, b, bias = _ones(M, K), _ones(K, N), jnp.full((N,), 2.0)
        out = jattn.matmul(a, b, bias=bias, epilogue=jnp.tanh, implementation=impl)
        np.testing.assert_array_equal(out, jnp.broadcast_to(jnp.tanh(bias), (M, N)))
        out = jattn.mm_plus_mm(a, b, a, b, implementation=impl)
        np.testing.assert_array_equal(out, jnp.zeros((M, N)))
        out = jattn.bmm(a[None], b[None], implementation=impl)
        np.testing.assert_array_equal(out, jnp.zeros((1, M, N)))
        grads = jax.grad(lambda a, b: jattn.matmul(a, b, implementation=impl).sum(),
                         argnums=(0, 1))(a, b)
        assert [g.shape for g in grads] == [a.shape, b.shape]


class TestXla(EmptyDimensionsBackendTests):
    implementation = "xla"


class TestInterpret(EmptyDimensionsBackendTests):
    implementation = "interpret"


@pytest.mark.gpu
class TestPallasTriton(EmptyDimensionsBackendTests):
    implementation = "pallas_triton"
