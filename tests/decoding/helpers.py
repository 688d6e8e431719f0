"""Shared by the decoding tests: random caches and the check against the float64 golden."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jattn._src.decoding.api import flex_decode
from jattn._src.attention.split_kv_config import DecodeConfig
from jattn._src.decoding.reference import decode_reference
from tests.helpers import assert_close, golden, low_precision, map_reference, random

# Small K/V tiles and mask blocks so that test caches span many tiles, splits and mask rows.
SMALL = DecodeConfig(block_k=16, num_splits=3)
BLOCK = 32


def inputs(rng, B, Hq, Hkv, Lq, S, E, Ev=None, dtype=jnp.float32, kv_batch=None):
    kv_batch = B if kv_batch is None else kv_batch
    Ev = E if Ev is None else Ev
    return (random(rng, (B, Hq, Lq, E), dtype), random(rng, (kv_batch, Hkv, S, E), dtype),
            random(rng, (kv_batch, Hkv, S, Ev), dtype))


def check(impl, q, k, v, score_mod=None, block_mask=None, *, kv_len=None, config=SMALL):
    """flex_decode's output and LSE against the golden decode reference; returns (out, lse)."""
    run = functools.partial(flex_decode, score_mod=score_mod, block_mask=block_mask,
                            return_lse=True, config=config, implementation=impl)
    out, lse = jax.jit(lambda q, k, v, n: run(q, k, v, kv_len=n))(q, k, v, kv_len)
    # Jitted: the eager oracle compiles op by op, seconds per new shape.
    ref = jax.jit(functools.partial(decode_reference, score_mod=score_mod,
                                    block_mask=block_mask, kv_len=kv_len))
    assert_attention_close(out, lse, ref, q, k, v)
    return out, lse


def assert_attention_close(out, lse, reference, *args) -> None:
    """out and natural-log LSE against reference(*args) -> (out, lse) by the tolerance rule
    (float64 golden), the LSE -inf exactly where the golden's is."""
    gold_out, gold_lse = golden(reference, *args)
    low_out, low_lse = low_precision(reference, *args)
    assert_close(out, gold_out, low_out, what="out")
    finite = np.isfinite(gold_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    assert_close(jnp.where(finite, lse, 0), np.where(finite, gold_lse, 0),
                 map_reference(lambda x: jnp.where(finite, x, 0), low_lse), what="lse")


def random_page_table(rng, B: int, max_pages: int, num_pages: int) -> np.ndarray:
    """Each sequence's pages scattered over the pool in random order (distinct pages)."""
    return rng.permutation(num_pages)[:B * max_pages].reshape(B, max_pages).astype(np.int32)
