"""scaled_matmul (fp8) against a float64 golden: values, no gradient, CUDA lowering, bad input."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.gemm import pallas_triton
from jattn._src.gemm.config import MatmulConfig, heuristic_config
from jattn._src.gemm.reference import scaled_matmul_reference
from tests.helpers import assert_close, golden, low_precision, lower_for_cuda, random

# Small tiles so that test shapes span several programs, ragged edges and a K tail.
SMALL = jattn.MatmulConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4,
                           num_stages=2)
FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]
OUT_DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def _scales(rng, m, n, mode):
    """(scale_a, scale_b) float32, tensor-wise scalars or row-wise [M] and [N], never 1."""
    if mode == "tensor":
        return jnp.float32(rng.uniform(0.5, 2)), jnp.float32(rng.uniform(0.5, 2))
    return (jnp.asarray(rng.uniform(0.5, 2, m), jnp.float32),
            jnp.asarray(rng.uniform(0.5, 2, n), jnp.float32))


def _inputs(rng, m, n, k, dtype, mode, with_bias=True):
    a, b = random(rng, (m, k), dtype), random(rng, (k, n), dtype)
    bias = random(rng, (n,), jnp.float32) if with_bias else None
    return a, b, *_scales(rng, m, n, mode), bias


def _check(impl, a, b, scale_a, scale_b, bias, out_dtype, **kwargs):
    run = functools.partial(jattn.scaled_matmul, out_dtype=out_dtype, implementation=impl,
                            **kwargs)
    out = jax.jit(lambda *x: run(*x[:4], bias=x[4]))(a, b, scale_a, scale_b, bias)
    assert out.shape == (a.shape[0], b.shape[1]) and out.dtype == out_dtype
    reference = lambda *x: scaled_matmul_reference(*x[:4], bias=x[4], out_dtype=out_dtype)
    args = (a, b, scale_a, scale_b, bias)
    # fp8 upcasts exactly, so the float64 golden sees the very values the kernel multiplies.
    assert_close(out, golden(reference, *args), low_precision(reference, *args))


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_gradient_raises(impl):
    rng = np.random.default_rng(4)
    a, b, scale_a, scale_b, bias = _inputs(rng, 32, 16, 32, jnp.float8_e4m3fn, "row")
    cotangent = random(rng, (32, 16), jnp.bfloat16)

    def f(a, b, bias):
        return jattn.scaled_matmul(a, b, scale_a, scale_b, bias=bias, config=SMALL,
                                   implementation=impl)

    out, vjp = jax.vjp(f, a, b, bias)  # the forward itself is fine
    assert out.shape == (32, 16)
    with pytest.raises(NotImplementedError, match="scaled_matmul is a forward .* differentiate "
                                                  "jattn.matmul on the dequantised operands"):
        vjp(cotangent)


# ------------------------------------------------------------------------------------------------
# Lowering for CUDA (no GPU needed)
# ------------------------------------------------------------------------------------------------

def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("m,n,k,dtype,scale_shapes,config", [
    (8192, 8192, 8192, jnp.float8_e4m3fn, ((1, 1), (1, 1)),
     MatmulConfig(128, 256, 128, 1, 8, 3)),
    (8192, 8192, 8192, jnp.float8_e4m3fn, ((8192, 1), (1, 8192)),
     MatmulConfig(128, 256, 128, 1, 8, 3)),
    (1000, 1030, 520, jnp.float8_e5m2, ((1000, 1), (1, 1030)),       # ragged everything
     MatmulConfig(64, 128, 128, 8, 4, 3)),
])
def test_kernel_lowers(m, n, k, dtype, scale_shapes, config):
    fn = functools.partial(pallas_triton.scaled_matmul, config=config, out_dtype=jnp.bfloat16)
    text = lower_for_cuda(fn, _spec((m, k), dtype), _spec((k, n), dtype),
                          _spec(scale_shapes[0], jnp.float32), _spec(scale_shapes[1], jnp.float32),
                          _spec((n,), jnp.float32))
    assert "triton" in text and "jattn_scaled_matmul" in text


@pytest.mark.parametrize("m,n,k", [(8192, 8192, 8192), (1000, 1030, 520), (16, 8192, 8192),
                                   (1, 80, 96)])
def test_heuristic_configs_lower(m, n, k):
    """The API's default configs at fp8, run unsplit as the API runs them."""
    config = dataclasses.replace(heuristic_config(m, n, k, jnp.float8_e4m3fn), split_k=1)
    fn = functools.partial(pallas_triton.scaled_matmul, bias=None, config=config,
                           out_dtype=jnp.float16)
    text = lower_for_cuda(fn, _spec((m, k), jnp.float8_e4m3fn), _spec((k, n), jnp.float8_e4m3fn),
                          _spec((m, 1), jnp.float32), _spec((1, 1), jnp.float32))
    assert "jattn_scaled_matmul" in text


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------

def _fp8(shape, dtype=jnp.float8_e4m3fn):
    return jnp.ones(shape, dtype)


@pytest.mark.parametrize("args,error,match", [
    ((jnp.ones((4, 8), jnp.bfloat16), _fp8((8, 5))), TypeError,
     "`a` has dtype bfloat16; it must be float8_e4m3fn or float8_e5m2"),
    ((_fp8((4, 8)), _fp8((8, 5), jnp.float8_e5m2)), TypeError,
     "`a` and `b` must have the same fp8 dtype, got float8_e4m3fn and float8_e5m2"),
    ((_fp8((4, 8)), _fp8((7, 5))), ValueError,
     "inner dimensions differ: a \\(4, 8\\) has K=8 but b \\(7, 5\\) has K=7"),
    ((_fp8((2, 4, 8)), _fp8((8, 5))), ValueError, "`a` must be a 2-D matrix, got shape"),
])
def test_bad_operands_raise(args, error, match):
    with pytest.raises(error, match=match):
        jattn.scaled_matmul(*args, jnp.float32(1), jnp.float32(1), implementation="xla")


