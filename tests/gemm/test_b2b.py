"""b2b_matmul against a float64 golden: both sides, gradients, the fallback, lowering, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.gemm import pallas_triton_b2b
from jattn._src.gemm.config import heuristic_b2b_config
from jattn._src.gemm.reference import b2b_reference
from jattn._src.user_functions import trace_with_captures
from tests.helpers import (assert_bitwise_equal_runs, assert_close, assert_gradients_close, golden,
                           low_precision, lower_for_cuda, random, random_cotangent_vjp)

# Small tiles: several programs, several intermediate chunks, ragged edges everywhere.
SMALL = jattn.B2BConfig(block_out=16, block_inner=32, block_k=32, num_warps=4, num_stages=2)


def _gauss(x):
    return jnp.exp(-0.1 * x * x)  # fn(0) = 1: the padding of a ragged chunk must be dropped


def _shapes(side, m, k, p, n):
    """Operand shapes for out [m, n], contraction k, intermediate width p."""
    return [(m, k), (k, p), (p, n)] if side == "left" else [(m, p), (p, k), (k, n)]


def _config(impl):
    return None if impl == "xla" else SMALL


def _check_gradients(impl, side, dtype, m, k, p, n, config):
    rng = np.random.default_rng(7)
    a, b, c = (random(rng, s, dtype, scale=0.5) for s in _shapes(side, m, k, p, n))
    scale = jnp.float32(1.3)
    cotangent = random(rng, (m, n), dtype)

    def ours(a, b, c, scale):
        return jattn.b2b_matmul(a, b, c, lambda x: jnp.tanh(x) * scale, side=side,
                                config=config, implementation=impl)

    def reference(a, b, c, scale):
        return b2b_reference(a, b, c, lambda x: jnp.tanh(x) * scale, side=side)

    args = (a, b, c, scale)
    out = jax.jit(ours)(*args)
    assert_close(out, golden(reference, *args), low_precision(reference, *args))
    assert_gradients_close(ours, reference, args, cotangent, "a b c scale".split())


@pytest.mark.parametrize("side", ["left", "right"])
def test_wide_output_falls_back_to_two_matmuls(side):
    """A held side over 256 (N for left, M for right) runs as two matmuls, same values."""
    m, n = (20, 300) if side == "left" else (300, 20)
    _check_gradients("interpret", side, jnp.bfloat16, m, 16, 24, n, None)


def test_leading_dims_of_a():
    rng = np.random.default_rng(4)
    a, b, c = random(rng, (2, 3, 10, 16)), random(rng, (16, 40)), random(rng, (40, 24))
    out = jattn.b2b_matmul(a, b, c, jnp.tanh, config=SMALL, implementation="interpret")
    assert out.shape == (2, 3, 10, 24)
    reference = functools.partial(b2b_reference, fn=jnp.tanh)
    assert_close(out, golden(reference, a, b, c), low_precision(reference, a, b, c))


# ------------------------------------------------------------------------------------------------
# Lowering for CUDA (no GPU needed)
# ------------------------------------------------------------------------------------------------

def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("m,k,p,n,dtype", [
    (8192, 128, 8192, 128, jnp.bfloat16),   # the benchmark shape (K = 128: one hoisted step)
    (1000, 300, 520, 200, jnp.float16),     # ragged everything, K in steps, 8 warps
])
def test_heuristic_configs_lower(side, m, k, p, n, dtype):
    if side == "right":
        m, n = n, m  # the held side (N for left, M for right) stays within the kernel's limit
    outer, held = (m, n) if side == "left" else (n, m)
    config = heuristic_b2b_config(outer, held, p, k, dtype)
    tile = (config.block_out, config.block_inner)
    tile = tile if side == "left" else tile[::-1]
    shift = jnp.float32(0.25)
    (fn,), captures = trace_with_captures(lambda x: jax.nn.gelu(x, approximate=True) + shift,
                                          (_spec(tile, jnp.float32),))
    kernel = functools.partial(pallas_triton_b2b.b2b, side=side, config=config, fn=fn)
    text = lower_for_cuda(lambda a, b, c, caps: kernel(a, b, c, caps),
                          *(_spec(s, dtype) for s in _shapes(side, m, k, p, n)), captures)
    assert "triton" in text and f"jattn_b2b_{side}" in text


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("side,shapes,match", [
    ("left", [(4, 8), (7, 6), (6, 5)], "inner dimensions differ: a \\(4, 8\\) has K=8 but "
                                       "b \\(7, 6\\) has K=7"),
    ("left", [(4, 8), (8, 6), (5, 5)], "inner dimensions differ: b \\(8, 6\\) has K=6 but "
                                       "c \\(5, 5\\) has K=5"),
    ("right", [(4, 9), (8, 6), (6, 5)], "inner dimensions differ: a \\(4, 9\\) has K=9 but "
                                        "b \\(8, 6\\) has K=8"),
    ("left", [(4, 8), (2, 8, 6), (6, 5)], "`b` must be a 2-D matrix, got shape \\(2, 8, 6\\)"),
    ("right", [(8,), (8, 6), (6, 5)], "`a` must have rank >= 2, got shape \\(8,\\)"),
])
def test_shapes_that_do_not_chain_raise(side, shapes, match):
    with pytest.raises(ValueError, match=match):
        jattn.b2b_matmul(*(jnp.ones(s) for s in shapes), side=side, implementation="xla")


def test_bad_arguments_raise():
    a, b, c = jnp.ones((4, 8)), jnp.ones((8, 6)), jnp.ones((6, 5))
    with pytest.raises(ValueError, match="`side` must be 'left' or 'right', got 'middle'"):
        jattn.b2b_matmul(a, b, c, side="middle")
    with pytest.raises(TypeError, match="`fn` must be callable or None, got str"):
        jattn.b2b_matmul(a, b, c, "gelu")
    with pytest.raises(TypeError, match="`b` and `c` must have the same dtype, got float32 and "
                                        "bfloat16"):
        jattn.b2b_matmul(a, b, c.astype(jnp.bfloat16), implementation="xla")
    with pytest.raises(TypeError, match="`a` has dtype int32"):
        jattn.b2b_matmul(a.astype(jnp.int32), b, c, implementation="xla")
    with pytest.raises(ValueError, match="`fn` must be elementwise.*input \\[4, 6\\]; it "
                                         "returned float32\\[6\\]"):
        jattn.b2b_matmul(a, b, c, lambda x: x.sum(0), implementation="interpret")
    with pytest.raises(TypeError, match="`config` must be a B2BConfig or None"):
        jattn.b2b_matmul(a, b, c, config=jattn.MatmulConfig())
    with pytest.raises(ValueError, match="holds the whole N=300 side.*at most 256"):
        jattn.b2b_matmul(a, b, jnp.ones((6, 300)), config=SMALL, implementation="interpret")
    with pytest.raises(ValueError, match="B2BConfig.block_inner=24 must be a power of two"):
        jattn.B2BConfig(block_inner=24)


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("m,k,p,n,dtype", [
    (2048, 128, 4096, 128, jnp.bfloat16),
    (1000, 300, 520, 200, jnp.float16),
    (512, 64, 1024, 256, jnp.float32),
])
def test_default_configs_on_gpu(side, m, k, p, n, dtype):
    if side == "right":
        m, n = n, m  # keep the held side (M for right) within the kernel's limit
    rng = np.random.default_rng(m + k + p + n)
    a, b, c = (random(rng, s, dtype, scale=0.3) for s in _shapes(side, m, k, p, n))
    gelu = functools.partial(jax.nn.gelu, approximate=True)
    out = jax.jit(functools.partial(jattn.b2b_matmul, fn=gelu, side=side,
                                    implementation="pallas_triton"))(a, b, c)
    reference = functools.partial(b2b_reference, fn=gelu, side=side)
    assert_close(out, golden(reference, a, b, c), low_precision(reference, a, b, c))


@pytest.mark.gpu
@pytest.mark.parametrize("side", ["left", "right"])
def test_gradients_on_gpu(side):
    _check_gradients("pallas_triton", side, jnp.bfloat16, 256, 128, 1000, 96, None)


class B2bMatmulBackendTests:
    """What every `b2b_matmul` backend must do: each backend's class below names it, and a new
    backend is one more class."""

    implementation: str

    @pytest.mark.parametrize("side", ["left", "right"])
    @pytest.mark.parametrize("dtype,fn,m,k,p,n", [
        (jnp.bfloat16, _gauss, 37, 50, 70, 45),  # K in two steps, ragged P chunk, ragged tiles
        (jnp.float32, None, 1, 20, 33, 17),      # one K step (operand hoisted), a single row
    ])
    def test_matches_golden(self, side, dtype, fn, m, k, p, n):
        impl = self.implementation
        rng = np.random.default_rng(m + k + p + n)
        a, b, c = (random(rng, s, dtype, scale=0.5) for s in _shapes(side, m, k, p, n))
        ours = functools.partial(jattn.b2b_matmul, fn=fn, side=side, config=_config(impl),
                                 implementation=impl)
        out = jax.jit(ours)(a, b, c)
        assert out.shape == (m, n) and out.dtype == dtype
        reference = functools.partial(b2b_reference, fn=fn, side=side)
        assert_close(out, golden(reference, a, b, c), low_precision(reference, a, b, c))

    @pytest.mark.parametrize("side", ["left", "right"])
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
    def test_gradients_with_captured_scale(self, side, dtype):
        """Random-cotangent gradients for a, b, c and a scalar fn closes over."""
        impl = self.implementation
        _check_gradients(impl, side, dtype, 40, 24, 50, 30, _config(impl))

    def test_gradients_are_deterministic(self):
        impl = self.implementation
        rng = np.random.default_rng(3)
        a, b, c = (random(rng, s, jnp.bfloat16) for s in _shapes("left", 48, 40, 64, 32))
        cotangent = random(rng, (48, 32), jnp.bfloat16)
        ours = functools.partial(jattn.b2b_matmul, fn=jnp.tanh, config=_config(impl),
                                 implementation=impl)
        fn = jax.jit(lambda *x: random_cotangent_vjp(ours, x, cotangent))
        assert_bitwise_equal_runs(lambda: fn(a, b, c))


class TestXla(B2bMatmulBackendTests):
    implementation = "xla"


class TestInterpret(B2bMatmulBackendTests):
    implementation = "interpret"


@pytest.mark.gpu
class TestPallasTriton(B2bMatmulBackendTests):
    implementation = "pallas_triton"
