"""flex_decode against a float64 golden: lengths, GQA packing, Lq, mods, block masks, splits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.decoding.api import flex_decode
from jattn._src.attention.split_kv_config import DecodeConfig, choose_num_splits
from tests.decoding.helpers import BLOCK, SMALL, check, inputs
from tests.helpers import assert_bitwise_equal_runs


def _alibi(H):
    return jattn.mods.alibi(jattn.mods.alibi_slopes(H))


def _segments(length):
    return jnp.asarray(np.repeat(np.arange(5), -(-length // 5))[:length], jnp.int32)


def _random_block_mask(rng, B, H, S):
    """from_kv_blocks lists: random partial/full/empty blocks per batch and head; mask_mod
    applies on partial blocks only."""
    n = -(-S // BLOCK)
    kind = rng.integers(0, 3, (B, H, n, n))  # 0 empty, 1 partial, 2 full

    def lists(wanted):
        num = (kind == wanted).sum(-1).astype(np.int32)
        return num, np.argsort(kind != wanted, -1, kind="stable").astype(np.int32)

    def checkerboard(b, h, q_idx, kv_idx):
        return (q_idx + 2 * kv_idx + b + h) % 3 != 0

    return jattn.BlockMask.from_kv_blocks(*lists(1), *lists(2), block_size=BLOCK,
                                          mask_mod=checkerboard, seq_lengths=(S, S))


MASK_CASES = [
    ("causal", None, 4, False),        # 4 queries straddle a mask row boundary in sequence 0
    ("sliding", "alibi", 1, False),
    ("document", "softcap", 4, False),  # a captured int array in the mask_mod
    ("random", None, 2, True),         # partial/full/empty per batch and per query head
]


# The XLA path (flex_attention with one decode score_mod) on two of the cases: it has no block
# walk of its own, and each case costs seconds of XLA compile on the CPU.
@pytest.mark.parametrize("impl,mask,mod,Lq,per_head", [
    *[("interpret", *case) for case in MASK_CASES],
    *[pytest.param("pallas_triton", *case, marks=pytest.mark.gpu) for case in MASK_CASES],
    *[("xla", *case) for case in MASK_CASES[::3]]])
def test_block_masks(impl, mask, mod, Lq, per_head):
    rng = np.random.default_rng(len(mask) + Lq)
    B, Hq, Hkv, S = 2, 4, 2, 150
    q, k, v = inputs(rng, B, Hq, Hkv, Lq, S, 16)
    kv_len = jnp.asarray([66, 150])  # positions 62..65 straddle the 64 boundary (Lq 4)
    if mask == "random":
        block_mask = _random_block_mask(rng, B, Hq if per_head else 1, S)
    else:
        mask_mod = {"causal": jattn.masks.causal_mask,
                    "sliding": jattn.masks.sliding_window(40),
                    "document": jattn.masks.document_mask(_segments(S))}[mask]
        block_mask = jattn.create_block_mask(mask_mod, None, None, S, S, block_size=BLOCK)
    score_mod = {None: None, "alibi": _alibi(Hq), "softcap": jattn.mods.softcap(2.0)}[mod]
    check(impl, q, k, v, score_mod, block_mask, kv_len=kv_len)


@pytest.mark.parametrize("splits", [1, 64])
def test_split_counts(splits):
    """One split, and more splits than tiles (most of them empty); SMALL's 3 splits elsewhere
    cut lengths unevenly."""
    rng = np.random.default_rng(splits)
    q, k, v = inputs(rng, 2, 4, 2, 1, 200, 16)
    config = DecodeConfig(block_k=16, num_splits=splits)
    check("interpret", q, k, v, _alibi(4), kv_len=jnp.asarray([200, 9]), config=config)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_long_query_blocks_fall_back_to_flex_attention(impl):
    rng = np.random.default_rng(4)
    q, k, v = inputs(rng, 2, 4, 2, 20, 96, 16)
    block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 96, 96,
                                         block_size=BLOCK)
    check(impl, q, k, v, _alibi(4), block_mask, kv_len=jnp.asarray([96, 50]), config=None)


def test_repeated_runs_are_bitwise_equal_and_vmap_matches():
    rng = np.random.default_rng(5)
    q, k, v = inputs(rng, 2, 4, 2, 1, 80, 16)
    kv_len = jnp.asarray([80, 33])
    fn = jax.jit(functools.partial(flex_decode, config=SMALL, implementation="interpret"))
    assert_bitwise_equal_runs(lambda: fn(q, k, v, kv_len=kv_len))
    stacked = [jnp.stack([x, -x]) for x in (q, k, v)]
    vmapped = jax.jit(jax.vmap(lambda q, k, v: fn(q, k, v, kv_len=kv_len)))(*stacked)
    np.testing.assert_allclose(vmapped[1], fn(-q, -k, -v, kv_len=kv_len), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_grad_and_jvp_raise_a_clear_error(impl):
    rng = np.random.default_rng(6)
    q, k, v = inputs(rng, 1, 2, 2, 1, 32, 16)

    def loss(q):
        return flex_decode(q, k, v, config=SMALL, implementation=impl).sum()

    with pytest.raises(NotImplementedError, match="flex_decode has no gradient"):
        jax.grad(loss)(q)
    with pytest.raises(NotImplementedError, match="nor forward-mode derivative"):
        jax.jvp(loss, (q,), (q,))


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------

def _qkv(q=(2, 4, 1, 16), k=(2, 2, 32, 16), v=(2, 2, 32, 16), dtype=jnp.float32):
    return jnp.ones(q, dtype), jnp.ones(k, dtype), jnp.ones(v, dtype)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(k=(2, 3, 32, 16), v=(2, 3, 32, 16)), ValueError, "multiple of kv heads 3"),
    (dict(k=(2, 2, 32, 8), v=(2, 2, 32, 16)), ValueError, "head dim 16 differs from k's 8"),
    (dict(v=(2, 2, 31, 16)), ValueError, "must agree on batch, heads and length"),
    (dict(q=(4, 1, 16)), ValueError, "`q` must be \\[batch, heads, queries, dim\\]"),
    (dict(q=(2, 4, 1, 0), k=(2, 2, 32, 0), v=(2, 2, 32, 0)), ValueError,
     "need at least one head and a head dim of at least 1"),
    (dict(k=(2, 0, 32, 16), v=(2, 0, 32, 16)), ValueError, "need at least one head"),
])
def test_bad_shapes_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        flex_decode(*_qkv(**kwargs), implementation="xla")


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_bad_lengths_masks_and_configs_raise(impl):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="kv_len\\[1\\] = 33 is outside \\[0, 32\\]"):
        flex_decode(q, k, v, kv_len=np.asarray([4, 33]), implementation=impl)  # host values
    with pytest.raises(ValueError, match="kv_len\\[0\\] = -1"):
        flex_decode(q, k, v, kv_len=-1, implementation=impl)
    with pytest.raises(TypeError, match="must share one of"):
        flex_decode(q.astype(jnp.bfloat16), k, v, implementation=impl)
    short = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 1, 32)
    with pytest.raises(ValueError, match="build it for \\(32, 32\\)"):
        flex_decode(q, k, v, block_mask=short, implementation=impl)
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 32, 32, block_size=16)
    with pytest.raises(ValueError, match="block_k=32 must divide the BlockMask kv block"):
        flex_decode(q, k, v, block_mask=mask, config=DecodeConfig(block_k=32),
                    implementation="interpret")
    with pytest.raises(ValueError, match="num_splits=0 must be a positive int"):
        DecodeConfig(num_splits=0)
    with pytest.raises(ValueError, match="DecodeConfig.compiler='nvcc' must be 'xla' or"):
        DecodeConfig(compiler="nvcc")


@pytest.mark.parametrize("impl", ["interpret", pytest.param("pallas_triton",
                                                             marks=pytest.mark.gpu)])
def test_lengths_unknown_until_run_give_nan_rows(impl):
    """Under jit a bad kv_len cannot raise: its sequence comes out NaN (written by the merge
    kernel), the others are right."""
    rng = np.random.default_rng(7)
    q, k, v = inputs(rng, 2, 4, 2, 1, 32, 16)
    run = jax.jit(functools.partial(flex_decode, config=SMALL, implementation=impl))
    out = run(q, k, v, kv_len=jnp.asarray([40, 20]))
    assert np.isnan(np.asarray(out[0])).all()
    np.testing.assert_array_equal(out[1], run(q, k, v, kv_len=jnp.asarray([20, 20]))[1])


def test_split_heuristic_fills_the_gpu():
    """Issue 5's shapes (Hkv 8, 64-key tiles) on 132 SMs: B=1 at 128k launches >= 2 programs
    per SM, every shape fills >= 90% of its waves of one program per SM, and no split reads
    fewer than 8 tiles."""
    for B in (1, 8, 32):
        for S in (8192, 32768, 131072):
            programs = B * 8
            splits = choose_num_splits(programs, S // 64, 132)
            total = programs * splits
            assert total / (-(-total // 132) * 132) >= 0.9, (B, S, splits)
            assert S // 64 // splits >= 8
    assert choose_num_splits(8, 131072 // 64, 132) * 8 >= 2 * 132


def test_nan_in_a_query_stays_in_its_row():
    rng = np.random.default_rng(8)
    q, k, v = inputs(rng, 1, 4, 2, 1, 48, 16)
    q = q.at[0, 1, 0, 3].set(jnp.nan)
    out = jax.jit(functools.partial(flex_decode, config=SMALL, implementation="interpret"))(
        q, k, v)
    assert np.isnan(np.asarray(out[0, 1])).all()
    assert not np.isnan(np.asarray(out[0, [0, 2, 3]])).any()


class FlexDecodeBackendTests:
    """What every `flex_decode` backend must do: each backend's class below names it, and a new
    backend is one more class."""

    implementation: str

    @pytest.mark.parametrize("B,Hq,Hkv,Lq,S,E,Ev,kv_len,kv_batch,mod", [
        (2, 4, 4, 1, 100, 16, 16, [100, 37], None, None),      # GQA 1, odd per-batch lengths
        (3, 8, 2, 4, 130, 24, 16, [130, 0, 2], None, "alibi"),  # GQA 4, Lq 4, E not a power of 2,
                                                                # an empty sequence, one below Lq
        (1, 8, 1, 1, 77, 32, 32, None, None, "softcap"),       # GQA 8 (MQA), kv_len = S ragged
        (2, 4, 2, 3, 64, 16, 32, [41, 64], 1, None),           # kv batch broadcast, Ev != E
    ])
    def test_shapes_and_lengths(self, B, Hq, Hkv, Lq, S, E, Ev, kv_len, kv_batch, mod):
        impl = self.implementation
        rng = np.random.default_rng(S + Lq)
        q, k, v = inputs(rng, B, Hq, Hkv, Lq, S, E, Ev, kv_batch=kv_batch)
        score_mod = {None: None, "alibi": _alibi(Hq), "softcap": jattn.mods.softcap(2.0)}[mod]
        out, lse = check(impl, q, k, v, score_mod,
                         kv_len=None if kv_len is None else jnp.asarray(kv_len))
        for b, length in enumerate(kv_len or []):  # queries at positions < 0 see nothing
            silent = max(0, Lq - length)
            assert np.all(np.asarray(out[b, :, :silent]) == 0)
            assert np.all(np.isneginf(lse[b, :, :silent]))


class TestXla(FlexDecodeBackendTests):
    implementation = "xla"


class TestInterpret(FlexDecodeBackendTests):
    implementation = "interpret"


@pytest.mark.gpu
class TestPallasTriton(FlexDecodeBackendTests):
    implementation = "pallas_triton"
