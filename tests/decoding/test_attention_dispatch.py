"""flex_attention with a few queries runs its forward on the decode kernel; gradients unchanged."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src import hardware
from jattn._src.attention.reference import attention_reference
from tests.decoding.helpers import inputs
from tests.helpers import (assert_close, golden, low_precision, lower_for_cuda,
                           random, random_cotangent_vjp)


@pytest.mark.parametrize("impl,masked", [("interpret", True), *[
    pytest.param("pallas_triton", masked, marks=pytest.mark.gpu) for masked in (False, True)]])
def test_few_queries_match_golden_with_gradients(impl, masked):
    rng = np.random.default_rng(int(masked))
    L, S = 3, 100
    q, k, v = inputs(rng, 2, 4, 2, L, S, 16)
    block_mask = None
    if masked:
        block_mask = jattn.create_block_mask(jattn.masks.sliding_window(60), None, None, L, S,
                                             block_size=32)
    score_mod = (jattn.mods.alibi(jattn.mods.alibi_slopes(4)) if masked
                 else jattn.mods.softcap(2.0))
    run = functools.partial(jattn.flex_attention, score_mod=score_mod, block_mask=block_mask,
                            enable_gqa=True, implementation=impl)
    ref = functools.partial(attention_reference, score_mod=score_mod, block_mask=block_mask)
    cotangent = random(rng, (2, 4, L, 16))
    out_ref = jax.jit(lambda *x: ref(*x)[0])  # jitted: the eager oracle compiles op by op
    assert_close(jax.jit(run)(q, k, v), golden(out_ref, q, k, v), low_precision(out_ref, q, k, v))
    grads = jax.jit(lambda *x: random_cotangent_vjp(run, x, cotangent))(q, k, v)
    vjp_ref = jax.jit(lambda q, k, v, c: random_cotangent_vjp(out_ref, (q, k, v), c))
    for name, g, g64, g_low in zip("qkv", grads, golden(vjp_ref, q, k, v, cotangent),
                                   low_precision(vjp_ref, q, k, v, cotangent)):
        assert_close(g, g64, g_low, what=f"d{name}")


def test_few_queries_lower_to_the_decode_kernel(monkeypatch):
    monkeypatch.setattr(hardware, "has_cuda", lambda: True)
    spec = jax.ShapeDtypeStruct

    def attention(q, k, v):
        return jattn.flex_attention(q, k, v, enable_gqa=True, implementation="pallas_triton")

    text = lower_for_cuda(attention, spec((2, 32, 1, 128), jnp.bfloat16),
                          *[spec((2, 8, 4096, 128), jnp.bfloat16)] * 2)
    assert "jattn_flex_decode" in text and "jattn_flex_fwd" not in text
