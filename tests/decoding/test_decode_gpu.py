"""The decode kernel on the GPU at the benchmark's head shape with its default configs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.decoding.api import flex_decode
from jattn._src.decoding.paged import PagedKVCache
from tests.decoding.helpers import check, inputs, random_page_table

pytestmark = pytest.mark.gpu

B, HQ, HKV, S, E = 3, 32, 8, 4096, 128
LENGTHS = [4096, 2999, 1]


@pytest.mark.parametrize("Lq,mask,dtype", [
    (1, None, jnp.bfloat16),
    (4, "causal", jnp.bfloat16),    # mask rows straddled by the queries of sequence 1
    (1, "sliding", jnp.float16),
    (2, None, jnp.float32),
])
def test_default_configs_match_golden(Lq, mask, dtype):
    rng = np.random.default_rng(Lq)
    q, k, v = inputs(rng, B, HQ, HKV, Lq, S, E, dtype=dtype)
    mask_mod = {None: None, "causal": jattn.masks.causal_mask,
                "sliding": jattn.masks.sliding_window(1000)}[mask]
    block_mask = None if mask_mod is None else jattn.create_block_mask(mask_mod, None, None,
                                                                        S, S)
    score_mod = None if mask is None else jattn.mods.alibi(jattn.mods.alibi_slopes(HQ))
    check("pallas_triton", q, k, v, score_mod, block_mask, kv_len=jnp.asarray(LENGTHS),
          config=None)


def test_compiled_by_triton_matches_golden():
    """The kernel's Triton IR compiled by the `triton` package (DecodeConfig.compiler)."""
    pytest.importorskip("triton")
    q, k, v = inputs(np.random.default_rng(5), B, HQ, HKV, 4, S, E, dtype=jnp.bfloat16)
    block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, S, S)
    check("pallas_triton", q, k, v, jattn.mods.softcap(20.0), block_mask,
          kv_len=jnp.asarray(LENGTHS), config=jattn.DecodeConfig(compiler="triton"))


def test_paged_equals_contiguous_bitwise_on_gpu():
    rng = np.random.default_rng(0)
    page = 64
    q, k, v = inputs(rng, B, HQ, HKV, 1, S, E, dtype=jnp.bfloat16)
    pages = S // page
    table = random_page_table(rng, B, pages, B * pages + 7)
    pools = [jnp.zeros((HKV, B * pages + 7, page, E), jnp.bfloat16) for _ in range(2)]
    for b in range(B):  # sequence b's page j holds its positions j*page .. (j+1)*page - 1
        pools = [pool.at[:, table[b]].set(x[b].reshape(HKV, pages, page, E))
                 for pool, x in zip(pools, (k, v))]
    cache = PagedKVCache(*pools, jnp.asarray(table))
    block_mask = jattn.create_block_mask(jattn.masks.sliding_window(700), None, None, S, S)
    run = functools.partial(flex_decode, score_mod=jattn.mods.softcap(20.0),
                            block_mask=block_mask, kv_len=jnp.asarray(LENGTHS), return_lse=True)
    paged = jax.jit(lambda q, c: run(q, c, None))(q, cache)
    contiguous = jax.jit(run)(q, k, v)
    for x, y in zip(paged, contiguous):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_grad_raises_on_gpu():
    q, k, v = inputs(np.random.default_rng(1), 1, 8, 2, 1, 256, 64, dtype=jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="flex_decode has no gradient"):
        jax.grad(lambda q: flex_decode(q, k, v).astype(jnp.float32).sum())(q)
