"""GEMM correctness against a float64 golden, gradients, transformations and bad input."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.gemm.reference import matmul_reference
from tests.helpers import (assert_bitwise_equal_runs, assert_close, golden, low_precision, random,
                           random_cotangent_vjp)

# Small tiles so that test shapes span several programs, ragged edges and the group_m walk.
SMALL = jattn.MatmulConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4,
                           num_stages=2)
SPLIT = jattn.MatmulConfig(block_m=16, block_n=32, block_k=32, group_m=1, num_warps=4,
                           num_stages=2, split_k=3)
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def _check_matmul(impl, a, b, *, config=SMALL, **kwargs):
    out = jax.jit(functools.partial(jattn.matmul, config=config, implementation=impl,
                                    **kwargs))(a, b)
    assert out.dtype == (kwargs.get("out_dtype") or a.dtype)
    ref_kwargs = {k: v for k, v in kwargs.items() if k != "bias"}
    reference = lambda a, b, bias: matmul_reference(a, b, bias=bias, **ref_kwargs)
    args = (a, b, kwargs.get("bias"))
    assert_close(out, golden(reference, *args), low_precision(reference, *args))
    return out


def _gelu(x):
    return jax.nn.gelu(x, approximate=True)


def _column_gate(x, rows, cols):
    return jnp.where(cols % 3 == 0, x, 0.5 * x) + 0.01 * rows


def test_nan_propagates():
    a = jnp.ones((32, 32)).at[3, 5].set(jnp.nan)
    out = jattn.matmul(a, jnp.ones((32, 32)), config=SMALL, implementation="interpret")
    assert np.isnan(np.asarray(out[3])).all() and not np.isnan(np.asarray(out[4])).any()


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("a_shape,b_shape,match", [
    ((8,), (8, 4), "`a` must have rank >= 2, got shape \\(8,\\)"),
    ((4, 8), (7, 4), "inner dimensions differ: a \\(4, 8\\) has K=8 but b \\(7, 4\\) has K=7"),
    ((4, 8), (2, 8, 4), "use jattn.bmm"),
])
def test_bad_shapes_raise(a_shape, b_shape, match):
    with pytest.raises(ValueError, match=match):
        jattn.matmul(jnp.ones(a_shape), jnp.ones(b_shape), implementation="xla")


def test_bad_dtypes_raise():
    with pytest.raises(TypeError, match="`a` has dtype int32"):
        jattn.matmul(jnp.ones((4, 8), jnp.int32), jnp.ones((8, 4), jnp.int32))
    with pytest.raises(TypeError, match="same dtype, got bfloat16 and float32"):
        jattn.matmul(jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 4)))
    with pytest.raises(TypeError, match="`out_dtype`=int8"):
        jattn.matmul(jnp.ones((4, 8)), jnp.ones((8, 4)), out_dtype=jnp.int8)


def test_bad_bias_raises():
    with pytest.raises(ValueError, match="`bias` must have shape \\(4,\\).*got \\(8,\\)"):
        jattn.matmul(jnp.ones((4, 8)), jnp.ones((8, 4)), bias=jnp.ones(8))


def test_bmm_batch_mismatch_raises():
    with pytest.raises(ValueError, match="batch dims of a \\(2, 4, 8\\) and b \\(3, 8, 4\\)"):
        jattn.bmm(jnp.ones((2, 4, 8)), jnp.ones((3, 8, 4)))


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_bad_epilogues_raise(impl):
    a, b = jnp.ones((4, 8)), jnp.ones((8, 4))
    with pytest.raises(ValueError, match="shaped like its input \\[4, 4\\]; it returned "
                                         "float32\\[4\\]"):
        jattn.matmul(a, b, epilogue=lambda x: x.sum(0), implementation=impl)
    with pytest.raises(TypeError, match="take \\(x\\) or \\(x, rows, cols\\)"):
        jattn.matmul(a, b, epilogue=lambda x, y: x, implementation=impl)
    with pytest.raises(TypeError, match="`epilogue` must be callable"):
        jattn.matmul(a, b, epilogue=3, implementation=impl)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_m=48), "block_m=48 must be a power of two >= 16"),
    (dict(block_k=8), "block_k=8 must be a power of two >= 16"),
    (dict(num_warps=3), "num_warps=3 must be 1, 2, 4, 8 or 16"),
    (dict(split_k=0), "split_k=0 must be a positive int"),
])
def test_invalid_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jattn.MatmulConfig(**kwargs)


def test_config_of_wrong_type_raises():
    with pytest.raises(TypeError, match="`config` must be a MatmulConfig .*, a "
                                        "MosaicMatmulConfig .*, None or 'autotune'"):
        jattn.matmul(jnp.ones((4, 8)), jnp.ones((8, 4)), config=(64, 64, 32))


class MatmulBackendTests:
    """What every `matmul` backend must do: each backend's class below names it, and a new backend
    is one more class."""

    implementation: str

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("m,n,k", [(64, 64, 64), (100, 70, 90), (16, 48, 300), (1, 17, 33)])
    def test_matches_golden(self, dtype, m, n, k):
        impl = self.implementation
        rng = np.random.default_rng(m * n + k)
        out = _check_matmul(impl, random(rng, (m, k), dtype), random(rng, (k, n), dtype))
        assert out.shape == (m, n) and out.dtype == dtype

    @pytest.mark.parametrize("group_m", [1, 3])
    def test_tile_orders(self, group_m):
        """group_m == 1 runs a 2-D grid; group_m == 3 leaves a ragged last group of row tiles."""
        impl = self.implementation
        rng = np.random.default_rng(group_m)
        config = dataclasses.replace(SMALL, group_m=group_m)
        _check_matmul(impl, random(rng, (150, 100), jnp.float16),
                      random(rng, (100, 70), jnp.float16),
                      config=config)

    @pytest.mark.parametrize("epilogue,takes_indices", [(_gelu, False), (_column_gate, True),
                                                        (jnp.tanh, False)])
    def test_bias_and_epilogue(self, epilogue, takes_indices):
        impl = self.implementation
        rng = np.random.default_rng(1)
        a, b = random(rng, (70, 48), jnp.bfloat16), random(rng, (48, 90), jnp.bfloat16)
        bias = random(rng, (90,), jnp.float32)
        out = jax.jit(functools.partial(jattn.matmul, epilogue=epilogue, config=SMALL,
                                        implementation=impl))(a, b, bias=bias)
        kwargs = dict(epilogue=epilogue, epilogue_takes_indices=takes_indices)
        reference = lambda a, b, c: matmul_reference(a, b, bias=c, **kwargs)
        assert_close(out, golden(reference, a, b, bias), low_precision(reference, a, b, bias))

    def test_epilogue_looks_up_captured_vectors(self):
        """Per-column scale and per-row shift tables of non-power-of-two length, with gradients."""
        impl = self.implementation
        rng = np.random.default_rng(7)
        a, b = random(rng, (45, 40), jnp.float32), random(rng, (40, 70), jnp.float32)
        col_scale, row_shift = random(rng, (70,)), random(rng, (45,))
        cotangent = random(rng, (45, 70))

        def ours(a, b, col_scale, row_shift):
            return jattn.matmul(a, b, epilogue=lambda x, r, c: x * col_scale[c] + row_shift[r],
                                config=SMALL, implementation=impl)

        def reference(a, b, col_scale, row_shift):
            return matmul_reference(a, b, epilogue=lambda x, r, c: x * col_scale[c] + row_shift[r],
                                    epilogue_takes_indices=True)

        args = (a, b, col_scale, row_shift)
        assert_close(jax.jit(ours)(*args), golden(reference, *args),
                     low_precision(reference, *args))
        grads = jax.jit(lambda *x: random_cotangent_vjp(ours, x, cotangent))(*args)
        gold = golden(lambda *x: random_cotangent_vjp(reference, x[:4], x[4]), *args, cotangent)
        low = low_precision(lambda *x: random_cotangent_vjp(reference, x[:4], x[4]), *args,
                            cotangent)
        for name, g, g64, g_low in zip(("a", "b", "col_scale", "row_shift"), grads, gold, low):
            assert_close(g, g64, g_low, what=f"d{name}")

    def test_split_k_applies_bias_and_epilogue_after_the_sum(self):
        impl = self.implementation
        rng = np.random.default_rng(2)
        a, b = random(rng, (20, 200), jnp.float32), random(rng, (200, 40), jnp.float32)
        bias = random(rng, (40,), jnp.float32)
        _check_matmul(impl, a, b, config=SPLIT, bias=bias, epilogue=_gelu)

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
    def test_gradients_with_captured_scale(self, dtype):
        """Random-cotangent gradients for a, b, bias and a scalar the epilogue closes over."""
        impl = self.implementation
        rng = np.random.default_rng(3)
        a, b = random(rng, (50, 40), dtype), random(rng, (40, 36), dtype)
        bias, scale = random(rng, (36,), jnp.float32), jnp.float32(1.7)
        cotangent = random(rng, (50, 36), dtype)

        def ours(a, b, bias, scale):
            return jattn.matmul(a, b, bias=bias, epilogue=lambda x: jnp.tanh(x) * scale,
                                config=SMALL, implementation=impl)

        def reference(a, b, bias, scale):
            return matmul_reference(a, b, bias=bias, epilogue=lambda x: jnp.tanh(x) * scale)

        args = (a, b, bias, scale)
        grads = jax.jit(lambda *x: random_cotangent_vjp(ours, x, cotangent))(*args)
        gold = golden(lambda *x: random_cotangent_vjp(reference, x[:4], x[4]), *args, cotangent)
        low = low_precision(lambda *x: random_cotangent_vjp(reference, x[:4], x[4]), *args,
                            cotangent)
        for name, g, g64, g_low in zip(("a", "b", "bias", "scale"), grads, gold, low):
            assert g.dtype == jnp.asarray(args[("a", "b", "bias", "scale").index(name)]).dtype
            assert_close(g, g64, g_low, what=f"d{name}")

    def test_gradients_are_deterministic(self):
        impl = self.implementation
        rng = np.random.default_rng(4)
        a, b = random(rng, (64, 96), jnp.bfloat16), random(rng, (96, 40), jnp.bfloat16)
        cotangent = random(rng, (64, 40), jnp.bfloat16)
        fn = jax.jit(lambda a, b: random_cotangent_vjp(
            lambda a, b: jattn.matmul(a, b, epilogue=_gelu, config=SMALL, implementation=impl),
            (a, b), cotangent))
        assert_bitwise_equal_runs(lambda: fn(a, b))

    def test_leading_dims_vmap_and_out_dtype(self):
        impl = self.implementation
        rng = np.random.default_rng(5)
        a, b = random(rng, (2, 3, 20, 40), jnp.bfloat16), random(rng, (40, 24), jnp.bfloat16)
        fn = functools.partial(jattn.matmul, out_dtype=jnp.float32, config=SMALL,
                               implementation=impl)
        out = jax.jit(fn)(a, b)
        assert out.shape == (2, 3, 20, 24) and out.dtype == jnp.float32
        ref = functools.partial(matmul_reference, out_dtype=jnp.float32)
        assert_close(out, golden(ref, a, b), low_precision(ref, a, b))
        per_matrix = jax.vmap(jax.vmap(fn, in_axes=(0, None)), in_axes=(0, None))
        np.testing.assert_array_equal(jax.jit(per_matrix)(a, b), out)

    @pytest.mark.parametrize("a_shape, b_shape", [
        ((4, 1, 20, 40), (3, 40, 24)),
        ((4, 3, 20, 40), (40, 24)),  # one b for every matrix: one product of a's rows
    ])
    def test_bmm_broadcasts_batch_dims(self, a_shape, b_shape):
        impl = self.implementation
        rng = np.random.default_rng(6)
        a, b = random(rng, a_shape), random(rng, b_shape)
        cotangent = random(rng, (4, 3, 20, 24))
        fn = functools.partial(jattn.bmm, config=SMALL, implementation=impl)
        out = jax.jit(fn)(a, b)
        assert out.shape == (4, 3, 20, 24)
        assert_close(out, golden(matmul_reference, a, b), low_precision(matmul_reference, a, b))
        grads = jax.jit(lambda a, b: random_cotangent_vjp(fn, (a, b), cotangent))(a, b)
        gold = golden(lambda a, b, c: random_cotangent_vjp(matmul_reference, (a, b), c), a, b,
                      cotangent)
        low = low_precision(lambda a, b, c: random_cotangent_vjp(matmul_reference, (a, b), c), a, b,
                            cotangent)
        for g, g64, g_low, x in zip(grads, gold, low, (a, b)):
            assert g.shape == x.shape
            assert_close(g, g64, g_low, what="bmm gradient")


class TestXla(MatmulBackendTests):
    implementation = "xla"


class TestInterpret(MatmulBackendTests):
    implementation = "interpret"


@pytest.mark.gpu
class TestPallasTriton(MatmulBackendTests):
    implementation = "pallas_triton"
