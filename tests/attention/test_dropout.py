"""Dropout of the attention weights: against a float64 reference applying the same mask
(output, LSE, gradients), the mask the same on every implementation and its statistics (the
rate, independence across heads and batches, an unbiased expectation), the key as an argument
(no new program per key), and bad arguments."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.attention.reference import attention_reference
from tests.attention.golden import dropout_mask
from tests.helpers import assert_close, assert_gradients_close, golden, low_precision, random

B, Hq, Hkv, L, S, E = 2, 4, 2, 48, 80, 16
RATE = 0.3


def _tilt(score, b, h, q_idx, kv_idx):
    return score + 0.02 * (kv_idx - q_idx)


def _window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx + 20) & (kv_idx > q_idx - 40)


def test_every_implementation_draws_the_same_mask_and_each_key_its_own():
    rng = np.random.default_rng(1)
    q, k, v = (random(rng, (B, Hq, L, E)) for _ in range(3))

    def run(impl, key):
        return jattn.flex_attention(q, k, v, implementation=impl, dropout_rate=0.5,
                                    dropout_key=key)

    key = jax.random.key(3)
    np.testing.assert_allclose(run("interpret", key), run("xla", key), atol=2e-6, rtol=2e-6)
    assert np.array_equal(run("xla", key), run("xla", key))
    assert not np.allclose(run("xla", key), run("xla", jax.random.key(4)))
    legacy = jax.random.PRNGKey(3)  # a raw uint32[2] key draws as the typed one of its data
    np.testing.assert_array_equal(run("xla", legacy), run("xla", jax.random.wrap_key_data(
        legacy)))


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_weights_are_kept_at_one_minus_the_rate_independently_across_heads_and_batches(rate):
    shape = (4, 8, 256, 256)
    kept = np.asarray(dropout_mask(jax.random.key(11), rate, shape))
    n = kept[0, 0].size
    sigma = np.sqrt(rate * (1 - rate) / n)
    fractions = kept.mean(axis=(2, 3))
    assert np.all(np.abs(fractions - (1 - rate)) < 5 * sigma), fractions
    # two heads' (or batches') masks agree where independent draws would: (1-r)² + r²
    agree = (1 - rate) ** 2 + rate ** 2
    for a, b in (((0, 0), (0, 1)), ((0, 0), (1, 0)), ((2, 5), (3, 6))):
        same = np.mean(kept[a] == kept[b])
        assert abs(same - agree) < 5 * np.sqrt(agree * (1 - agree) / n), (a, b, same)
    # neighbouring rows and keys are not correlated either
    assert abs(np.mean(kept[0, 0, 1:] == kept[0, 0, :-1]) - agree) < 0.02
    assert abs(np.mean(kept[0, 0, :, 1:] == kept[0, 0, :, :-1]) - agree) < 0.02
    # a row's word and a key's word are combined per weight: the four corners of rectangles
    # (two rows, two keys) are independent too, their xor odd at independent draws' rate
    i, i2, j, j2 = np.random.default_rng(0).integers(0, 256, (4, 20000))
    apart = (i != i2) & (j != j2)
    tile = kept[1, 2].astype(np.int8)
    odd = np.mean((tile[i, j] ^ tile[i, j2] ^ tile[i2, j] ^ tile[i2, j2])[apart])
    want = (1 - (1 - 2 * rate) ** 4) / 2
    assert abs(odd - want) < 5 * np.sqrt(want * (1 - want) / apart.sum()), (odd, want)


@pytest.mark.parametrize("shared", [False, True])
def test_word_tables_give_the_same_mask(shared):
    """The row and key words the Mosaic kernels load (`word_tables`) make the mask `kept`
    hashes from positions."""
    from jattn._src.attention import dropout

    shape = (2, 3, 40, 56)
    key = jax.random.key(5)
    problem = types.SimpleNamespace(B=2, Hq=3, L=40, S=56, dropout=0.3, dropout_shared=shared)
    rows, columns = dropout.word_tables(problem, dropout.checked_dropout("test", 0.3, key).seed)
    kept = dropout.kept_from_words(problem, rows[..., :, None], columns[..., None, :])
    np.testing.assert_array_equal(jnp.broadcast_to(kept, shape),
                                  dropout_mask(key, 0.3, shape, shared=shared))


def test_a_shared_mask_is_every_batch_and_heads():
    kept = np.asarray(dropout_mask(jax.random.key(2), 0.4, (3, 4, 64, 64), shared=True))
    assert np.all(kept == kept[:1, :1])


def test_the_expectation_over_keys_is_attention_without_dropout():
    """Mean over 200 keys (one program: the key is an argument) against no dropout, each
    element within 5 standard errors of the keys' spread."""
    rng = np.random.default_rng(5)
    q, k, v = (random(rng, (1, 2, 32, 8)) for _ in range(3))
    run = jax.jit(lambda key: jattn.flex_attention(q, k, v, implementation="xla",
                                                   dropout_rate=0.4, dropout_key=key))
    outs = np.stack([run(key) for key in jax.random.split(jax.random.key(0), 200)])
    assert run._cache_size() == 1
    exact = np.asarray(jattn.flex_attention(q, k, v, implementation="xla"))
    error = np.abs(outs.mean(axis=0) - exact)
    assert np.all(error < 5 * outs.std(axis=0) / np.sqrt(len(outs)) + 1e-6), error.max()


