"""A key a query never reads cannot affect it, NaN included, on every implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from tests.helpers import random

L, E, BLOCK = 128, 16, 32


def _causal_inputs(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (random(rng, (1, 2, L, E)) for _ in range(3))
    return q, k, v


class UnreadKeysBackendTests:
    """What every `flex_attention` and `flex_decode` backend must do with keys no query reads: each
    backend's class below names it, and a new backend is one more class."""

    implementation: str

    def test_nan_outside_the_block_mask_does_not_leak(self):
        impl = self.implementation
        q, k, v = _causal_inputs()
        mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L,
                                       block_size=BLOCK)
        poisoned = slice(L - BLOCK, L)  # the last key block: only the last query block reads it
        k_nan, v_nan = (x.at[:, :, poisoned].set(jnp.nan) for x in (k, v))
        out = jattn.flex_attention(q, k_nan, v_nan, block_mask=mask, implementation=impl)
        clean = jattn.flex_attention(q, k, v, block_mask=mask, implementation=impl)
        np.testing.assert_array_equal(out[:, :, :L - BLOCK], clean[:, :, :L - BLOCK])
        assert np.isnan(out[:, :, L - BLOCK:]).all()

    def test_nan_keys_no_query_reads_give_no_nan_gradients(self):
        impl = self.implementation
        q, k, v = _causal_inputs()
        unread = L - BLOCK  # the last key block: no query's blocks list it

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (kv_idx < unread)

        mask = jattn.create_block_mask(mask_mod, None, None, L, L, block_size=BLOCK)
        k_nan, v_nan = (x.at[:, :, unread:].set(jnp.nan) for x in (k, v))

        def loss(q, k, v):
            return jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s * 1.5, mask,
                                        implementation=impl).sum()

        grads = jax.grad(loss, argnums=(0, 1, 2))(q, k_nan, v_nan)
        clean = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        for got, expected in zip(grads, clean):
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
        assert not np.asarray(grads[1][:, :, unread:]).any()

    def test_learnable_bias_gradient_ignores_nan_keys_outside_the_mask(self):
        impl = self.implementation
        q, k, v = _causal_inputs(1)
        mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L,
                                       block_size=BLOCK)
        k_nan = k.at[:, :, L - BLOCK:].set(jnp.nan)

        def loss(cap, k):
            def softcap(s, b, h, qi, ki):
                return cap[h] * jnp.tanh(s / cap[h])
            return jattn.flex_attention(q, k, v, softcap, mask, implementation=impl)[
                :, :, :L - BLOCK].sum()  # the rows that read no NaN key

        cap = jnp.array([5.0, 7.0])
        np.testing.assert_allclose(jax.grad(loss)(cap, k_nan), jax.grad(loss)(cap, k), rtol=1e-5)

    def test_decode_slots_past_kv_len_do_not_leak(self):
        impl = self.implementation
        rng = np.random.default_rng(2)
        S = 96
        q = random(rng, (2, 4, 1, E))
        k, v = (random(rng, (2, 2, S, E)) for _ in range(2))
        kv_len = jnp.array([40, 96])
        k_nan = k.at[0, :, 40:].set(jnp.nan)
        v_nan = v.at[0, :, 40:].set(jnp.inf)
        out = jattn.flex_decode(q, k_nan, v_nan, kv_len=kv_len, implementation=impl)
        clean = jattn.flex_decode(q, k, v, kv_len=kv_len, implementation=impl)
        np.testing.assert_array_equal(out, clean)


class TestXla(UnreadKeysBackendTests):
    implementation = "xla"


class TestInterpret(UnreadKeysBackendTests):
    implementation = "interpret"


@pytest.mark.gpu
class TestPallasTriton(UnreadKeysBackendTests):
    implementation = "pallas_triton"
