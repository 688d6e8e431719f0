"""flex_attention's output, LSE and random-cotangent gradients against the float64 golden."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn._src.attention.reference import attention_reference
from tests.helpers import (assert_close, golden, low_precision, map_reference, random,
                           random_cotangent_vjp)


def check_against_golden(impl, q, k, v, score_mod=None, block_mask=None, *, grads=True,
                         seed=0, config=None, deterministic=True):
    """Output, LSE and random-cotangent gradients (q, k, v) against the golden."""
    run = functools.partial(jattn.flex_attention, score_mod=score_mod, block_mask=block_mask,
                            enable_gqa=True, return_lse=True, config=config, implementation=impl,
                            deterministic=deterministic)
    ref = functools.partial(attention_reference, score_mod=score_mod, block_mask=block_mask)
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