@pytest.mark.parametrize("scale_a,scale_b,error,match", [
    (jnp.ones(5), jnp.float32(1), ValueError,
     "`scale_a` has shape \\(5,\\); expected a scalar \\(tensor-wise\\) or \\(4,\\) or "
     "\\(4, 1\\) \\(row-wise, one scale per row of a\\)"),
    (jnp.float32(1), jnp.ones((5, 1)), ValueError,
     "`scale_b` has shape \\(5, 1\\); expected a scalar .* or \\(5,\\) or \\(1, 5\\)"),
    (jnp.ones(4, jnp.bfloat16), jnp.float32(1), TypeError,
     "`scale_a` must be float32, got bfloat16"),
])
def test_bad_scales_raise(scale_a, scale_b, error, match):
    with pytest.raises(error, match=match):
        jattn.scaled_matmul(_fp8((4, 8)), _fp8((8, 5)), scale_a, scale_b, implementation="xla")


def test_bad_options_raise():
    a, b, one = _fp8((4, 8)), _fp8((8, 5)), jnp.float32(1)
    with pytest.raises(TypeError, match="`out_dtype`=float8_e4m3fn is not supported"):
        jattn.scaled_matmul(a, b, one, one, out_dtype=jnp.float8_e4m3fn, implementation="xla")
    with pytest.raises(ValueError, match="`bias` must have shape \\(5,\\)"):
        jattn.scaled_matmul(a, b, one, one, bias=jnp.ones(4), implementation="xla")
    with pytest.raises(ValueError, match="config.split_k=2 is not supported"):
        jattn.scaled_matmul(a, b, one, one, config=MatmulConfig(split_k=2),
                            implementation="interpret")
    with pytest.raises(TypeError, match="`use_fast_accum` must be a bool"):
        jattn.scaled_matmul(a, b, one, one, use_fast_accum="yes", implementation="xla")


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,dtype,mode", [
    (1024, 1024, 1024, jnp.float8_e4m3fn, "tensor"),
    (1024, 1024, 1024, jnp.float8_e4m3fn, "row"),
    (1000, 1030, 520, jnp.float8_e5m2, "row"),
    (16, 2048, 2048, jnp.float8_e4m3fn, "tensor"),   # decode-shaped: split-K is dropped
    (4096, 4096, 4096, jnp.float8_e4m3fn, "row"),
])
@pytest.mark.parametrize("fast", [False, True])
def test_default_configs_on_gpu(m, n, k, dtype, mode, fast):
    rng = np.random.default_rng(m + n + k)
    _check("pallas_triton", *_inputs(rng, m, n, k, dtype, mode), jnp.bfloat16,
           use_fast_accum=fast)


class ScaledMatmulBackendTests:
    """What every `scaled_matmul` backend must do: each backend's class below names it, and a new
    backend is one more class."""

    implementation: str

    @pytest.mark.parametrize("dtype", FP8)
    @pytest.mark.parametrize("mode", ["tensor", "row"])
    @pytest.mark.parametrize("m,n,k", [(70, 50, 90), (1, 17, 33)])
    def test_matches_golden(self, dtype, mode, m, n, k):
        impl = self.implementation
        rng = np.random.default_rng(m + n + k)
        _check(impl, *_inputs(rng, m, n, k, dtype, mode), jnp.bfloat16, config=SMALL)

    @pytest.mark.parametrize("out_dtype", OUT_DTYPES)
    def test_each_out_dtype_without_bias(self, out_dtype):
        impl = self.implementation
        rng = np.random.default_rng(1)
        _check(impl, *_inputs(rng, 40, 48, 72, jnp.float8_e4m3fn, "row", with_bias=False),
               out_dtype, config=SMALL)

    def test_mixed_scale_modes_and_2d_scales(self):
        """scale_a row-wise as [M, 1] with a tensor-wise scale_b of shape (1,), and the reverse."""
        impl = self.implementation
        rng = np.random.default_rng(2)
        a, b, row_a, row_b, bias = _inputs(rng, 36, 40, 48, jnp.float8_e5m2, "row")
        one = jnp.asarray([0.75], jnp.float32)
        _check(impl, a, b, row_a.reshape(-1, 1), one, bias, jnp.float32, config=SMALL)
        _check(impl, a, b, one.reshape(()), row_b.reshape(1, -1), bias, jnp.float32, config=SMALL)

    def test_both_accumulation_modes_match_golden(self):
        """use_fast_accum changes the GPU kernel's fp8 accumulation only (see the docstring): both
        modes meet the golden tolerance; the xla and interpret paths give equal results."""
        impl = self.implementation
        rng = np.random.default_rng(3)
        args = _inputs(rng, 64, 32, 256, jnp.float8_e4m3fn, "tensor")
        outs = []
        for fast in (False, True):
            _check(impl, *args, jnp.float32, config=SMALL, use_fast_accum=fast)
            outs.append(jattn.scaled_matmul(*args[:4], bias=args[4], out_dtype=jnp.float32,
                                            config=SMALL, use_fast_accum=fast, implementation=impl))
        if impl != "pallas_triton":
            np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))


class TestXla(ScaledMatmulBackendTests):
    implementation = "xla"


class TestInterpret(ScaledMatmulBackendTests):
    implementation = "interpret"


@pytest.mark.gpu
class TestPallasTriton(ScaledMatmulBackendTests):
    implementation = "pallas_triton"
