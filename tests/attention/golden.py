"""flex_attention's output, LSE and random-cotangent gradients against the float64 golden."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn._src.attention import dropout
from jattn._src.attention.reference import attention_reference
from tests.helpers import (assert_close, golden, low_precision, map_reference, random,
                           random_cotangent_vjp)


def dropout_mask(key, rate, shape, shared=False):
    """The dropout mask [B, H, L, S] the implementations draw for `key`."""
    problem = types.SimpleNamespace(Hq=shape[1], dropout=rate, dropout_shared=shared)
    seed = dropout.checked_dropout("test", rate, key).seed
    b, h, q_idx, kv_idx = (jnp.arange(n, dtype=jnp.int32).reshape(
        [-1 if i == axis else 1 for i in range(4)]) for axis, n in enumerate(shape))
    return jnp.broadcast_to(dropout.kept(problem, seed[0], seed[1], b, h, q_idx, kv_idx), shape)


def check_against_golden(impl, q, k, v, score_mod=None, block_mask=None, *, grads=True,
                         seed=0, config=None, deterministic=True, dropout_rate=0.0,
                         dropout_key=None):
    """Output, LSE and random-cotangent gradients (q, k, v) against the golden; with
    dropout_rate, the golden drops the weights the implementations drop for dropout_key."""
    run = functools.partial(jattn.flex_attention, score_mod=score_mod, block_mask=block_mask,
                            enable_gqa=True, return_lse=True, config=config, implementation=impl,
                            deterministic=deterministic, dropout_rate=dropout_rate,
                            dropout_key=dropout_key)
    dropped = None
    if dropout_rate:
        shape = (*q.shape[:3], k.shape[2])
        dropped = (dropout_mask(dropout_key, dropout_rate, shape), dropout_rate)
    ref = functools.partial(attention_reference, score_mod=score_mod, block_mask=block_mask,
                            dropout=dropped)
    out, lse = jax.jit(run)(q, k, v)
    gold_out, gold_lse = golden(ref, q, k, v)
    low_out, low_lse = low_precision(ref, q, k, v)
    assert_close(out, gold_out, low_out, what="out")
    finite = np.isfinite(gold_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    assert_close(jnp.where(finite, lse, 0), np.where(finite, gold_lse, 0),
                 map_reference(lambda x: jnp.where(finite, x, 0), low_lse), what="lse")
    if not grads:
        return
    rng = np.random.default_rng(seed)
    cotangent = (random(rng, out.shape, out.dtype), random(rng, lse.shape, jnp.float32))
    ours = jax.jit(lambda *x: random_cotangent_vjp(run, x, cotangent))(q, k, v)
    gold = golden(lambda q, k, v, c: random_cotangent_vjp(ref, (q, k, v), c), q, k, v, cotangent)
    low = low_precision(lambda q, k, v, c: random_cotangent_vjp(ref, (q, k, v), c), q, k, v,
                        cotangent)
    for name, g, g64, g_low in zip("qkv", ours, gold, low):
        assert_close(g, g64, g_low, what=f"d{name}")
