"""jax.export with a symbolic batch: a model exported once serves every batch size."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jattn

BATCH, = export.symbolic_shape("batch")


def _exported_matches(fn, *shapes):
    exported = export.export(jax.jit(fn))(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))
    for size in (1, 3):
        args = [jax.random.normal(jax.random.key(i), tuple(size if d is BATCH else d for d in s))
                for i, s in enumerate(shapes)]
        np.testing.assert_allclose(exported.call(*args), fn(*args), rtol=1e-6, atol=1e-6)


def test_flex_attention_and_its_gradient_export_with_a_symbolic_batch():
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 128, 128)
    table = jnp.linspace(0.0, 1.0, 128)

    def attention(q, k, v):  # a score_mod reading an array by position (checked for bounds)
        return jattn.flex_attention(q, k, v, lambda s, b, h, q_idx, kv_idx: s + table[kv_idx],
                                    block_mask=mask)

    shape = (BATCH, 2, 128, 32)
    _exported_matches(attention, shape, shape, shape)
    _exported_matches(lambda q, k, v: jax.grad(lambda q: attention(q, k, v).sum())(q),
                      shape, shape, shape)


def test_decoding_and_batched_products_export_with_a_symbolic_batch():
    _exported_matches(jattn.flex_decode, (BATCH, 4, 1, 32), (BATCH, 2, 256, 32),
                      (BATCH, 2, 256, 32))
    _exported_matches(jattn.bmm, (BATCH, 64, 32), (BATCH, 32, 48))
    _exported_matches(jattn.matmul, (BATCH, 64, 32), (32, 48))


def test_a_symbolic_length_raises_naming_the_dims():
    length, = export.symbolic_shape("length")
    shape = jax.ShapeDtypeStruct((1, 2, length, 32), jnp.float32)
    with pytest.raises(ValueError, match="only the batch dim may be symbolic"):
        export.export(jax.jit(jattn.flex_attention))(shape, shape, shape)
