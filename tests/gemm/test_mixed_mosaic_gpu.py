"""The Mosaic GPU weight-only GEMM (mixed_matmul, implementation="pallas_mosaic_gpu").

On the CPU: the registry's reasons for the calls it cannot run, that the default keeps
pallas_triton until the kernel is timed, the config's validation and heuristic, and the kernel
lowered for CUDA (int8 and int4, per channel and grouped, 64 and 128 weight rows a program,
the gradient). Its numerics run in JAX's Mosaic GPU interpreter against the float64 golden
(jax >= 0.11: 0.10's interpreter cannot load the scales from global memory); the interpreter's
wgmma reads shared-memory operands only, so there the widened weights go through shared
memory instead of registers (`pallas_mosaic_gpu_mixed`: the one line that differs). The GPU
runs the register path against the same golden.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src import backends, hardware
from jattn._src.gemm.config import MosaicMixedConfig, heuristic_mosaic_mixed_config
from jattn._src.gemm.quantize import pack_int4
from jattn._src.gemm.reference import mixed_matmul_reference
from jattn._src.hardware import SHARED_MEMORY_BYTES
from tests.gemm.test_mixed_matmul import _inputs
from tests.helpers import assert_close, golden, low_precision, lower_for_cuda

MOSAIC = "pallas_mosaic_gpu"
OP = "mixed_matmul"


def _facts(**changes):
    return {**dict(dtype=jnp.bfloat16, m=16, n=8192, k=8192, bits=4, group_size=None,
                   config=None), **changes}


@pytest.mark.parametrize("change, reason", [
    ({"dtype": jnp.float32}, "bfloat16 or float16 activations"),
    ({"n": 8200}, r"N a multiple of 64 and K of 128 .* 8200, 8192"),
    ({"k": 8200}, "K of 128"),
    ({"group_size": 64}, "group_size=64 is not a multiple of its K-step 128"),
    ({"config": MosaicMixedConfig(block_n=128, block_k=256), "n": 8256}, "N a multiple of 128"),
    ({"config": jattn.MatmulConfig()}, "pass a MosaicMixedConfig"),
])
def test_registry_names_what_it_cannot_run(as_if_on_hopper, change, reason):
    assert backends.resolve(OP, MOSAIC, platform="gpu", **_facts()).name == MOSAIC
    with pytest.raises(ValueError, match=reason):
        backends.resolve(OP, MOSAIC, platform="gpu", **_facts(**change))


def test_the_default_takes_this_kernel_from_64_tokens_as_measured(as_if_on_hopper):
    assert backends.resolve(OP, platform="gpu", **_facts(m=16)).name == "pallas_triton"
    assert backends.resolve(OP, platform="gpu", **_facts(m=64)).name == MOSAIC
    qweight, scales = jnp.zeros((256, 256), jnp.uint8), jnp.ones((256,), jnp.bfloat16)
    mixed = functools.partial(jattn.mixed_matmul, bits=4)
    said = jattn.explain(mixed, jnp.zeros((16, 512), jnp.bfloat16), qweight, scales)
    assert "pallas_triton" in said and "M = 16 < 64 tokens" in said
    said = jattn.explain(mixed, jnp.zeros((64, 512), jnp.bfloat16), qweight, scales)
    assert said.splitlines()[0] == f"mixed_matmul: {MOSAIC} (platform default (gpu))"
    with pytest.raises(ValueError, match="pass a MatmulConfig"):
        backends.resolve(OP, "pallas_triton", platform="gpu",
                         **_facts(config=MosaicMixedConfig()))


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_m=12), "multiple of 8 up to 256"),
    (dict(block_m=264), "multiple of 8 up to 256"),
    (dict(block_n=256), "64 or 128 weight rows"),
    (dict(block_k=64), "128 or 256"),
    (dict(num_stages=0), "num_stages"),
])
def test_invalid_configs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MosaicMixedConfig(**kwargs)


@pytest.mark.parametrize("m, n, k, bits, group_size, expected", [
    (16, 8192, 8192, 4, None, (16, 64, 256)),    # 128 programs of 64 rows
    (1, 8192, 8192, 8, 128, (8, 64, 128)),       # groups of 128: 128-weight K-steps
    (100, 28672, 8192, 4, None, (104, 128, 256)),  # 224 programs of 128 rows
    (512, 4096, 4096, 4, None, (128, 128, 256)),
])
def test_heuristic_fits_shared_memory(m, n, k, bits, group_size, expected):
    config = heuristic_mosaic_mixed_config(m, n, k, bits, group_size)
    assert (config.block_m, config.block_n, config.block_k) == expected
    assert config.shared_memory_bytes(bits) <= SHARED_MEMORY_BYTES
    assert config.num_stages >= 2


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("bits, group_size, m, config", [
    (4, None, 16, MosaicMixedConfig(block_m=16, block_n=64, block_k=256)),
    (4, 256, 40, MosaicMixedConfig(block_m=48, block_n=128, block_k=256)),
    (8, None, 1, MosaicMixedConfig(block_m=8, block_n=128, block_k=128)),
    (8, 128, 16, MosaicMixedConfig(block_m=16, block_n=64, block_k=128)),
])
def test_kernel_lowers_for_cuda(as_if_on_hopper, bits, group_size, m, config):
    n, k = 512, 1024
    groups = 1 if group_size is None else k // group_size
    fn = functools.partial(jattn.mixed_matmul, bits=bits, group_size=group_size, config=config,
                           implementation=MOSAIC)
    text = lower_for_cuda(fn, _spec((m, k), jnp.bfloat16),
                          _spec((n, k * bits // 8), jnp.int8 if bits == 8 else jnp.uint8),
                          _spec((groups, n), jnp.bfloat16))
    assert text.count("custom_call @mosaic_gpu") == 1


def test_forward_and_gradient_lower_for_cuda(as_if_on_hopper):
    """The forward on this kernel, d_a on the Mosaic matmul (a [1024, 1024] product)."""
    def loss(a, scales, qweight):
        return jattn.mixed_matmul(a, qweight, scales, bits=4, group_size=256,
                                  implementation=MOSAIC).astype(jnp.float32).sum()

    text = lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1)),
                          _spec((1024, 1024), jnp.bfloat16), _spec((4, 1024), jnp.bfloat16),
                          _spec((1024, 512), jnp.uint8))
    assert text.count("custom_call @mosaic_gpu") >= 2  # the forward and d_a at least


# ------------------------------------------------------------------------------------------------
# Numerics, in the Mosaic GPU interpreter (jax >= 0.11)
# ------------------------------------------------------------------------------------------------

# Several token tiles, programs walking several tiles, both ways of sharing a program's weight
# rows, per channel and grouped scales (a group over two K-steps too).
CASES = [
    (4, None, 16, MosaicMixedConfig(block_m=16, block_n=64, block_k=256, num_stages=2)),
    (4, 128, 10, MosaicMixedConfig(block_m=8, block_n=64, block_k=128, num_stages=3)),
    (4, 256, 40, MosaicMixedConfig(block_m=24, block_n=128, block_k=256, num_stages=2)),
    (8, None, 33, MosaicMixedConfig(block_m=16, block_n=128, block_k=128, num_stages=2)),
    (8, 256, 7, MosaicMixedConfig(block_m=8, block_n=64, block_k=128, num_stages=2)),
]


@pytest.mark.parametrize("bits, group_size, m, config", CASES)
def test_matches_golden(mosaic_interpreted, bits, group_size, m, config):
    _check_golden(bits, group_size, m, config)


@pytest.mark.gpu
@pytest.mark.parametrize("bits, group_size, m, config", CASES)
def test_matches_golden_on_the_gpu(bits, group_size, m, config):
    """The register path (the interpreter runs the shared-memory one)."""
    if not hardware.is_hopper():
        pytest.skip("the Mosaic GPU kernels need a Hopper GPU")
    _check_golden(bits, group_size, m, config)


def _check_golden(bits, group_size, m, config):
    rng = np.random.default_rng(m + bits)
    a, qweight, scales = _inputs(rng, m, 384, 1024, bits, group_size)
    out = jattn.mixed_matmul(a, qweight, scales, bits=bits, group_size=group_size,
                             config=config, implementation=MOSAIC)
    reference = functools.partial(mixed_matmul_reference, bits=bits, group_size=group_size)
    args = (a, qweight, scales)
    assert out.shape == (m, 384) and out.dtype == a.dtype
    assert_close(out, golden(reference, *args), low_precision(reference, *args))


def test_default_config_float16_and_leading_dims(mosaic_interpreted):
    rng = np.random.default_rng(3)
    a, qweight, scales = _inputs(rng, 12, 256, 512, 4, None, jnp.float16)
    a = a.reshape(3, 4, 512)
    out = jattn.mixed_matmul(a, qweight, scales, bits=4, implementation=MOSAIC)
    reference = functools.partial(mixed_matmul_reference, bits=4, group_size=None)
    assert out.shape == (3, 4, 256) and out.dtype == jnp.float16
    assert_close(out, golden(reference, a, qweight, scales),
                 low_precision(reference, a, qweight, scales))


def test_every_int4_value_widens_exactly(mosaic_interpreted):
    """Each of the 16 values in both nibbles of a byte, scale 1: one-hot activation rows read
    weight rows back exactly."""
    k, n = 256, 64
    values = jnp.asarray(np.arange(k * n).reshape(k, n) % 16 - 8, jnp.int32)  # [K, N]
    config = MosaicMixedConfig(block_m=16, block_n=64, block_k=256, num_stages=1)
    out = jattn.mixed_matmul(jnp.eye(16, k, dtype=jnp.bfloat16), pack_int4(values),
                             jnp.ones((n,), jnp.bfloat16), bits=4, config=config,
                             implementation=MOSAIC)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(values[:16]))
