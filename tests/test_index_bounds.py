"""Out-of-range reads of arrays in mods raise where the call's shapes make them certain (the
library's helpers and users' own arrays alike, eagerly and under jit); in-range reads, reads
whose range cannot be decided and explicit clamping do not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.index_bounds import check_reads

SIZES = dict(b=2, h=4, q_idx=64, kv_idx=64)
TABLE = jnp.arange(10.0)
IDS = jnp.zeros(64, jnp.int32)


def _score(index_of, table=TABLE):
    return lambda s, b, h, q_idx, kv_idx: s + table[index_of(b, h, q_idx, kv_idx)]


OUT_OF_RANGE = {
    "past the end": (_score(lambda b, h, q, kv: kv), "reaches 63"),
    "floor division": (_score(lambda b, h, q, kv: kv // 6), "reaches 10"),
    "relative offset": (_score(lambda b, h, q, kv: kv - q + 63, jnp.arange(126.0)),
                        "kv_idx - q_idx \\+ 63, which reaches 126"),
    "absolute offset": (_score(lambda b, h, q, kv: jnp.abs(kv - q), jnp.arange(63.0)),
                        "reaches 63"),
    "second axis": (_score(lambda b, h, q, kv: (h, kv), jnp.ones((4, 63))), "axis 1"),
    "first axis": (_score(lambda b, h, q, kv: (b, kv), jnp.ones((1, 64))), "index b"),
    "an array the mod builds": (lambda s, b, h, q, kv: s + jnp.arange(32.0)[q], "mod builds"),
}

IN_RANGE = {
    "modulo": _score(lambda b, h, q, kv: kv % 10),
    "floor division": _score(lambda b, h, q, kv: kv // 7),
    "minimum": _score(lambda b, h, q, kv: jnp.minimum(kv, 9)),
    "clip of an offset": _score(lambda b, h, q, kv: jnp.clip(kv - q, -4, 5) + 4),
    "negative indices wrap": _score(lambda b, h, q, kv: kv - q, jnp.arange(64.0)),
    "explicit clamping": lambda s, b, h, q, kv: s + TABLE.at[kv].get(mode="clip"),
    "jnp.take fills": lambda s, b, h, q, kv: s + jnp.take(TABLE, kv, fill_value=0.0),
    "undecidable: ids read from an array": _score(lambda b, h, q, kv: IDS[q]),
    "undecidable: a product": _score(lambda b, h, q, kv: (q * kv) % 16 - 6),
    "undecidable: a narrowing cast": _score(lambda b, h, q, kv: (kv * 5).astype(jnp.int8)),
}


@pytest.mark.parametrize("name", OUT_OF_RANGE)
def test_certain_out_of_range_reads_raise(name):
    mod, match = OUT_OF_RANGE[name]
    with pytest.raises(ValueError, match=match):
        check_reads("flex_attention", "score_mod", mod, SIZES)


@pytest.mark.parametrize("name", IN_RANGE)
def test_in_range_and_undecidable_reads_pass(name):
    check_reads("flex_attention", "score_mod", IN_RANGE[name], SIZES)


def test_the_helpers_check_their_arrays_against_the_call():
    q = jnp.ones((1, 4, 64, 16))
    with pytest.raises(ValueError, match=r"`slopes` of jattn.mods.alibi, a float32\[2\] array"
                                         r".*index h, which reaches 3"):
        jattn.flex_attention(q, q, q, jattn.mods.alibi(jnp.ones(2)))
    with pytest.raises(ValueError, match=r"`table` of jattn.mods.relative_position_bias"):
        jattn.flex_attention(q[:, :2], q[:, :2], q[:, :2],
                             jattn.mods.relative_position_bias(jnp.zeros((1, 17))))
    short = jattn.masks.and_masks(jattn.masks.causal_mask,
                                  jattn.masks.document_mask(jnp.zeros(32, jnp.int32)))
    with pytest.raises(ValueError, match=r"create_block_mask: mask_mod jattn.masks.and_masks reads "
                                         r"`segment_ids` of jattn.masks.document_mask"):
        jattn.create_block_mask(short, None, None, 64, 64)
    with pytest.raises(ValueError, match="flex_decode: score_mod jattn.mods.alibi"):
        jattn.flex_decode(q[:, :, :1], q, q, jattn.mods.alibi(jnp.ones(2)))
    out = jattn.flex_attention(q, q, q, jattn.mods.alibi(jnp.ones(4)))  # the right size runs
    assert out.shape == q.shape


def test_under_jit_the_check_runs_at_trace_time():
    q = jnp.ones((1, 2, 64, 16))

    @jax.jit
    def attend(q, ids, slopes):
        mask = jattn.create_block_mask(jattn.masks.document_mask(ids), None, None, 64, 64)
        return jattn.flex_attention(q, q, q, jattn.mods.alibi(slopes), mask)

    assert attend(q, jnp.zeros(64, jnp.int32), jnp.ones(2)).shape == q.shape
    with pytest.raises(ValueError, match="document_mask"):
        attend(q, jnp.zeros(32, jnp.int32), jnp.ones(2))
    with pytest.raises(ValueError, match="alibi"):
        attend(q, jnp.zeros(64, jnp.int32), jnp.ones(1))


def test_decode_checks_query_positions_in_the_cache():
    q, cache = jnp.ones((1, 2, 1, 16)), jnp.ones((1, 2, 64, 16))
    by_position = jnp.arange(64.0)

    def position_bias(s, b, h, q_idx, kv_idx):
        return s + by_position[q_idx]

    assert jattn.flex_decode(q, cache, cache, position_bias).shape == q.shape
    short = jnp.arange(32.0)
    with pytest.raises(ValueError, match="q_idx, which reaches 63"):
        jattn.flex_decode(q, cache, cache, lambda s, b, h, q_idx, kv_idx: s + short[q_idx])
    # with lengths, the positions are theirs: up to 31 here, in range
    jattn.flex_decode(q, cache, cache, lambda s, b, h, q_idx, kv_idx: s + short[q_idx],
                      kv_len=np.asarray([32]))


def test_a_repeated_call_skips_the_analysis(monkeypatch):
    from jattn._src import index_bounds
    q = jnp.ones((1, 2, 64, 16))
    mod = jattn.mods.alibi(jnp.ones(2))
    jattn.flex_attention(q, q, q, mod)
    calls = []
    monkeypatch.setattr(index_bounds, "check_reads", lambda *a: calls.append(a))
    jattn.flex_attention(q, q, q, jattn.mods.alibi(np.full(2, 3.0, np.float32)))
    assert calls == []
