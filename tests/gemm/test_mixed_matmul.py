"""quantize_weight and mixed_matmul (int8 / int4 weight-only GEMM): format, values, gradients,
CUDA lowering and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.gemm import pallas_triton_mixed
from jattn._src.gemm.config import MatmulConfig, heuristic_mixed_config
from jattn._src.gemm.quantize import pack_int4, unpack_int4
from jattn._src.gemm.reference import mixed_matmul_reference
from tests.helpers import (assert_close, golden, low_precision, lower_for_cuda, random,
                           random_cotangent_vjp)

# Small tiles so that test shapes span several programs, ragged edges and a K tail.
SMALL = MatmulConfig(block_m=16, block_n=32, block_k=64, group_m=1, num_warps=4, num_stages=2)
# (bits, group_size): per channel and per group, for both widths.
MODES = [(8, None), (8, 32), (4, None), (4, 32)]


def _inputs(rng, m, n, k, bits, group_size, dtype=jnp.bfloat16):
    w = random(rng, (k, n), jnp.float32)
    qweight, scales = jattn.quantize_weight(w, bits, group_size, scale_dtype=dtype)
    return random(rng, (m, k), dtype), qweight, scales


def _check(impl, a, qweight, scales, bits, group_size, **kwargs):
    run = functools.partial(jattn.mixed_matmul, bits=bits, group_size=group_size,
                            implementation=impl, **kwargs)
    out = jax.jit(run)(a, qweight, scales)
    assert out.shape == (*a.shape[:-1], qweight.shape[0]) and out.dtype == a.dtype
    reference = functools.partial(mixed_matmul_reference, bits=bits, group_size=group_size)
    args = (a, qweight, scales)
    assert_close(out, golden(reference, *args), low_precision(reference, *args))


# ------------------------------------------------------------------------------------------------
# The quantised format
# ------------------------------------------------------------------------------------------------

def test_int4_packing_round_trips_every_value():
    values = jnp.asarray(np.arange(-8, 8).repeat(16).reshape(16, 16).T.reshape(32, 8),
                         jnp.int8)  # [K=32, N=8], every value in every position parity
    packed = pack_int4(values)
    assert packed.dtype == jnp.uint8 and packed.shape == (8, 16)
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed)), np.asarray(values))
    # Output channels first; even k in the low nibble, each stored + 8 (the seed's uint4x2).
    even, odd = (np.asarray(values[i], np.int32) + 8 for i in (0, 1))
    np.testing.assert_array_equal(np.asarray(packed[:, 0]), even | (odd << 4))


@pytest.mark.parametrize("bits,group_size", MODES)
def test_quantize_then_dequantize_is_within_half_a_step(bits, group_size):
    rng = np.random.default_rng(bits)
    w = random(rng, (128, 24), jnp.float32)
    w = w.at[:64, 3].set(0.0)  # an all-zero group (and half a channel) gets a finite scale
    qweight, scales = jattn.quantize_weight(w, bits, group_size, scale_dtype=jnp.float32)
    groups = 1 if group_size is None else 128 // group_size
    assert scales.shape == ((24,) if group_size is None else (groups, 24))
    assert qweight.shape == ((24, 128) if bits == 8 else (24, 64))
    restored = jattn.dequantize_weight(qweight, scales, bits=bits, group_size=group_size)
    step = np.repeat(np.asarray(scales).reshape(groups, 24), 128 // groups, axis=0)
    assert np.all(np.abs(np.asarray(restored - w)) <= 0.5 * step * (1 + 1e-6))
    assert np.isfinite(np.asarray(scales)).all()


def test_default_scale_dtype_is_the_weights():
    _, scales = jattn.quantize_weight(jnp.ones((32, 4), jnp.bfloat16), 4, 32)
    assert scales.dtype == jnp.bfloat16


# ------------------------------------------------------------------------------------------------
# Values
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_per_channel_scales_as_row_vector(impl):
    rng = np.random.default_rng(7)
    a, qweight, scales = _inputs(rng, 8, 24, 64, 8, None)
    _check(impl, a, qweight, scales.reshape(1, -1), 8, None, config=SMALL)


# ------------------------------------------------------------------------------------------------
# Gradients
# ------------------------------------------------------------------------------------------------


def test_gradient_of_the_integer_weight_raises():
    rng = np.random.default_rng(9)
    a, qweight, scales = _inputs(rng, 4, 16, 32, 8, None)
    with pytest.raises(TypeError, match="grad requires real- or complex-valued inputs"):
        jax.grad(lambda q: jattn.mixed_matmul(a, q, scales, bits=8, implementation="xla")
                 .astype(jnp.float32).sum())(qweight)


# ------------------------------------------------------------------------------------------------
# Lowering for CUDA (no GPU needed)
# ------------------------------------------------------------------------------------------------

def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("bits,group_size,m,n,k,config", [
    (8, None, 16, 8192, 8192, None),          # decode shapes, heuristic tiles
    (4, None, 16, 8192, 8192, None),          # int4 rows <= 16: inline-PTX widening
    (4, 128, 1, 8192, 8192, None),
    (4, 32, 64, 256, 512, None),              # int4 larger row tiles: the jnp widening
    (8, 64, 1000, 1030, 512, None),           # prefill-sized M, ragged N
    (4, None, 33, 100, 130, MatmulConfig(16, 32, 64, 1, 4, 2, split_k=2)),  # ragged K tail
])
def test_kernel_lowers(bits, group_size, m, n, k, config):
    config = config or heuristic_mixed_config(m, n, k, bits)
    groups = 1 if group_size is None else k // group_size
    fn = functools.partial(pallas_triton_mixed.mixed_matmul, bits=bits, group_size=group_size,
                           config=config, out_dtype=jnp.bfloat16)
    text = lower_for_cuda(fn, _spec((m, k), jnp.bfloat16),
                          _spec((n, k * bits // 8), jnp.int8 if bits == 8 else jnp.uint8),
                          _spec((groups, n), jnp.bfloat16))
    assert "triton" in text and f"jattn_mixed_matmul_int{bits}" in text


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------

A = jnp.ones((4, 64), jnp.bfloat16)
Q8, Q4 = jnp.ones((8, 64), jnp.int8), jnp.ones((8, 32), jnp.uint8)
S = jnp.ones((8,), jnp.bfloat16)


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((A, Q8, S), dict(bits=3), ValueError, "`bits` must be 8 or 4, got 3"),
    ((A.astype(jnp.float32), Q8, S), dict(bits=8), TypeError,
     "`a` has dtype float32; the activations must be bfloat16 or float16"),
    ((A, Q4, S), dict(bits=8), TypeError,
     "bits=8 takes `qweight` as int8 \\[N, K\\], got dtype uint8; build it with "
     "jattn.quantize_weight\\(w, bits=8\\)"),
    ((A, Q8, S), dict(bits=4), TypeError, "bits=4 takes `qweight` as uint8 \\[N, K/2\\]"),
    ((A, Q8[:, :60], S), dict(bits=8), ValueError,
     "`qweight` must be \\[N, 64\\], output channels first, for `a` \\(4, 64\\) with "
     "K=64; got shape \\(8, 60\\)"),
    ((A, Q8.T, S), dict(bits=8), ValueError, "got shape \\(64, 8\\)"),
    ((jnp.ones((4, 63), jnp.bfloat16), Q4, S), dict(bits=4), ValueError,
     "int4 weights pack two K rows per byte, so K must be even; `a` \\(4, 63\\) has K=63"),
    ((A, Q8, jnp.ones((2, 8), jnp.bfloat16)), dict(bits=8, group_size=40), ValueError,
     "`group_size`=40 must be a multiple of 16"),
    ((A, Q4, jnp.ones((2, 8), jnp.bfloat16)), dict(bits=4, group_size=16), ValueError,
     "`group_size`=16 must be a multiple of 32 for 4-bit weights"),
    ((jnp.ones((4, 96), jnp.bfloat16), jnp.ones((8, 96), jnp.int8), S),
     dict(bits=8, group_size=64), ValueError, "K=96 is not divisible by `group_size`=64"),
    ((A, Q8, jnp.ones((3, 8), jnp.bfloat16)), dict(bits=8, group_size=32), ValueError,
     "with group_size=32, `scales` must be \\[K / group_size, N\\] = \\[2, 8\\], got shape "
     "\\(3, 8\\)"),
    ((A, Q8, jnp.ones((2, 8), jnp.bfloat16)), dict(bits=8), ValueError,
     "per-channel `scales` \\(group_size=None\\) must be \\[8\\]"),
    ((A, Q8, jnp.ones((8,), jnp.int32)), dict(bits=8), TypeError,
     "`scales` must be floating point, got int32"),
    ((A, Q4, S), dict(bits=4, config=MatmulConfig(block_k=16)), ValueError,
     "int4 needs config.block_k >= 32"),
])
def test_bad_input_raises(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        jattn.mixed_matmul(*args, implementation="interpret", **kwargs)


@pytest.mark.parametrize("w,kwargs,error,match", [
    (jnp.ones((63, 8)), dict(bits=4), ValueError, "K must be even; got K=63"),
    (jnp.ones((64, 8)), dict(bits=8, group_size=24), ValueError, "multiple of 16"),
    (jnp.ones((64, 8), jnp.int8), dict(bits=8), ValueError, "must be a floating \\[K, N\\]"),
    (jnp.ones((64,)), dict(bits=8), ValueError, "must be a floating \\[K, N\\] matrix"),
    (jnp.ones((64, 8)), dict(bits=2), ValueError, "`bits` must be 8 or 4"),
])
def test_quantize_bad_input_raises(w, kwargs, error, match):
    with pytest.raises(error, match=match):
        jattn.quantize_weight(w, **kwargs)


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("bits,group_size", MODES + [(8, 128), (4, 128)])
@pytest.mark.parametrize("m,n,k", [(16, 4096, 4096), (1, 2048, 4096), (300, 1000, 512)])
def test_default_configs_on_gpu(bits, group_size, m, n, k):
    rng = np.random.default_rng(m + n + k + bits)
    _check("pallas_triton", *_inputs(rng, m, n, k, bits, group_size), bits, group_size)


def test_a_nan_weight_column_stays_nan():
    """A column (or group) holding NaN gets the scale NaN: dequantisation and the product give
    NaN there, not a silent 0; the other columns are unaffected."""
    w = jnp.ones((64, 4), jnp.float32).at[5, 1].set(jnp.nan)
    for bits, group_size in ((8, None), (4, 32)):
        qweight, scales = jattn.quantize_weight(w, bits=bits, group_size=group_size)
        dense = jattn.dequantize_weight(qweight, scales, bits=bits, group_size=group_size)
        nan_rows = slice(0, 64) if group_size is None else slice(0, 32)
        assert np.isnan(np.asarray(dense[nan_rows, 1])).all()
        assert not np.isnan(np.asarray(dense[:, [0, 2, 3]])).any()
        y = jattn.mixed_matmul(jnp.ones((16, 64), jnp.bfloat16), qweight, scales, bits=bits,
                               group_size=group_size, implementation="xla")
        assert np.isnan(np.asarray(y[:, 1], np.float32)).all()
        assert not np.isnan(np.asarray(y[:, [0, 2, 3]], np.float32)).any()


class MixedMatmulBackendTests:
    """What every `mixed_matmul` backend must do: each backend's class below names it, and a new
    backend is one more class."""

    implementation: str

    @pytest.mark.parametrize("bits,group_size", MODES)
    @pytest.mark.parametrize("m,n,k", [(37, 100, 192), (1, 17, 64)])
    def test_matches_golden(self, bits, group_size, m, n, k):
        impl = self.implementation
        rng = np.random.default_rng(m + n + k + bits)
        _check(impl, *_inputs(rng, m, n, k, bits, group_size), bits, group_size, config=SMALL)

    @pytest.mark.parametrize("bits", [8, 4])
    def test_ragged_k_tail_float16_and_leading_dims(self, bits):
        """K = 150 is not a multiple of block_k (a masked tail); a [2, 5, K] activation."""
        impl = self.implementation
        rng = np.random.default_rng(5)
        a, qweight, scales = _inputs(rng, 10, 40, 150, bits, None, jnp.float16)
        _check(impl, a.reshape(2, 5, 150), qweight, scales, bits, None, config=SMALL)

    @pytest.mark.parametrize("bits,group_size", [(8, None), (4, 32)])
    def test_split_k_and_chunked_groups(self, bits, group_size):
        """split_k = 3 partial sums; block_k = 128 over groups of 32 (four chunks per K step) with
        K = 352, so the last step holds three groups only."""
        impl = self.implementation
        rng = np.random.default_rng(6)
        config = MatmulConfig(16, 32, 128, 1, 4, 2, split_k=3)
        _check(impl, *_inputs(rng, 20, 48, 352, bits, group_size), bits, group_size, config=config)

    @pytest.mark.parametrize("bits,group_size", [(8, None), (4, 32)])
    def test_gradients_of_a_and_scales(self, bits, group_size):
        impl = self.implementation
        rng = np.random.default_rng(8 + bits)
        a, qweight, scales = _inputs(rng, 24, 40, 96, bits, group_size)
        cotangent = random(rng, (24, 40), jnp.bfloat16)

        def ours(a, scales):
            return jattn.mixed_matmul(a, qweight, scales, bits=bits, group_size=group_size,
                                      config=SMALL, implementation=impl)

        def reference(a, scales, qweight, cotangent):
            fn = functools.partial(mixed_matmul_reference, qweight=qweight, bits=bits,
                                   group_size=group_size)
            return random_cotangent_vjp(lambda a, s: fn(a, scales=s), (a, scales), cotangent)

        grads = jax.jit(lambda a, s: random_cotangent_vjp(ours, (a, s), cotangent))(a, scales)
        args = (a, scales, qweight, cotangent)
        gold, low = golden(reference, *args), low_precision(reference, *args)
        for what, g, gg, lg in zip(("d_a", "d_scales"), grads, gold, low):
            assert g.dtype == (a.dtype if what == "d_a" else scales.dtype)
            assert_close(g, gg, lg, what=what)


class TestXla(MixedMatmulBackendTests):
    implementation = "xla"


class TestInterpret(MixedMatmulBackendTests):
    implementation = "interpret"


@pytest.mark.gpu
class TestPallasTriton(MixedMatmulBackendTests):
    implementation = "pallas_triton"
