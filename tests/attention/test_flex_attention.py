"""flex_attention against a float64 golden: masks, mods, GQA, ragged shapes, gradients."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src import hardware
from jattn._src.attention.reference import attention_reference
from tests.attention.golden import check_against_golden
from tests.helpers import (assert_bitwise_equal_runs, assert_close, golden, low_precision, random,
                           random_cotangent_vjp)

# Small kernel tiles and mask blocks so that test shapes span several blocks and ragged tails.
SMALL = jattn.AttentionConfig(block_q=32, block_k=16, bwd_block_q=16, bwd_block_k=32)
BLOCK = 32

# The golden check at the small tiles (config= overrides them).
_check = functools.partial(check_against_golden, config=SMALL)


def _segments(length):
    return jnp.asarray(np.repeat(np.arange(4), -(-length // 4))[:length], jnp.int32)


MASKS = {
    "none": None,
    "causal": lambda L: jattn.masks.causal_mask,
    "sliding": lambda L: jattn.masks.sliding_window(24),
    "prefix": lambda L: jattn.masks.prefix_lm(20),
    "document": lambda L: jattn.masks.document_mask(_segments(L)),
}
MODS = {
    "none": None,
    "alibi": lambda H: jattn.mods.alibi(jattn.mods.alibi_slopes(H)),
    "softcap": lambda H: jattn.mods.softcap(2.0),
    "relative": lambda H: jattn.mods.relative_position_bias(
        jnp.asarray(np.random.default_rng(0).standard_normal((H, 41)), jnp.float32)),
}


def _inputs(rng, B, Hq, Hkv, L, S, E, Ev, dtype, kv_batch=None):
    kv_batch = B if kv_batch is None else kv_batch
    return (random(rng, (B, Hq, L, E), dtype), random(rng, (kv_batch, Hkv, S, E), dtype),
            random(rng, (kv_batch, Hkv, S, Ev), dtype))


def _masks_and_mods(impl, mask, mod, config=SMALL):
    rng = np.random.default_rng(len(mask) + len(mod))
    L = S = 70
    q, k, v = _inputs(rng, 2, 4, 2, L, S, 24, 24, jnp.float32)
    block_mask = None
    if MASKS[mask] is not None:
        block_mask = jattn.create_block_mask(MASKS[mask](L), None, None, L, S, block_size=BLOCK)
    score_mod = None if MODS[mod] is None else MODS[mod](4)
    _check(impl, q, k, v, score_mod, block_mask, config=config)


@pytest.mark.parametrize("mask,mod", [("causal", "none"), ("document", "alibi"),
                                      ("sliding", "relative"), ("none", "softcap")])
def test_masks_and_mods_in_the_interpreter(mask, mod):
    """The Pallas kernels' logic on the CPU: masks, captured-array lookups, partial blocks, no
    BlockMask over ragged key tiles."""
    _masks_and_mods("interpret", mask, mod)


@pytest.mark.gpu
@pytest.mark.parametrize("mask,mod", [("causal", "alibi"), ("document", "none"),
                                      ("sliding", "softcap"), ("none", "relative")])
def test_forward_compiled_by_triton(mask, mod):
    """The forward kernel compiled by the `triton` package instead of XLA (compiler="triton",
    the D <= 64 default where triton is installed) against the golden."""
    pytest.importorskip("triton")
    _masks_and_mods("pallas_triton", mask, mod, dataclasses.replace(SMALL, compiler="triton"))


def test_config_names_its_compiler():
    with pytest.raises(ValueError, match="AttentionConfig.compiler='nvcc' must be 'xla'"):
        jattn.AttentionConfig(compiler="nvcc")
    from jattn._src.attention.config import heuristic_config

    chosen = heuristic_config(64, (128, 128), masked=True, triton_compiler=True)
    assert (chosen.block_q, chosen.block_k, chosen.compiler) == (128, 64, "triton")
    assert heuristic_config(64, (128, 128), masked=True).compiler == "xla"
    assert heuristic_config(128, (128, 128), masked=False, triton_compiler=True).compiler == (
        "triton")
    # with a mask_mod at D128: `triton`'s compile of XLA's best tile (launchable from torch)
    masked = heuristic_config(128, (128, 128), masked=True, triton_compiler=True)
    assert (masked.block_q, masked.block_k, masked.num_warps, masked.num_stages,
            masked.compiler) == (128, 64, 4, 2, "triton")
    assert heuristic_config(128, (128, 128), masked=True).compiler == "xla"
    # the backward: `triton`'s compile where it can, except with a score_mod
    assert heuristic_config(128, (128, 128), masked=True, triton_compiler=True).bwd_compiler == (
        "triton")
    assert heuristic_config(64, (128, 128), masked=False).bwd_compiler == "xla"
    assert heuristic_config(64, (128, 128), masked=False, triton_compiler=True,
                            score_mod=True).bwd_compiler == "xla"
    with pytest.raises(ValueError, match="AttentionConfig.bwd_compiler='nvcc' must be 'xla'"):
        jattn.AttentionConfig(bwd_compiler="nvcc")


@pytest.mark.parametrize("impl", ["xla", pytest.param("pallas_triton", marks=pytest.mark.gpu)])
def test_captured_array_gradients_are_bitwise_reproducible(impl):
    """A relative-position table's gradient sums many score cotangents into each entry (a
    float scatter-add: atomics in arbitrary order on the GPU); two runs give the same bits."""
    rng = np.random.default_rng(8)
    q, k, v = _inputs(rng, 2, 8, 8, 1024, 1024, 64, 64, jnp.bfloat16)
    table = random(rng, (8, 257))
    cotangent = random(rng, (2, 8, 1024, 64), jnp.bfloat16)
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 1024, 1024)

    def ours(q, table):
        return jattn.flex_attention(q, k, v, jattn.mods.relative_position_bias(table), mask,
                                    implementation=impl)

    grads = jax.jit(lambda q, table: random_cotangent_vjp(ours, (q, table), cotangent))
    assert_bitwise_equal_runs(lambda: grads(q, table))


def test_nan_propagates():
    q = jnp.ones((1, 1, 32, 16)).at[0, 0, 3, 0].set(jnp.nan)
    out = jattn.flex_attention(q, jnp.ones((1, 1, 32, 16)), jnp.ones((1, 1, 32, 16)),
                               config=SMALL, implementation="interpret")
    assert np.isnan(np.asarray(out[0, 0, 3])).all() and not np.isnan(np.asarray(out[0, 0, 4])).any()


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------

def _qkv(q=(1, 4, 32, 16), k=(1, 2, 32, 16), v=(1, 2, 32, 16), dtype=jnp.float32):
    return jnp.ones(q, dtype), jnp.ones(k, dtype), jnp.ones(v, dtype)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(q=(4, 32, 16)), ValueError, "`q` must be \\[batch, heads, length, dim\\]"),
    (dict(k=(1, 3, 32, 16), v=(1, 3, 32, 16)), ValueError, "multiple of kv heads 3"),
    (dict(k=(1, 2, 32, 8), v=(1, 2, 32, 16)), ValueError, "same head dim"),
    (dict(v=(1, 2, 31, 16)), ValueError, "must agree on batch, heads and length"),
    (dict(k=(3, 2, 32, 16), v=(3, 2, 32, 16)), ValueError, "k/v batch 3 must equal"),
    (dict(q=(1, 4, 32, 0), k=(1, 2, 32, 0), v=(1, 2, 32, 0)), ValueError,
     "head dims must be at least 1"),
    (dict(k=(1, 0, 32, 16), v=(1, 0, 32, 16)), ValueError, "need at least one head"),
])
def test_bad_shapes_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        jattn.flex_attention(*_qkv(**kwargs), enable_gqa=True, implementation="xla")


def test_gqa_needs_opt_in_and_dtypes_must_match():
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        jattn.flex_attention(*_qkv(), implementation="xla")
    q, k, v = _qkv(k=(1, 4, 32, 16), v=(1, 4, 32, 16))
    with pytest.raises(TypeError, match="share a dtype"):
        jattn.flex_attention(q, k.astype(jnp.bfloat16), v, implementation="xla")
    with pytest.raises(TypeError, match="`q` has dtype int32"):
        jattn.flex_attention(q.astype(jnp.int32), k, v, implementation="xla")


@pytest.mark.parametrize("scale,error,match", [
    ("a", TypeError, "`scale` must be a Python float .* got str 'a'"),
    (1e30, ValueError, r"`scale` must be finite with \|scale\| <= 2\*\*20"),
    (float("inf"), ValueError, "must be finite"),
])
def test_bad_scales_raise(scale, error, match):
    with pytest.raises(error, match=match):
        jattn.flex_attention(*_qkv(), scale=scale, enable_gqa=True, implementation="xla")
    with pytest.raises(error, match=match.replace("flex_attention", "flex_decode")):
        q, k, v = _qkv()
        jattn.flex_decode(q[:, :, :1], k, v, scale=scale, implementation="xla")


def test_a_traced_scale_points_to_a_score_mod():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="traced value.*put a learnable or per-call scale into "
                                        "a score_mod"):
        jax.jit(lambda s: jattn.flex_attention(q, k, v, scale=s, enable_gqa=True))(0.5)
    # concrete scalars of any kind are floats
    for scale in (np.float32(0.5), jnp.float32(0.5), 1):
        jattn.flex_attention(q, k, v, scale=scale, enable_gqa=True, implementation="xla")


@pytest.mark.parametrize("block_size,error", [(16.0, TypeError), ((16, "a"), TypeError),
                                              ("16", TypeError), ((16, 16, 16), ValueError),
                                              (0, ValueError)])
def test_bad_block_sizes_name_the_argument(block_size, error):
    with pytest.raises(error, match="`block_size` must be an int"):
        jattn.create_block_mask(jattn.masks.causal_mask, None, None, 64, 64,
                                block_size=block_size)


@pytest.mark.parametrize("impl,dtype", [
    ("xla", jnp.float32), ("interpret", jnp.float32),
    pytest.param("pallas_triton", jnp.float32, marks=pytest.mark.gpu),
    pytest.param("pallas_mosaic_gpu", jnp.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("scale", [2.0 ** 20, -(2.0 ** 20)])
def test_the_largest_scale_gives_finite_results(impl, dtype, scale):
    """Scores of 1e7 and more: float32 scores with fused multiply-adds in the softmax (XLA's
    fusions, the kernels) stay finite and match the float64 softmax, which is one-hot there."""
    if impl == "pallas_mosaic_gpu" and not hardware.is_hopper():
        pytest.skip("the Mosaic GPU forward runs on Hopper")
    rng = np.random.default_rng(3)
    length = 96 if impl in ("xla", "interpret") else 256  # the GPU kernels' whole tiles
    q, k, v = (random(rng, (1, 2, length, 64), dtype) for _ in range(3))

    def attend(q, k, v):
        # full float32 products: at these scales TF32's rounding would pick other maxima
        return jattn.flex_attention(q, k, v, scale=scale, implementation=impl,
                                    precision="highest")

    out = attend(q, k, v)
    gold = golden(lambda *x: attention_reference(*x, scale=scale)[0], q, k, v)
    if dtype == jnp.float32:
        assert_close(out, gold, attention_reference(q, k, v, scale=scale)[0])
    else:
        # The one-hot reference is exact in bf16; the kernel's fused exponent puts the winning
        # probability near 1, not at 1, rounded to bf16 for P·V but not in the row sum: one
        # bf16 ulp of the output.
        error = np.abs(np.asarray(out, np.float64) - gold).max()
        assert error <= float(jnp.finfo(dtype).eps) * np.abs(gold).max(), error
    grads = jax.grad(lambda *x: jnp.sum(attend(*x) * v), argnums=(0, 1, 2))(q, k, v)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)


def test_low_precision_capture_gradients_follow_the_rounded_output():
    """A captured array's gradient in bf16 sums dS over many scores, so the row sum Δ = Σ dO·O
    (computed from the output rounded to bf16, as torch's and FlashAttention's backwards do)
    dominates its error: it is the error of the float64 gradient with Δ from the rounded
    output, not a defect. A per-(b, h) bias has gradient 0 exactly (softmax ignores a constant
    per row), so the error is all there is."""
    rng = np.random.default_rng(6)
    q, k, v, d_out = (random(rng, (2, 2, 16, 32)) for _ in range(4))
    bias = jnp.zeros((2, 2))

    def mod_of(c):
        return lambda s, b, h, q_idx, kv_idx: s + c[b, h]

    ours = jax.grad(lambda c: jnp.sum(jattn.flex_attention(
        *(x.astype(jnp.bfloat16) for x in (q, k, v)), mod_of(c),
        implementation="xla").astype(jnp.float32) * d_out))(bias)

    def gradient_with_delta_from(round_output):
        with jax.enable_x64(True):
            q64, k64, v64 = (x.astype(jnp.bfloat16).astype(jnp.float64) for x in (q, k, v))
            s = jnp.einsum("bhle,bhse->bhls", q64, k64) / np.sqrt(32)
            p = jax.nn.softmax(s, axis=-1)
            out = jnp.einsum("bhls,bhse->bhle", p, v64)
            if round_output:
                out = out.astype(jnp.bfloat16).astype(jnp.float64)
            delta = jnp.sum(out * d_out, axis=-1, keepdims=True)
            d_s = p * (jnp.einsum("bhle,bhse->bhls", d_out.astype(jnp.float64), v64) - delta)
            return np.asarray(d_s.sum(axis=(-2, -1)))

    exact = gradient_with_delta_from(round_output=False)
    assert np.abs(exact).max() < 1e-12
    rounded_error = np.abs(gradient_with_delta_from(round_output=True) - exact).max()
    error = np.abs(np.asarray(ours, np.float64) - exact).max()
    assert rounded_error > 1e-3 and error <= 3 * rounded_error, (error, rounded_error)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_an_integer_score_is_promoted_as_torch_does(impl):
    """`q_idx - kv_idx` as the score (int32, constant along b and h) is the float score."""
    q, k, v = (jax.random.normal(key, (2, 2, 40, 16))
               for key in jax.random.split(jax.random.key(0), 3))
    out = jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: qi - ki, implementation=impl)
    expected = jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: 0 * s + (qi - ki),
                                    implementation=impl)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_bad_mods_and_masks_raise(impl):
    q, k, v = _qkv(k=(1, 4, 32, 16), v=(1, 4, 32, 16))
    with pytest.raises(ValueError, match="flex_attention: `score_mod` must return one float "
                                         r"per score.*\[B, Hq, L, S\] = \[1, 4, 32, 32\]"):
        jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s.sum(), implementation=impl)
    with pytest.raises(TypeError, match=r"`score_mod` is called as score_mod\(score, b, h, "
                                        r"q_idx, kv_idx\), but bias\(s, h\) cannot take"):
        def bias(s, h):
            return s + h
        jattn.flex_attention(q, k, v, bias, implementation=impl)
    with pytest.raises(TypeError, match="uses a Python `if`.*jnp.where"):
        def branchy(s, b, h, qi, ki):
            return s if qi > ki else -s
        jattn.flex_attention(q, k, v, branchy, implementation=impl)
    with pytest.raises(TypeError, match="flex_decode: `mask_mod` is called as mask_mod"):
        short = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 32, 32)
        short = dataclasses.replace(short, mask_mod=lambda b, h, qi: qi >= 0)
        jattn.flex_decode(q[:, :, :1], k, v, block_mask=short, implementation=impl)
    wrong = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 64, 32)
    with pytest.raises(ValueError, match="block_mask was built for Q_LEN=64, KV_LEN=32"):
        jattn.flex_attention(q, k, v, block_mask=wrong, implementation=impl)
    heads = jattn.create_block_mask(jattn.masks.causal_mask, None, 3, 32, 32)
    with pytest.raises(ValueError, match="batch/heads \\(1, 3\\) must be 1 or match"):
        jattn.flex_attention(q, k, v, block_mask=heads, implementation=impl)
    odd = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 32, 32, block_size=16)
    with pytest.raises(ValueError, match="must divide the BlockMask block size 16"):
        jattn.flex_attention(q, k, v, block_mask=odd, config=jattn.AttentionConfig(),
                             implementation="interpret")


def test_a_score_mod_returning_its_score_costs_nothing():
    """transformers passes a score_mod that returns its score when it has no softcap or head
    mask: the call is the one without a score_mod (same program), and a mod that computes
    anything is kept."""
    q = jnp.ones((1, 2, 128, 16))
    softcap = None

    def passthrough(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * jnp.tanh(score / softcap)
        return score

    def program(score_mod):
        return str(jax.make_jaxpr(lambda q: jattn.flex_attention(q, q, q, score_mod))(q))

    assert program(passthrough) == program(None)
    assert program(lambda s, b, h, q_idx, kv_idx: s * 2.0) != program(None)


class FlexAttentionBackendTests:
    """What every `flex_attention` backend must do: each backend's class below names it, and a new
    backend is one more class."""

    implementation: str

    def skip_in_the_interpreter(self):
        """Wide matrices run on the compiled backends; the interpreter (slow on the CPU) runs
        a representative subset in the other tests."""
        if self.implementation == "interpret":
            pytest.skip("a wide matrix: compiled backends only")

    @pytest.mark.parametrize("mask,mod", [(mask, "none") for mask in MASKS]
                             + [(mask, "alibi") for mask in MASKS if mask != "none"]
                             + [("none", "softcap"), ("none", "relative")])
    def test_masks_and_mods(self, mask, mod):
        self.skip_in_the_interpreter()
        impl = self.implementation
        _masks_and_mods(impl, mask, mod)

    @pytest.mark.parametrize("B,Hq,Hkv,L,S,E,Ev,kv_batch", [
        (1, 8, 1, 17, 33, 16, 16, None),     # MQA, short ragged lengths
        (2, 8, 2, 1, 45, 80, 48, None),      # one query, E not a power of two, Ev != E
        (2, 4, 4, 64, 40, 64, 32, 1),        # kv batch broadcast, L != S
    ])
    def test_shapes(self, B, Hq, Hkv, L, S, E, Ev, kv_batch):
        impl = self.implementation
        rng = np.random.default_rng(L + S)
        q, k, v = _inputs(rng, B, Hq, Hkv, L, S, E, Ev, jnp.float32, kv_batch)
        block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, S,
                                             block_size=BLOCK)
        _check(impl, q, k, v, jattn.mods.softcap(3.0), block_mask)

    @pytest.mark.parametrize("B,Hq,Hkv,L,S,E", [
        (1, 4, 1, 113, 1025, 128),           # long ragged keys, GQA 4
        # GQA 8, L = S not a block multiple: the kernels' tiles (xla's blocks: the cases around)
        pytest.param(1, 8, 1, 1000, 1000, 64, marks=pytest.mark.gpu),
        (1, 2, 2, 1025, 113, 128),           # long ragged queries over short keys
    ])
    def test_long_ragged_shapes(self, B, Hq, Hkv, L, S, E):
        self.skip_in_the_interpreter()
        impl = self.implementation
        rng = np.random.default_rng(L * S)
        q, k, v = _inputs(rng, B, Hq, Hkv, L, S, E, E, jnp.float32)
        block_mask = jattn.create_block_mask(jattn.masks.sliding_window(300), None, None, L, S,
                                             block_size=BLOCK)
        _check(impl, q, k, v, jattn.mods.alibi(jattn.mods.alibi_slopes(Hq)), block_mask)

    def test_random_block_masks(self):
        """from_kv_blocks lists in random order, random partial/full/empty blocks per batch and
        head; mask_mod applies on partial blocks only."""
        impl = self.implementation
        rng = np.random.default_rng(9)
        B, H, L, S = 2, 2, 96, 80
        n_q, n_kv = 3, 3
        kind = rng.integers(0, 3, (B, H, n_q, n_kv))  # 0 empty, 1 partial, 2 full

        def lists(wanted):
            num = (kind == wanted).sum(-1).astype(np.int32)
            order = rng.permuted(np.broadcast_to(np.arange(n_kv), kind.shape), axis=-1)
            chosen = np.take_along_axis(kind, order, -1) == wanted
            return num, np.take_along_axis(order, np.argsort(~chosen, -1, kind="stable"),
                                           -1).astype(np.int32)

        def checkerboard(b, h, q_idx, kv_idx):
            return (q_idx + 2 * kv_idx + b + h) % 3 != 0

        block_mask = jattn.BlockMask.from_kv_blocks(*lists(1), *lists(2), block_size=BLOCK,
                                                    mask_mod=checkerboard, seq_lengths=(L, S))
        np.testing.assert_array_equal(np.asarray(block_mask.to_dense()), kind > 0)
        q, k, v = _inputs(rng, B, H, H, L, S, 16, 16, jnp.float32)
        _check(impl, q, k, v, None, block_mask)

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
    def test_low_precision_dtypes(self, dtype):
        self.skip_in_the_interpreter()
        impl = self.implementation
        rng = np.random.default_rng(5)
        q, k, v = _inputs(rng, 1, 2, 2, 64, 64, 32, 32, dtype)
        block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 64, 64,
                                             block_size=BLOCK)
        _check(impl, q, k, v, jattn.mods.alibi(jattn.mods.alibi_slopes(2)), block_mask)

    def test_fully_masked_rows_give_zero_and_minus_inf(self):
        """(and the rows' largest scores against the float64 golden)"""
        impl = self.implementation
        rng = np.random.default_rng(6)
        q, k, v = _inputs(rng, 1, 2, 2, 40, 40, 16, 16, jnp.float32)

        def late_start(b, h, q_idx, kv_idx):  # queries 0..9 see nothing
            return (q_idx >= 10) & (kv_idx <= q_idx)

        block_mask = jattn.create_block_mask(late_start, None, None, 40, 40, block_size=BLOCK)
        out, lse, largest = jattn.flex_attention(q, k, v, block_mask=block_mask, return_lse=True,
                                                 return_max_scores=True, config=SMALL,
                                                 implementation=impl)
        assert np.all(np.asarray(out[:, :, :10]) == 0) and np.all(np.isneginf(lse[:, :, :10]))
        assert np.all(np.isneginf(largest[:, :, :10]))
        _check(impl, q, k, v, None, block_mask)

        kept = late_start(0, 0, np.arange(40)[:, None], np.arange(40)[None, :])

        def rows_max(q, k):  # (scale 1/sqrt(16))
            scores = jnp.einsum("bhle,bhse->bhls", q, k) / 4.0
            return jnp.where(kept, scores, -jnp.inf).max(-1)[:, :, 10:]

        assert_close(largest[:, :, 10:], golden(rows_max, q, k), low_precision(rows_max, q, k),
                     what="max_scores")

    def test_captured_array_gradients(self):
        """Learnable alibi slopes and a learnable relative-position table get gradients."""
        impl = self.implementation
        rng = np.random.default_rng(7)
        q, k, v = _inputs(rng, 2, 4, 2, 48, 48, 16, 16, jnp.float32)
        slopes = random(rng, (4,), scale=0.1)
        table = random(rng, (4, 31))
        block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 48, 48,
                                             block_size=BLOCK)

        def mod(slopes, table):
            alibi, relative = jattn.mods.alibi(slopes), jattn.mods.relative_position_bias(table)
            return lambda s, b, h, qi, ki: relative(alibi(s, b, h, qi, ki), b, h, qi, ki)

        def ours(q, k, v, slopes, table):
            return jattn.flex_attention(q, k, v, mod(slopes, table), block_mask, enable_gqa=True,
                                        config=SMALL, implementation=impl)

        def ref(q, k, v, slopes, table):
            return attention_reference(q, k, v, mod(slopes, table), block_mask)[0]

        args = (q, k, v, slopes, table)
        cotangent = random(rng, (2, 4, 48, 16))
        grads = jax.jit(lambda *x: random_cotangent_vjp(ours, x, cotangent))(*args)
        gold = golden(lambda *x: random_cotangent_vjp(ref, x[:5], x[5]), *args, cotangent)
        low = low_precision(lambda *x: random_cotangent_vjp(ref, x[:5], x[5]), *args, cotangent)
        for name, g, g64, g_low in zip(("q", "k", "v", "slopes", "table"), grads, gold, low):
            assert_close(g, g64, g_low, what=f"d{name}")

    def test_deterministic_and_transformations(self):
        impl = self.implementation
        rng = np.random.default_rng(8)
        q, k, v = _inputs(rng, 2, 2, 2, 40, 40, 16, 16, jnp.float32)
        cotangent = random(rng, (3, *q.shape[:3], 16))
        block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 40, 40,
                                             block_size=BLOCK)
        fn = functools.partial(jattn.flex_attention, block_mask=block_mask, config=SMALL,
                               implementation=impl)
        stacked = [jnp.stack([x, 2 * x, -x]) for x in (q, k, v)]
        grad_fn = jax.jit(lambda *x: random_cotangent_vjp(jax.vmap(jax.checkpoint(fn)), x,
                                                          cotangent))
        assert_bitwise_equal_runs(lambda: grad_fn(*stacked))
        vmapped = jax.jit(jax.vmap(fn))(*stacked)
        np.testing.assert_allclose(vmapped[1], jax.jit(fn)(*[s[1] for s in stacked]), rtol=1e-6,
                                   atol=1e-6)

    def test_deterministic_false_changes_nothing_where_every_kernel_is_deterministic(self):
        """deterministic=False permits, and only pallas_mosaic_gpu at head dim 64 takes it
        (tests/attention/test_mosaic_gpu.py): elsewhere the same results. A non-bool raises
        naming the argument."""
        impl = self.implementation
        rng = np.random.default_rng(9)
        q, k, v = _inputs(rng, 1, 2, 2, 64, 64, 16, 16, jnp.float32)
        cotangent = random(rng, q.shape)
        results = [random_cotangent_vjp(functools.partial(
            jattn.flex_attention, config=SMALL, implementation=impl,
            deterministic=deterministic), (q, k, v), cotangent) for deterministic in (True, False)]
        for a, b in zip(*results):
            np.testing.assert_array_equal(a, b)
        with pytest.raises(TypeError, match="`deterministic` must be True or False, got 'no'"):
            jattn.flex_attention(q, k, v, deterministic="no")

    def test_backward_from_saved_outputs_equals_vjp(self):
        """flex_attention_backward (the torch ops' backward) reuses out/lse and matches jax.vjp bit
        for bit (the captured table's gradient too, except across GPU programs: see below)."""
        impl = self.implementation
        from jattn._src.attention.api import flex_attention_backward

        rng = np.random.default_rng(10)
        q, k, v = _inputs(rng, 1, 4, 2, 48, 40, 16, 16, jnp.float32)
        table = random(rng, (4, 31))
        block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 48, 40,
                                             block_size=BLOCK)
        options = dict(enable_gqa=True, config=SMALL, implementation=impl)

        def run(q, k, v, table):
            return jattn.flex_attention(q, k, v, jattn.mods.relative_position_bias(table),
                                        block_mask, return_lse=True, **options)

        (out, lse), vjp = jax.vjp(run, q, k, v, table)
        cotangents = (random(rng, out.shape), random(rng, lse.shape))
        expected = jax.jit(lambda vjp, c: vjp(c))(vjp, cotangents)  # residuals as arguments
        dq, dk, dv, (d_table,) = jax.jit(lambda out, lse, c, table: flex_attention_backward(
            q, k, v, out, lse, *c, jattn.mods.relative_position_bias(table), block_mask,
            score_captures=(table,), **options))(out, lse, cotangents, table)
        for name, ours, theirs in zip("qkv", (dq, dk, dv), expected):
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs), err_msg=f"d{name}")
        # The table's gradient is an XLA reduction, which XLA may order differently in two programs
        # on the GPU (seen: 1e-6 relative); bitwise on the CPU.
        tolerance = 0 if impl != "pallas_triton" else 1e-5
        np.testing.assert_allclose(np.asarray(d_table), np.asarray(expected[3]), rtol=tolerance,
                                   atol=tolerance, err_msg="dtable")


class TestXla(FlexAttentionBackendTests):
    implementation = "xla"


class TestInterpret(FlexAttentionBackendTests):
    implementation = "interpret"


@pytest.mark.gpu
class TestPallasTriton(FlexAttentionBackendTests):
    implementation = "pallas_triton"
