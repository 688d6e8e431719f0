"""mm_plus_mm against a float64 golden: values, gradients, CUDA lowering, bad input, the GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.gemm import pallas_triton
from jattn._src.gemm.config import MatmulConfig
from jattn._src.gemm.reference import mm_plus_mm_reference
from jattn._src.user_functions import trace_with_captures
from tests.helpers import (assert_bitwise_equal_runs, assert_close, assert_gradients_close, golden,
                           low_precision, lower_for_cuda, random, random_cotangent_vjp)

# Small tiles so that test shapes span several programs, ragged edges and K tails on both halves.
SMALL = jattn.MatmulConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4,
                           num_stages=2)


def _gelu(x):
    return jax.nn.gelu(x, approximate=True)


def _operands(rng, m, n, k1, k2, dtype, lead=()):
    return (random(rng, (*lead, m, k1), dtype), random(rng, (k1, n), dtype),
            random(rng, (*lead, m, k2), dtype), random(rng, (k2, n), dtype))


# ------------------------------------------------------------------------------------------------
# Lowering for CUDA (no GPU needed)
# ------------------------------------------------------------------------------------------------

def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("m,n,k1,k2,dtype,config", [
    (4096, 4096, 4096, 1024, jnp.bfloat16, MatmulConfig(128, 256, 64, 1, 8, 3)),
    (1000, 1030, 520, 72, jnp.float16, MatmulConfig(64, 128, 64, 8, 4, 3)),  # ragged everything
])
def test_kernel_lowers(m, n, k1, k2, dtype, config):
    fn = functools.partial(pallas_triton.mm_plus_mm, bias=None, captures=(), config=config,
                           out_dtype=dtype)
    text = lower_for_cuda(fn, _spec((m, k1), dtype), _spec((k1, n), dtype),
                          _spec((m, k2), dtype), _spec((k2, n), dtype))
    assert "triton" in text and "jattn_mm_plus_mm" in text


def test_kernel_with_bias_and_captured_epilogue_lowers():
    config = MatmulConfig(block_m=64, block_n=128, block_k=64)
    scale = jnp.float32(0.5)
    signature = (_spec((64, 128), jnp.float32), _spec((64, 1), jnp.int32),
                 _spec((1, 128), jnp.int32))
    (on_tile,), captures = trace_with_captures(lambda x, r, c: _gelu(x) * scale, signature)
    fn = functools.partial(pallas_triton.mm_plus_mm, config=config, out_dtype=jnp.bfloat16,
                           epilogue=on_tile, save_preact=True)
    dt = jnp.bfloat16
    text = lower_for_cuda(lambda a, b, c, d, bias, caps: fn(a, b, c, d, bias, caps),
                          _spec((333, 250), dt), _spec((250, 515), dt), _spec((333, 100), dt),
                          _spec((100, 515), dt), _spec((515,), jnp.float32), captures)
    assert "jattn_mm_plus_mm" in text


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shapes,error,match", [
    (((4, 8), (8, 5), (4, 6), (7, 5)), ValueError,
     "inner dimensions differ: c \\(4, 6\\) has K=6 but d \\(7, 5\\) has K=7"),
    (((4, 8), (8, 5), (3, 6), (6, 5)), ValueError,
     "`a` \\(4, 8\\) and `c` \\(3, 6\\) must agree in every dim but the last"),
    (((4, 8), (8, 5), (4, 6), (6, 7)), ValueError,
     "`b` \\(8, 5\\) and `d` \\(6, 7\\) must have the same number of columns"),
    (((4, 8), (8, 5), (4, 6), (2, 6, 5)), ValueError, "`d` must be a \\[K, N\\] matrix"),
    (((4, 8), (8, 5), (6,), (6, 5)), ValueError, "`c` must have rank >= 2, got shape \\(6,\\)"),
])
def test_bad_shapes_raise(shapes, error, match):
    with pytest.raises(error, match=match):
        jattn.mm_plus_mm(*(jnp.ones(s) for s in shapes), implementation="xla")


def test_bad_dtypes_and_options_raise():
    a, b = jnp.ones((4, 8)), jnp.ones((8, 5))
    c, d = jnp.ones((4, 6), jnp.bfloat16), jnp.ones((6, 5), jnp.bfloat16)
    with pytest.raises(TypeError, match="`a` and `c` must have the same dtype, got float32 and "
                                        "bfloat16"):
        jattn.mm_plus_mm(a, b, c, d, implementation="xla")
    with pytest.raises(TypeError, match="`c` and `d` must have the same dtype"):
        jattn.mm_plus_mm(a, b, c.astype(jnp.float32), d, implementation="xla")
    with pytest.raises(ValueError, match="`bias` must have shape \\(5,\\)"):
        jattn.mm_plus_mm(a, b, a, b, bias=jnp.ones(4), implementation="xla")
    with pytest.raises(ValueError, match="config.split_k=2 is not supported"):
        jattn.mm_plus_mm(a, b, a, b, config=MatmulConfig(split_k=2), implementation="interpret")
    with pytest.raises(TypeError, match="`epilogue` must be callable"):
        jattn.mm_plus_mm(a, b, a, b, epilogue="gelu", implementation="xla")


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k1,k2,dtype", [
    (1024, 1024, 1024, 512, jnp.bfloat16),
    (1000, 1030, 520, 72, jnp.float16),
    (16, 2048, 2048, 2048, jnp.bfloat16),   # decode-shaped: the heuristic's split-K is dropped
    (512, 768, 640, 384, jnp.float32),
])
def test_default_configs_on_gpu(m, n, k1, k2, dtype):
    rng = np.random.default_rng(m + n + k1 + k2)
    operands = _operands(rng, m, n, k1, k2, dtype)
    bias = random(rng, (n,), jnp.float32)
    out = jax.jit(functools.partial(jattn.mm_plus_mm, bias=bias, epilogue=_gelu,
                                    implementation="pallas_triton"))(*operands)
    reference = lambda *x: mm_plus_mm_reference(*x[:4], bias=x[4], epilogue=_gelu)
    assert_close(out, golden(reference, *operands, bias),
                 low_precision(reference, *operands, bias))


class MmPlusMmBackendTests:
    """What every `mm_plus_mm` backend must do: each backend's class below names it, and a new
    backend is one more class."""

    implementation: str

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
    @pytest.mark.parametrize("m,n,k1,k2", [(70, 50, 40, 90), (1, 17, 33, 16)])
    def test_matches_golden(self, dtype, m, n, k1, k2):
        impl = self.implementation
        rng = np.random.default_rng(m + n + k1 + k2)
        operands = _operands(rng, m, n, k1, k2, dtype)
        out = jax.jit(functools.partial(jattn.mm_plus_mm, config=SMALL,
                                        implementation=impl))(*operands)
        assert out.shape == (m, n) and out.dtype == dtype
        assert_close(out, golden(mm_plus_mm_reference, *operands),
                     low_precision(mm_plus_mm_reference, *operands))

    def test_leading_dims_bias_epilogue_out_dtype(self):
        impl = self.implementation
        rng = np.random.default_rng(1)
        operands = _operands(rng, 20, 40, 24, 56, jnp.bfloat16, lead=(2, 3))
        bias = random(rng, (40,), jnp.float32)
        fn = functools.partial(jattn.mm_plus_mm, bias=bias, epilogue=_gelu, out_dtype=jnp.float32,
                               config=SMALL, implementation=impl)
        out = jax.jit(fn)(*operands)
        assert out.shape == (2, 3, 20, 40) and out.dtype == jnp.float32
        reference = lambda *x: mm_plus_mm_reference(*x[:4], bias=x[4], epilogue=_gelu,
                                                    out_dtype=jnp.float32)
        assert_close(out, golden(reference, *operands, bias),
                     low_precision(reference, *operands, bias))

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
    def test_gradients_with_bias_and_captured_scale(self, dtype):
        """Random-cotangent gradients for a, b, c, d, bias and a scalar the epilogue closes over."""
        impl = self.implementation
        rng = np.random.default_rng(2)
        operands = _operands(rng, 50, 36, 40, 20, dtype)
        bias, scale = random(rng, (36,), jnp.float32), jnp.float32(1.7)
        cotangent = random(rng, (50, 36), dtype)

        def ours(a, b, c, d, bias, scale):
            return jattn.mm_plus_mm(a, b, c, d, bias=bias, epilogue=lambda x: jnp.tanh(x) * scale,
                                    config=SMALL, implementation=impl)

        def reference(a, b, c, d, bias, scale):
            return mm_plus_mm_reference(a, b, c, d, bias=bias,
                                        epilogue=lambda x: jnp.tanh(x) * scale)

        args = (*operands, bias, scale)
        assert_gradients_close(ours, reference, args, cotangent, "a b c d bias scale".split())

    def test_gradients_are_deterministic(self):
        impl = self.implementation
        rng = np.random.default_rng(3)
        operands = _operands(rng, 64, 40, 48, 80, jnp.bfloat16)
        cotangent = random(rng, (64, 40), jnp.bfloat16)
        ours = functools.partial(jattn.mm_plus_mm, epilogue=_gelu, config=SMALL,
                                 implementation=impl)
        fn = jax.jit(lambda *x: random_cotangent_vjp(ours, x, cotangent))
        assert_bitwise_equal_runs(lambda: fn(*operands))


class TestXla(MmPlusMmBackendTests):
    implementation = "xla"


class TestInterpret(MmPlusMmBackendTests):
    implementation = "interpret"


@pytest.mark.gpu
class TestPallasTriton(MmPlusMmBackendTests):
    implementation = "pallas_triton"
