"""jattn.flax_dot_product_attention as a Flax NNX MultiHeadAttention's attention_fn, against
the same layer with Flax's own: outputs and random-cotangent parameter gradients, any number
of batch axes, Flax's float 0/1 masks; what jattn does not do (dropout, sown weights) raises."""

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
    valid = (jnp.arange(T) < lengths[..., None])[..., None]
    cotangent = jax.random.normal(jax.random.key(9), (*batch, T, 16)) * valid

    def run(layer):
        def loss(model):  # a random cotangent's pullback, as a scalar
            return jnp.sum(model(x, mask=mask) * cotangent)
        return layer(x, mask=mask), nnx.state(nnx.grad(loss)(layer))

    (out, grads), (expected, expected_grads) = (
        jax.jit(lambda: run(_layer(fn)))() for fn in (jattn.flax_dot_product_attention,
                                                      nnx.dot_product_attention))
    # padded queries attend to no key: 0 here, the values' mean in Flax
    np.testing.assert_allclose(out * valid, expected * valid, atol=2e-5, rtol=2e-5)
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


def test_what_jattn_does_not_do_raises_naming_the_fix():
    x = jnp.ones((1, 16, 2, 8))
    with pytest.raises(NotImplementedError, match="deterministic=True"):
        jattn.flax_dot_product_attention(x, x, x, dropout_rate=0.1,
                                         dropout_rng=jax.random.key(0))
    with pytest.raises(NotImplementedError, match="sow_weights"):
        _layer(jattn.flax_dot_product_attention)(jnp.ones((1, 16, 16)), sow_weights=True)
    with pytest.raises(ValueError, match=r"`dropout_rate` must be in \[0, 1\)"):
        jattn.flax_dot_product_attention(x, x, x, dropout_rate=1.0, deterministic=True)
    with pytest.raises(ValueError, match=r"`mask` must be broadcastable to \[batch..., N, T, S\]"
                                         r" = \[1, 2, 16, 16\]; got shape \(1, 3, 16, 16\)"):
        jattn.flax_dot_product_attention(x, x, x, mask=jnp.ones((1, 3, 16, 16), bool))
