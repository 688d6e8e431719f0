"""The flex decoding kernel lowers to Triton for CUDA, checked on any machine (no GPU needed)."""

import jax
import jax.numpy as jnp
import pytest

import jattn
from jattn._src import hardware
from jattn._src.decoding.api import flex_decode
from jattn._src.decoding.paged import PagedKVCache
from tests.helpers import lower_for_cuda


@pytest.fixture
def as_if_on_gpu(monkeypatch):
    """Selects the Pallas-Triton path without a GPU (only lowering runs, nothing executes)."""
    monkeypatch.setattr(hardware, "has_cuda", lambda: True)


def _spec(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_contiguous_gqa_decode_lowers(as_if_on_gpu):
    """Issue 5's benchmark shape: Hq 32, Hkv 8, D 128, bf16, per-batch lengths."""
    def decode(q, k, v, kv_len):
        return flex_decode(q, k, v, kv_len=kv_len, return_lse=True,
                           implementation="pallas_triton")

    args = (_spec(2, 32, 1, 128), _spec(2, 8, 4096, 128), _spec(2, 8, 4096, 128),
            _spec(2, dtype=jnp.int32))
    text = lower_for_cuda(decode, *args)
    assert "jattn_flex_decode" in text and "jattn_flex_decode_combine" in text


def test_paged_masked_decode_with_mods_lowers(as_if_on_gpu):
    """Paged, causal & document BlockMask (int array lookup), alibi, E=80 (padded), Lq 4."""
    S = 4096
    segments = jnp.zeros((S,), jnp.int32)
    mask = jattn.masks.and_masks(jattn.masks.causal_mask, jattn.masks.document_mask(segments))
    block_mask = jattn.create_block_mask(mask, None, None, S, S)
    slopes = jattn.mods.alibi_slopes(16)

    def decode(q, k_pages, v_pages, table, kv_len):
        cache = PagedKVCache(k_pages, v_pages, table)
        return flex_decode(q, cache, None, jattn.mods.alibi(slopes), block_mask, kv_len=kv_len,
                           implementation="pallas_triton")

    args = (_spec(2, 16, 4, 80), _spec(4, 100, 128, 80), _spec(4, 100, 128, 80),
            _spec(2, 32, dtype=jnp.int32), _spec(2, dtype=jnp.int32))
    assert "jattn_flex_decode" in lower_for_cuda(decode, *args)


def test_per_head_mask_and_relative_bias_lower(as_if_on_gpu):
    """A per-head BlockMask (one program per query head), a 255-wide captured table, f16."""
    S, H = 1024, 8
    block_mask = jattn.create_block_mask(jattn.masks.sliding_window(300), None, H, S, S)
    table = jnp.zeros((H, 255))

    def decode(q, k, v):
        return flex_decode(q, k, v, jattn.mods.relative_position_bias(table), block_mask,
                           implementation="pallas_triton")

    args = (_spec(1, H, 2, 64, dtype=jnp.float16), *[_spec(1, 2, S, 64, dtype=jnp.float16)] * 2)
    assert "jattn_flex_decode" in lower_for_cuda(decode, *args)


def test_long_query_fallback_lowers(as_if_on_gpu):
    """Lq > 16 runs the flex attention kernel with the decode score_mod (table lookups)."""
    S = 1024
    block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, S, S)

    def decode(q, k, v, kv_len):
        return flex_decode(q, k, v, block_mask=block_mask, kv_len=kv_len,
                           implementation="pallas_triton")

    args = (_spec(2, 8, 32, 128), _spec(2, 2, S, 128), _spec(2, 2, S, 128),
            _spec(2, dtype=jnp.int32))
    assert "jattn_flex_fwd" in lower_for_cuda(decode, *args)
