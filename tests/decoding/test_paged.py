"""PagedKVCache: paged decoding equals contiguous bit for bit; assign; bad tables; masks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.decoding.api import flex_decode
from jattn._src.decoding.paged import PagedKVCache
from tests.decoding.helpers import SMALL, inputs, random_page_table
from tests.helpers import random

PAGE = 32


def _cache_like(rng, k, v, kv_len, num_pages):
    """A cache holding k/v's first kv_len[b] positions of each sequence on scattered pages
    (built with numpy: `assign` has its own test); pages past a length stay unassigned."""
    B, Hkv, S, _ = k.shape
    table = random_page_table(rng, B, S // PAGE, num_pages)
    pools = [np.zeros((Hkv, num_pages, PAGE, x.shape[-1]), x.dtype) for x in (k, v)]
    for b, length in enumerate(kv_len):
        table[b, -(-length // PAGE):] = -1
        for j in range(-(-length // PAGE)):
            for pool, x in zip(pools, (k, v)):
                pool[:, table[b, j]] = np.asarray(x[b, :, j * PAGE:(j + 1) * PAGE])
    return PagedKVCache(jnp.asarray(pools[0]), jnp.asarray(pools[1]), jnp.asarray(table))


def test_assign_writes_through_the_page_table():
    rng = np.random.default_rng(1)
    cache = PagedKVCache.create(8, 4, 2, 8, [[3, 5, -1], [0, 7, 1]], dtype=jnp.float32)
    prompt_k, prompt_v = random(rng, (2, 2, 6, 8)), random(rng, (2, 2, 6, 8))
    token_k, token_v = random(rng, (2, 2, 1, 8)), random(rng, (2, 2, 1, 8))
    cache = cache.assign(prompt_k, prompt_v, [0, 0])
    by_start = cache.assign(token_k, token_v, jnp.asarray([6, 6]))
    by_position = cache.assign(token_k, token_v, jnp.asarray([[6], [6]]))
    k, v = by_start.to_contiguous()
    np.testing.assert_array_equal(k[:, :, :7], jnp.concatenate([prompt_k, token_k], axis=2))
    np.testing.assert_array_equal(v[:, :, :7], jnp.concatenate([prompt_v, token_v], axis=2))
    np.testing.assert_array_equal(by_position.k_pages, by_start.k_pages)
    np.testing.assert_array_equal(k[0, :, 8:], 0)  # unassigned page reads as zeros
    np.testing.assert_array_equal(cache.k_pages[:, 5, 1], prompt_k[0, :, 5])  # page 5, slot 1


def test_donating_the_cache_leaves_the_callers_page_table():
    table = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    cache = PagedKVCache.create(4, 4, 1, 8, table, dtype=jnp.float32)
    step = jax.jit(lambda cache, k: cache.assign(k, k, jnp.zeros(2, jnp.int32)),
                   donate_argnums=0)
    step(cache, jnp.ones((2, 1, 1, 8), jnp.float32))
    np.testing.assert_array_equal(table, [[0, 1], [2, 3]])  # not deleted with the cache


def test_bad_writes_raise_or_are_dropped():
    rng = np.random.default_rng(2)
    cache = PagedKVCache.create(8, 4, 2, 8, [[3, 5, -1], [0, 7, 1]], dtype=jnp.float32)
    k, v = random(rng, (2, 2, 1, 8)), random(rng, (2, 2, 1, 8))
    with pytest.raises(ValueError, match="token 0 of sequence 0 goes to position 8"):
        cache.assign(k, v, [8, 0])                  # page 2 of sequence 0 is unassigned
    with pytest.raises(ValueError, match="position 12, outside the capacity 12"):
        cache.assign(k, v, [0, 12])
    with pytest.raises(ValueError, match="must be \\[Bn, 2, Ln, dim\\]"):
        cache.assign(k[:, :1], v[:, :1], [0, 0])
    written = jax.jit(lambda c, p: c.assign(k, v, p))(cache, jnp.asarray([8, 12]))
    np.testing.assert_array_equal(written.k_pages, cache.k_pages)  # both dropped
    written = jax.jit(lambda c, p: c.assign(k, v, p))(cache, jnp.asarray([8, 5]))
    np.testing.assert_array_equal(written.k_pages[:, 7, 1], k[1, :, 0])
    np.testing.assert_array_equal(written.k_pages.sum(), k[1].sum())


@pytest.mark.parametrize("impl", ["interpret", pytest.param("pallas_triton",
                                                             marks=pytest.mark.gpu)])
def test_page_tables_outside_the_pool(impl):
    rng = np.random.default_rng(3)
    with pytest.raises(ValueError, match="page_table\\[1, 0\\] = 8 is outside the pool of 8"):
        PagedKVCache.create(8, 32, 2, 16, [[0, 1], [8, 2]], dtype=jnp.float32)
    q = random(rng, (2, 4, 1, 16))
    cache = PagedKVCache.create(8, 32, 2, 16, [[0, 1], [2, -1]], dtype=jnp.float32)
    with pytest.raises(ValueError, match="kv_len\\[1\\] = 40 .* unassigned"):
        flex_decode(q, jax.device_put(cache, jax.devices("cpu")[0]), None,  # host values
                    kv_len=np.asarray([64, 40]), implementation="interpret")
    if jax.default_backend() != "cpu":  # not read back (the host would wait): NaN rows
        on_device = flex_decode(q, cache, None, kv_len=jnp.asarray([64, 40]),
                                implementation=impl)
        assert np.isnan(np.asarray(on_device[1])).all()
    with pytest.raises(ValueError, match="pass v=None"):
        flex_decode(q, cache, cache.v_pages, implementation=impl)
    # Under jit the table cannot be checked: a sequence that reads a page outside the pool
    # comes out NaN (the kernel clamps its reads into the pool); the others are unaffected.
    run = jax.jit(lambda c: flex_decode(q, c, None, kv_len=jnp.asarray([64, 32]), config=SMALL,
                                        implementation=impl))
    bad = run(PagedKVCache(cache.k_pages, cache.v_pages, jnp.asarray([[0, 99], [2, -1]])))
    assert np.isnan(np.asarray(bad[0])).all()
    np.testing.assert_array_equal(bad[1], run(cache)[1])


def test_converted_block_mask_attends_like_the_logical_one():
    """flex_attention over the physical pool with the converted mask and score_mod equals
    flex_attention over the logical (contiguous) cache."""
    rng = np.random.default_rng(4)
    B, H, S, E = 2, 2, 96, 16
    q, k, v = inputs(rng, B, H, H, S, S, E)
    cache = _cache_like(rng, k, v, [96, 50], num_pages=8)
    segments = jnp.asarray(np.arange(S) // 40, jnp.int32)
    mask_mod = jattn.masks.and_masks(jattn.masks.causal_mask,
                                     jattn.masks.document_mask(segments))
    score_mod = jattn.mods.alibi(jattn.mods.alibi_slopes(H))
    lengths = jnp.asarray([96, 50])

    def upto_length(b, h, q_idx, kv_idx):  # sequence 1 holds 50 positions
        return kv_idx < lengths[b]

    logical = jattn.create_block_mask(jattn.masks.and_masks(mask_mod, upto_length), B, None,
                                      S, S, block_size=16)
    physical = cache.convert_logical_block_mask(logical)
    assert physical.shape == (B, 1, S, 8 * PAGE)
    expected = jax.jit(lambda q, k, v: jattn.flex_attention(
        q, k, v, score_mod, logical, implementation="xla"))(q, k, v)
    got = jax.jit(lambda q, cache: jattn.flex_attention(
        q, *cache.as_sequence(), cache.convert_score_mod(score_mod), physical,
        implementation="xla"))(q, cache)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


class PagedDecodeBackendTests:
    """What every `flex_decode` backend must do with a page table: each backend's class below names
    it, and a new backend is one more class."""

    implementation: str

    def test_paged_equals_contiguous_bitwise(self):
        impl = self.implementation
        rng = np.random.default_rng(0)
        B, Hq, Hkv, Lq, S, E = 3, 8, 2, 4, 160, 16
        q, k, v = inputs(rng, B, Hq, Hkv, Lq, S, E)
        kv_len = [160, 70, 3]
        cache = _cache_like(rng, k, v, kv_len, num_pages=20)
        lengths = jnp.asarray(kv_len)
        np.testing.assert_array_equal(cache.to_contiguous()[0][0], k[0])
        block_mask = jattn.create_block_mask(jattn.masks.sliding_window(50), None, None, S, S,
                                             block_size=PAGE)
        for score_mod, mask in ((None, None), (jattn.mods.alibi(jattn.mods.alibi_slopes(Hq)),
                                               block_mask)):
            run = functools.partial(flex_decode, score_mod=score_mod, block_mask=mask,
                                    kv_len=lengths, return_lse=True, config=SMALL,
                                    implementation=impl)
            paged = jax.jit(lambda q, cache: run(q, cache, None))(q, cache)
            contiguous = jax.jit(run)(q, k, v)
            for x, y in zip(paged, contiguous):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class TestXla(PagedDecodeBackendTests):
    implementation = "xla"


class TestInterpret(PagedDecodeBackendTests):
    implementation = "interpret"


@pytest.mark.gpu
class TestPallasTriton(PagedDecodeBackendTests):
    implementation = "pallas_triton"
