"""jattn.flax_dot_product_attention as a Flax NNX MultiHeadAttention's attention_fn, against
the same layer with Flax's own: outputs and random-cotangent parameter gradients, any number
of batch axes, Flax's float 0/1 masks, dropout in training; what jattn does not do (sown
weights) raises."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn

# in the test extra (CI has it); a GPU machine running only `-m gpu` tests may not
nnx = pytest.importorskip("flax.nnx")


def _layer(attention_fn):
    return nnx.MultiHeadAttention(num_heads=4, in_features=16, qkv_features=32, decode=False,
                                  attention_fn=attention_fn, rngs=nnx.Rngs(0))


def _padding_mask(lengths, T):
    keep = jnp.arange(T) < lengths[..., None]
    return nnx.combine_masks(nnx.make_causal_mask(keep), nnx.make_attention_mask(keep, keep))


def test_multi_head_attention_matches_flax():
    batch, T = (2, 2), 40
    x = jax.random.normal(jax.random.key(len(batch)), (*batch, T, 16))
    lengths = jnp.array([[T, T - 13], [T - 5, T]])
    mask = _padding_mask(lengths, T)  # float32 0/1, [batch..., 1, T, T]
    cotangent = jax.random.normal(jax.random.key(9), (*batch, T, 16))

    def run(layer):
        def loss(model):  # a random cotangent's pullback, as a scalar
            return jnp.sum(model(x, mask=mask) * cotangent)
        return layer(x, mask=mask), nnx.state(nnx.grad(loss)(layer))

    (out, grads), (expected, expected_grads) = (
        jax.jit(lambda: run(_layer(fn)))() for fn in (jattn.flax_dot_product_attention,
                                                      nnx.dot_product_attention))
    # padded queries attend to no key: the values' mean, as in Flax
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-4)


def test_no_batch_axes_bias_dtype_and_evaluation_mode():
    """[T, N, H] arrays (no batch axis), a bias [N, T, S], bfloat16 compute (Flax's dtype),
    and dropout settings that apply no dropout (deterministic, as in model.eval())."""
    q, k, v = (jax.random.normal(key, (24, 2, 8)) for key in jax.random.split(
        jax.random.key(1), 3))
    bias = 0.3 * jax.random.normal(jax.random.key(2), (2, 24, 24))
    expected = nnx.dot_product_attention(q, k, v, bias, dtype=jnp.bfloat16)
    out = jax.jit(lambda q, k, v, bias: jattn.flax_dot_product_attention(
        q, k, v, bias, dtype=jnp.bfloat16, dropout_rate=0.1, deterministic=True,
        dropout_rng=jax.random.key(3)))(q, k, v, bias)
    assert out.dtype == jnp.bfloat16 and out.shape == expected.shape
    np.testing.assert_allclose(out.astype(np.float32), expected.astype(np.float32), atol=3e-2)


def test_dropout_applies_in_training_and_not_in_evaluation():
    """A layer trained a step with dropout (Flax's broadcast_dropout: one mask for every batch
    and head), then evaluated: deterministic=True is Flax's own attention."""
    x = jax.random.normal(jax.random.key(4), (2, 24, 16))
    layer = nnx.MultiHeadAttention(num_heads=4, in_features=16, qkv_features=32, decode=False,
                                   dropout_rate=0.5, attention_fn=jattn.flax_dot_product_attention,
                                   rngs=nnx.Rngs(0, dropout=1))
    flax_layer = nnx.clone(layer)
    flax_layer.attention_fn = nnx.dot_product_attention

    def loss(model):
        return jnp.sum(model(x, deterministic=False) ** 2)

    first = layer(x, deterministic=False)
    assert not np.allclose(first, layer(x, deterministic=False))  # a new key each call
    grads = nnx.grad(loss)(layer)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(nnx.state(grads)))
    np.testing.assert_allclose(layer(x, deterministic=True),
                               flax_layer(x, deterministic=True), atol=2e-5, rtol=2e-5)
    # the same key as a function: batches and heads share the mask with broadcast_dropout
    q = jnp.broadcast_to(jax.random.normal(jax.random.key(5), (1, 16, 1, 8)), (2, 16, 3, 8))
    out = jattn.flax_dot_product_attention(q, q, q, dropout_rate=0.5,
                                           dropout_rng=jax.random.key(6))
    np.testing.assert_allclose(out, jnp.broadcast_to(out[:1, :, :1], out.shape), rtol=1e-6)
    own = jattn.flax_dot_product_attention(q, q, q, dropout_rate=0.5, broadcast_dropout=False,
                                           dropout_rng=jax.random.key(6))
    assert not np.allclose(own[0, :, 0], own[1, :, 1])


def test_what_jattn_does_not_do_raises_naming_the_fix():
    x = jnp.ones((1, 16, 2, 8))
    with pytest.raises(ValueError, match="needs a `dropout_rng`"):
        jattn.flax_dot_product_attention(x, x, x, dropout_rate=0.1)
    with pytest.raises(NotImplementedError, match="sow_weights"):
        _layer(jattn.flax_dot_product_attention)(jnp.ones((1, 16, 16)), sow_weights=True)
    with pytest.raises(ValueError, match=r"`dropout_rate` must be in \[0, 1\)"):
        jattn.flax_dot_product_attention(x, x, x, dropout_rate=1.0, deterministic=True)
    with pytest.raises(ValueError, match=r"`mask` must be broadcastable to \[batch..., N, T, S\]"
                                         r" = \[1, 2, 16, 16\]; got shape \(1, 3, 16, 16\)"):
        jattn.flax_dot_product_attention(x, x, x, mask=jnp.ones((1, 3, 16, 16), bool))