def test_bad_dropout_arguments_raise_naming_them():
    x = jnp.ones((1, 1, 16, 8))
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"`dropout_rate` must be in \[0, 1\), got 1.0"):
        jattn.flex_attention(x, x, x, dropout_rate=1.0, dropout_key=key)
    with pytest.raises(ValueError, match=r"`dropout_rate` must be in \[0, 1\), got -0.1"):
        jattn.flex_attention(x, x, x, dropout_rate=-0.1, dropout_key=key)
    with pytest.raises(ValueError, match="needs a `dropout_key`"):
        jattn.flex_attention(x, x, x, dropout_rate=0.1)
    with pytest.raises(TypeError, match="`dropout_key` must be one JAX PRNG key"):
        jattn.flex_attention(x, x, x, dropout_rate=0.1, dropout_key=jax.random.split(key))
    with pytest.raises(TypeError, match="`dropout_rate` must be a Python float, but a traced"):
        jax.jit(lambda r: jattn.flex_attention(x, x, x, dropout_rate=r, dropout_key=key))(0.1)
    # rate 0 draws nothing: no key needed
    np.testing.assert_array_equal(jattn.flex_attention(x, x, x, dropout_rate=0.0),
                                  jattn.flex_attention(x, x, x))


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_forward_mode_through_dropout(impl):
    rng = np.random.default_rng(2)
    q, k, v, dq, dk, dv = (random(rng, (1, 2, 32, 8)) for _ in range(6))
    key = jax.random.key(9)
    kept = dropout_mask(key, RATE, (1, 2, 32, 32))
    _, ours = jax.jvp(lambda q, k, v: jattn.flex_attention(
        q, k, v, implementation=impl, dropout_rate=RATE, dropout_key=key), (q, k, v),
        (dq, dk, dv))
    _, expected = jax.jvp(lambda q, k, v: attention_reference(q, k, v, dropout=(kept, RATE))[0],
                          (q, k, v), (dq, dk, dv))
    np.testing.assert_allclose(ours, expected, atol=2e-5, rtol=2e-5)


class DropoutBackendTests:
    """What every `flex_attention` backend must do with dropout: each backend's class below names
    it, and a new backend is one more class."""

    implementation: str

    def test_output_lse_and_gradients_match_a_float64_reference_with_the_same_mask(self):
        impl = self.implementation
        rng = np.random.default_rng(0)
        q = random(rng, (B, Hq, L, E))
        k, v = (random(rng, (B, Hkv, S, E)) for _ in range(2))
        key = jax.random.key(7)
        block_mask = jattn.create_block_mask(_window, None, None, L, S, block_size=16)
        kept = dropout_mask(key, RATE, (B, Hq, L, S))

        def ours(q, k, v):
            return jattn.flex_attention(q, k, v, _tilt, block_mask, enable_gqa=True,
                                        return_lse=True, implementation=impl, dropout_rate=RATE,
                                        dropout_key=key)

        def reference(q, k, v):
            return attention_reference(q, k, v, _tilt, block_mask, dropout=(kept, RATE))

        out, lse = jax.jit(ours)(q, k, v)
        gold_out, gold_lse = golden(reference, q, k, v)
        low_out, low_lse = low_precision(reference, q, k, v)
        assert_close(out, gold_out, low_out, what="out")
        assert_close(lse, gold_lse, low_lse, what="lse")
        cotangent = (random(rng, out.shape, out.dtype), random(rng, lse.shape, jnp.float32))
        assert_gradients_close(ours, reference, (q, k, v), cotangent, "qkv")


class TestXla(DropoutBackendTests):
    implementation = "xla"


class TestInterpret(DropoutBackendTests):
    implementation = "interpret"


@pytest.mark.gpu
class TestPallasTriton(DropoutBackendTests):
    implementation = "pallas_triton"
