"""jattn.dot_product_attention against jax.nn.dot_product_attention itself: the same
arguments, the same results (outputs, residual LSE, gradients of q, k, v and the bias), rows
that attend to no key included (the values' mean, or 0 past a query length; only their LSE
differs: -inf here, a large negative number there)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn

B, T, S, N, K, H = 2, 48, 80, 4, 2, 16


def _inputs(seed):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, T, N, H))
    k, v = (jax.random.normal(key, (B, S, K, H)) for key in keys[1:3])
    bias = 0.5 * jax.random.normal(keys[3], (1, N, T, S))
    return q, k, v, bias


CASES = {
    "plain": {},
    "causal, window": dict(is_causal=True, local_window_size=(20, 0)),
    "lengths": dict(query_seq_lengths=jnp.array([T, 30]),
                    key_value_seq_lengths=jnp.array([50, S])),
    "bias and mask": dict(with_bias=True, mask=jnp.arange(S)[None, None, None, :] % 3 != 1),
    "symmetric window, scale": dict(local_window_size=10, scale=0.3),
    "NumPy window": dict(local_window_size=(np.int64(12), np.int32(3))),
    "2-D bias and mask": dict(with_bias=True, bias_axes=2,
                              mask=jnp.arange(S)[None, :] % 4 != 2),
    "rows masked everywhere": dict(mask=jnp.arange(T)[:, None] % 5 != 0,
                                   query_seq_lengths=jnp.array([T, 30]),
                                   key_value_seq_lengths=jnp.array([S, 0])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_gradients_equal_jax_nn(case):
    options = dict(CASES[case])
    q, k, v, bias = _inputs(len(case))
    bias = bias if options.pop("with_bias", False) else None
    if options.pop("bias_axes", 4) == 2:
        bias = bias[0, 0]  # [T, S], as jax.nn takes it

    def ours(q, k, v, bias):
        return jattn.dot_product_attention(q, k, v, bias, return_residual=True,
                                           implementation="xla", block_size=16, **options)

    def theirs(q, k, v, bias):
        return jax.nn.dot_product_attention(q, k, v, bias, return_residual=True, **options)

    (out, lse), vjp = jax.vjp(jax.jit(ours), q, k, v, bias)  # (jitted: op by op is slow)
    (expected, expected_lse), expected_vjp = jax.vjp(jax.jit(theirs), q, k, v, bias)
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
    attends = jnp.isfinite(lse)
    np.testing.assert_allclose(jnp.where(attends, lse, 0), jnp.where(attends, expected_lse, 0),
                               atol=2e-5, rtol=2e-5)
    cotangent = jax.random.normal(jax.random.key(7), out.shape)
    grads = vjp((cotangent, jnp.zeros_like(lse)))
    expected_grads = expected_vjp((cotangent, jnp.zeros_like(expected_lse)))
    for name, g, e in zip(["dq", "dk", "dv", "dbias"], grads, expected_grads):
        if e is not None:
            np.testing.assert_allclose(g, e, atol=5e-5, rtol=5e-5, err_msg=name)


def test_unbatched_arrays_and_jit():
    q, k, v, _ = _inputs(9)
    out = jax.jit(lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True))(
        q[0], k[0], v[0])
    expected = jax.nn.dot_product_attention(q[0], k[0], v[0], is_causal=True)
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)


def test_bad_arguments_name_the_argument():
    q, k, v, bias = _inputs(10)
    with pytest.raises(ValueError, match=r"`bias` must have at most 4 axes .* got shape "
                                         r"\(3, 4, 48, 80\)"):
        jattn.dot_product_attention(q, k, v, jnp.zeros((3, N, T, S)))
    with pytest.raises(TypeError, match="`mask` must be bool"):
        jattn.dot_product_attention(q, k, v, mask=jnp.zeros((1, 1, T, S)))
    with pytest.raises(ValueError, match=r"`query_seq_lengths` must be an int array of shape "
                                         r"\(2,\)"):
        jattn.dot_product_attention(q, k, v, query_seq_lengths=jnp.array([3]))
    with pytest.raises(ValueError, match="`local_window_size` must be"):
        jattn.dot_product_attention(q, k, v, local_window_size=(-1, 2))
    with pytest.raises(ValueError, match="`local_window_size` must be"):
        jattn.dot_product_attention(q, k, v, local_window_size=2.5)
    with pytest.raises(TypeError, match="dot_product_attention: query, key and value must "
                                        "share a dtype"):
        jattn.dot_product_attention(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(ValueError, match="implementation='cudnn' names jax.nn's"):
        jattn.dot_product_attention(q, k, v, implementation="cudnn")
