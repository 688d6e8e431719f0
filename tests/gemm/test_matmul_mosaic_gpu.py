"""The Mosaic GPU GEMM (implementation="pallas_mosaic_gpu"): matmul, bmm and scaled_matmul.

On the CPU: the registry's reasons for the calls the kernel cannot run, the default choice, the
config's validation, and the kernel lowered for CUDA (forward, backward, batches, float32
output, fp8 with either accumulation); with jax >= 0.11, tile orders, bias and fp8 scales in
JAX's Mosaic GPU interpreter. On the GPU against a float64 golden: tile shapes and orders,
bias, float16, float32 output, gradients, batches, fp8 scales (scaled_matmul's own tests hold
the rest).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src import backends, hardware
from jattn._src.gemm.api import make_options
from jattn._src.gemm.config import heuristic_mosaic_config, mosaic_search_space
from jattn._src.gemm.reference import matmul_reference, scaled_matmul_reference
from tests.gemm.test_matmul import _check_matmul
from tests.helpers import (assert_bitwise_equal_runs, assert_close, assert_gradients_close,
                           golden, low_precision, lower_for_cuda, random)

MOSAIC = "pallas_mosaic_gpu"
gpu = pytest.mark.gpu


def _facts(**changes):
    return {**dict(dtype=jnp.bfloat16, m=1024, n=1024, k=512, epilogue=False, config=None),
            **changes}


@pytest.mark.parametrize("change, reason", [
    ({"dtype": jnp.float32}, "bfloat16, float16 or fp8"),
    ({"epilogue": True}, "epilogue is fused by pallas_triton"),
    ({"m": 1000}, r"M a multiple of 128, N of 128 and K of 64 .* 1000, 1024, 512"),
    ({"k": 520}, "K of 64"),
    ({"config": jattn.MosaicMatmulConfig(block_m=128, block_n=256), "n": 640}, "N of 256"),
    ({"config": jattn.MatmulConfig()}, "pass a MosaicMatmulConfig"),
    ({"dtype": jnp.float8_e4m3fn, "config": jattn.MosaicMatmulConfig(128, 128)},
     "float8_e4m3fn operands take MosaicMatmulConfig.block_k=128"),
    ({"dtype": jnp.float8_e5m2, "k": 576}, "K of 128"),
])
def test_registry_names_what_the_mosaic_matmul_cannot_run(as_if_on_hopper, change, reason):
    assert backends.resolve("matmul", MOSAIC, platform="gpu", **_facts()).name == MOSAIC
    with pytest.raises(ValueError, match=reason):
        backends.resolve("matmul", MOSAIC, platform="gpu", **_facts(**change))


def test_a_mosaic_config_on_the_triton_kernel_raises(as_if_on_hopper):
    with pytest.raises(ValueError, match="pass a MatmulConfig"):
        backends.resolve("matmul", "pallas_triton", platform="gpu",
                         **_facts(config=jattn.MosaicMatmulConfig()))


def test_it_needs_a_hopper_gpu(monkeypatch):
    monkeypatch.setattr(hardware, "has_cuda", lambda: True)
    monkeypatch.setattr(hardware, "is_hopper", lambda: False)
    with pytest.raises(ValueError, match="Hopper"):
        backends.resolve("matmul", MOSAIC, platform="gpu", **_facts())
    assert backends.resolve("matmul", platform="gpu", **_facts()).name == "pallas_triton"


@pytest.mark.parametrize("facts, chosen", [
    (dict(m=4096, n=4096, k=4096), MOSAIC),
    (dict(m=1000), "pallas_triton"),          # ragged
    (dict(epilogue=True), "pallas_triton"),   # fused epilogue
    (dict(m=16, n=8192, k=8192), "pallas_triton"),  # skinny: not a tile of rows
    (dict(m=128, n=8192, k=8192), "pallas_triton"),  # skinny: measured as fast
    (dict(m=1024, n=1024, k=1024), MOSAIC),           # small tiles
    (dict(m=512, n=1024, k=1024), "pallas_triton"),   # fewer outputs than measured
    (dict(m=512, n=512, k=128, batch=64), MOSAIC),    # a bmm: 2**24 outputs in one launch
    (dict(m=2048, n=1024, k=1024), MOSAIC),
])
def test_hopper_default(as_if_on_hopper, facts, chosen):
    with backends.recording() as seen:
        assert backends.resolve("matmul", platform="gpu", **_facts(**facts)).name == chosen
    if chosen != MOSAIC:
        assert "skipped pallas_mosaic_gpu" in str(seen[0])


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_m=96), r"\[96, 128\] tile"),
    (dict(block_m=256, block_n=256, split="m"), r"\[128, 256\] tile"),
    (dict(block_k=32), "block_k must be 64 .* or 128"),
    (dict(split="k"), "split must be 'm' or 'n'"),
    (dict(num_stages=0), "num_stages"),
])
def test_invalid_configs_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jattn.MosaicMatmulConfig(**kwargs)


@pytest.mark.parametrize("m,n,dtype,expected", [
    (4096, 4096, jnp.bfloat16, (128, 256, 64, "n", 4)),
    (2048, 2048, jnp.bfloat16, (128, 256, 64, "n", 4)),   # 128 tiles: enough for the SMs
    (8192, 640, jnp.float16, (256, 128, 64, "m", 4)),      # N not a multiple of 256
    (512, 4096, jnp.float16, (128, 128, 64, "m", 6)),     # 128 x 256 would give 64 tiles
    (1024, 1024, jnp.bfloat16, (128, 64, 64, "m", 8)),    # 128 tiles
    (384, 384, jnp.bfloat16, (128, 64, 64, "m", 8)),      # too few for any: the most
    (4096, 4096, jnp.float8_e4m3fn, (128, 128, 128, "m", 4)),  # room to promote fp8 sums
    (4096, 4096, "fast fp8", (128, 256, 128, "n", 4)),
])
def test_heuristic_and_search_space_fit_shared_memory(m, n, dtype, expected):
    fast = dtype == "fast fp8"
    dtype = jnp.float8_e4m3fn if fast else dtype
    config = heuristic_mosaic_config(m, n, 512, dtype, fast_accum=fast)
    assert (config.block_m, config.block_n, config.block_k, config.split,
            config.num_stages) == expected
    space = mosaic_search_space(m, n, 512, dtype, fast_accum=fast)
    assert config in space
    itemsize = jnp.dtype(dtype).itemsize
    for candidate in space:
        assert m % candidate.block_m == 0 and n % candidate.block_n == 0
        assert candidate.block_k * itemsize == 128
        assert candidate.shared_memory_bytes(itemsize) <= 227 * 1024


def test_heuristic_counts_the_tiles_of_a_batch(as_if_on_hopper):
    """One launch runs every matrix's tiles: 16 products of 1024^2 fill the SMs with 128 x 256
    tiles, one alone needs 128 x 64 ones."""
    alone = heuristic_mosaic_config(1024, 1024, 1024, jnp.bfloat16)
    batched = heuristic_mosaic_config(1024, 1024, 1024, jnp.bfloat16, batch=16)
    assert (alone.block_m, alone.block_n) == (128, 64)
    assert (batched.block_m, batched.block_n) == (128, 256)
    options, _ = make_options("bmm", 1024, 1024, 1024, jnp.bfloat16, None, None, None, None,
                              MOSAIC, batch=16)
    assert options.config == batched and options.batch == 16


# ------------------------------------------------------------------------------------------------
# Lowered for CUDA on the CPU
# ------------------------------------------------------------------------------------------------

def _spec(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_forward_with_bias_lowers(as_if_on_hopper):
    fn = functools.partial(jattn.matmul, implementation=MOSAIC)
    text = lower_for_cuda(lambda a, b, c: fn(a, b, bias=c), _spec(512, 256), _spec(256, 512),
                          _spec(512, dtype=jnp.float32))
    assert "mosaic_gpu" in text and "triton" not in text


def test_backward_products_lower_on_mosaic(as_if_on_hopper):
    """dA = dC Bᵀ and dB = Aᵀ dC read the operands transposed in shared memory."""
    def grads(a, b):
        loss = lambda a, b: jattn.matmul(a, b, implementation=MOSAIC).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1))(a, b)

    text = lower_for_cuda(grads, _spec(2048, 1024), _spec(1024, 2048))
    assert text.count("mosaic_gpu") >= 3 and "triton" not in text


def test_backward_products_it_is_slower_at_run_on_the_default(as_if_on_hopper):
    """dB = Aᵀ dC of a [2048, 1024] x [1024, 512] product has 2**19 outputs: pallas_triton."""
    def grads(a, b):
        loss = lambda a, b: jattn.matmul(a, b, implementation=MOSAIC).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1))(a, b)

    text = lower_for_cuda(grads, _spec(2048, 1024), _spec(1024, 512))
    assert "mosaic_gpu" in text and "jattn_matmul" in text


@pytest.mark.parametrize("config", [
    jattn.MosaicMatmulConfig(block_m=256, block_n=128, split="m", minor="m", group=4),
    jattn.MosaicMatmulConfig(block_m=128, block_n=128, num_stages=5),
    jattn.MosaicMatmulConfig(block_m=128, block_n=128, split="m"),
    jattn.MosaicMatmulConfig(block_m=128, block_n=64, split="m", num_stages=8),
    jattn.MosaicMatmulConfig(block_m=64, block_n=128, split="n", num_stages=6),
])
def test_configs_and_float32_output_lower(as_if_on_hopper, config):
    fn = functools.partial(jattn.matmul, implementation=MOSAIC, config=config,
                           out_dtype=jnp.float32)
    text = lower_for_cuda(fn, _spec(512, 256, dtype=jnp.float16),
                          _spec(256, 512, dtype=jnp.float16))
    assert "mosaic_gpu" in text


def _launches(text):
    return text.count("custom_call @mosaic_gpu")


@pytest.mark.parametrize("a_shape, b_shape", [
    ((4, 1024, 1024), (4, 1024, 1024)),
    ((4, 1024, 1024), (1, 1024, 1024)),   # b shared by the batch, not copied
    ((2, 1, 1024, 1024), (3, 1024, 1024)),
])
def test_bmm_is_one_launch_forward_and_one_per_backward_product(as_if_on_hopper, a_shape,
                                                                   b_shape):
    fn = functools.partial(jattn.bmm, implementation=MOSAIC)
    loss = lambda a, b: fn(a, b).astype(jnp.float32).sum()
    text = lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1)), _spec(*a_shape),
                          _spec(*b_shape))
    assert _launches(text) == 3 and "gpu.triton" not in text and "stablehlo.while" not in text


def test_vmap_of_matmul_is_one_launch(as_if_on_hopper):
    """Nested vmaps fold into one batch; per-matrix biases take a launch per matrix."""
    fn = functools.partial(jattn.matmul, implementation=MOSAIC)
    nested = jax.vmap(jax.vmap(fn, in_axes=(0, None)), in_axes=(None, 0))
    assert _launches(lower_for_cuda(nested, _spec(3, 256, 128), _spec(2, 128, 256))) == 1
    per_bias = jax.vmap(lambda a, c: fn(a, a.T, bias=c))
    text = lower_for_cuda(per_bias, _spec(3, 256, 256), _spec(3, 256, dtype=jnp.float32))
    assert _launches(text) == 1 and "stablehlo.while" in text


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("row_wise", [False, True])
def test_scaled_matmul_lowers(as_if_on_hopper, fast, row_wise):
    """b read K-major (stored [N, K]); scales and bias on the accumulator; with promotion, a
    second accumulator per K-step."""
    def scaled(a, b_nk, scale_a, scale_b, bias):
        return jattn.scaled_matmul(a, b_nk.T, scale_a, scale_b, bias=bias,
                                   use_fast_accum=fast, implementation=MOSAIC)

    f8 = jnp.float8_e4m3fn
    text = lower_for_cuda(scaled, _spec(512, 1024, dtype=f8), _spec(768, 1024, dtype=f8),
                          _spec(*((512,) if row_wise else ()), dtype=jnp.float32),
                          _spec(768, dtype=jnp.float32), _spec(768, dtype=jnp.float32))
    assert "mosaic_gpu" in text and "triton" not in text


def test_promoted_accumulation_needs_a_small_consumer_tile(as_if_on_hopper):
    f8 = jnp.float8_e4m3fn
    a, b = jnp.zeros((512, 512), f8), jnp.zeros((512, 512), f8)
    config = jattn.MosaicMatmulConfig(block_m=128, block_n=256, block_k=128)
    with pytest.raises(ValueError, match=r"a consumer's \[128, 128\] tile .* use_fast_accum"):
        jax.jit(lambda a, b: jattn.scaled_matmul(a, b, jnp.float32(1), jnp.float32(1),
                                                 config=config, implementation=MOSAIC)
                ).trace(a, b)


def test_explain_names_the_choice_and_the_fallback(as_if_on_hopper):
    a, b = jnp.zeros((512, 256), jnp.bfloat16), jnp.zeros((256, 512), jnp.bfloat16)
    assert "pallas_mosaic_gpu" in jattn.explain(jattn.matmul, a, b)
    text = jattn.explain(jattn.matmul, a[:500], b)
    assert "pallas_triton" in text and "M a multiple of 128" in text


# ------------------------------------------------------------------------------------------------
# On the GPU
# ------------------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("m,n,k,dtype", [
    (2048, 2048, 512, jnp.bfloat16),    # 128 x 256 tiles, 128 of them
    (1024, 2048, 512, jnp.bfloat16),    # 128 x 128 tiles, 6 stages
    (256, 384, 192, jnp.float16),       # 128 x 64 tiles, 3 stages (one per K step)
    (384, 640, 1024, jnp.bfloat16),     # 128 x 64 tiles, 8 stages, fewer tiles than SMs
])
def test_default_configs_match_golden(m, n, k, dtype):
    rng = np.random.default_rng(m + n + k)
    a, b = random(rng, (m, k), dtype), random(rng, (k, n), dtype)
    _check_matmul(MOSAIC, a, b, config=None, bias=random(rng, (n,), jnp.float32))


def _per_matrix_reference(a, b):
    """a [2, 1, M, K] @ b [3, K, N] matrix by matrix (torch's way: a shared operand's gradient
    sums per-matrix gradients, each rounded to its dtype)."""
    return jax.vmap(jax.vmap(matmul_reference, (None, 0)), (0, None))(a[:, 0], b)


@gpu
@pytest.mark.parametrize("a_shape, b_shape, reference", [
    ((3, 512, 256), (3, 256, 384), matmul_reference),     # 128 x 64 tiles, 24 a matrix
    ((2, 3, 1024, 256), (1, 256, 1024), matmul_reference),  # one b: one product of a's rows
    ((2, 1, 1024, 256), (3, 256, 1024), _per_matrix_reference),  # 128 x 256 tiles, 6 products
])
def test_bmm_matches_golden_with_gradients(a_shape, b_shape, reference):
    rng = np.random.default_rng(len(a_shape))
    a, b = random(rng, a_shape, jnp.bfloat16), random(rng, b_shape, jnp.bfloat16)
    ours = functools.partial(jattn.bmm, implementation=MOSAIC)
    out = jax.jit(ours)(a, b)
    assert_close(out, golden(matmul_reference, a, b), low_precision(matmul_reference, a, b))
    cotangent = random(rng, out.shape, jnp.bfloat16)
    assert_gradients_close(ours, reference, (a, b), cotangent, ("a", "b"))


@gpu
def test_vmap_of_matmul_equals_each_matrix_alone():
    rng = np.random.default_rng(12)
    a, b = random(rng, (4, 256, 512), jnp.bfloat16), random(rng, (2, 512, 256), jnp.bfloat16)
    bias = random(rng, (4, 256), jnp.float32)
    fn = jax.jit(lambda a, b, c: jattn.matmul(a, b, bias=c, implementation=MOSAIC))
    nested = jax.jit(jax.vmap(jax.vmap(fn, in_axes=(0, None, 0)), in_axes=(None, 0, None)))
    out = nested(a, b, bias)
    for i, j in np.ndindex(2, 4):
        np.testing.assert_array_equal(out[i, j], fn(a[j], b[i], bias[j]))


@gpu
@pytest.mark.parametrize("config", [
    jattn.MosaicMatmulConfig(block_m=256, block_n=128, split="m", minor="m", group=4),
    jattn.MosaicMatmulConfig(block_m=128, block_n=128, split="m", num_stages=5, group=16),
    jattn.MosaicMatmulConfig(block_m=128, block_n=256, num_stages=3, minor="m", group=3),
    jattn.MosaicMatmulConfig(block_m=128, block_n=128, minor="n", group=1),
    jattn.MosaicMatmulConfig(block_m=128, block_n=64, split="m", num_stages=6),
    jattn.MosaicMatmulConfig(block_m=64, block_n=128, split="n", minor="m"),
])
def test_tile_shapes_and_orders_match_golden(config):
    rng = np.random.default_rng(config.group)
    a, b = random(rng, (1536, 768), jnp.bfloat16), random(rng, (768, 2560), jnp.bfloat16)
    _check_matmul(MOSAIC, a, b, config=config)


@gpu
def test_float32_output_is_the_accumulator_and_repeatable():
    """The float32 output is the accumulator the bfloat16 output rounds (its own store path:
    32-column pieces), within float32 accumulation's bound K·2⁻²³·(|a|·|b|) of the golden: the
    tensor cores add truncating, so one accumulator over K = 4096 drifts further from the
    golden than cuBLAS's split-K does, and a 2x-its-error tolerance does not apply."""
    rng = np.random.default_rng(5)
    a, b = random(rng, (512, 4096), jnp.bfloat16), random(rng, (4096, 1024), jnp.bfloat16)
    run = jax.jit(functools.partial(jattn.matmul, implementation=MOSAIC, out_dtype=jnp.float32))
    wide, narrow = run(a, b), _check_matmul(MOSAIC, a, b, config=None)
    assert wide.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(wide.astype(jnp.bfloat16).astype(jnp.float32)),
                                  np.asarray(narrow.astype(jnp.float32)))
    magnitude = golden(lambda a, b: jnp.abs(a) @ jnp.abs(b), a, b)
    error = np.abs(np.asarray(wide, np.float64) - golden(matmul_reference, a, b))
    assert np.all(error <= 4096 * 2.0**-23 * magnitude)
    assert_bitwise_equal_runs(lambda: run(a, b))


@gpu
@pytest.mark.parametrize("m,n,k", [(2048, 2048, 1024), (1024, 2048, 2048)])
def test_gradients_match_golden(m, n, k):
    """Both backward products (transposed operands) have at least 2**21 outputs: Mosaic's."""
    rng = np.random.default_rng(m + k)
    a, b = random(rng, (m, k), jnp.bfloat16), random(rng, (k, n), jnp.bfloat16)
    bias, cotangent = random(rng, (n,), jnp.float32), random(rng, (m, n), jnp.bfloat16)
    ours = functools.partial(jattn.matmul, implementation=MOSAIC)
    assert_gradients_close(lambda a, b, c: ours(a, b, bias=c),
                           lambda a, b, c: matmul_reference(a, b, bias=c),
                           (a, b, bias), cotangent, ("a", "b", "bias"))


@gpu
def test_default_choice_on_hopper_runs_it():
    if not hardware.is_hopper():
        pytest.skip("the Mosaic GEMM needs a Hopper GPU")
    rng = np.random.default_rng(9)
    a, b = random(rng, (2048, 1024), jnp.bfloat16), random(rng, (1024, 2048), jnp.bfloat16)
    assert "pallas_mosaic_gpu" in jattn.explain(jattn.matmul, a, b)
    out = jax.jit(jattn.matmul)(a, b)
    assert_close(out, golden(matmul_reference, a, b), low_precision(matmul_reference, a, b))


@gpu
@pytest.mark.parametrize("m,n,k,dtype,mode", [
    (1024, 1024, 1024, jnp.float8_e4m3fn, "tensor"),
    (256, 384, 512, jnp.float8_e5m2, "row"),    # fast accumulation: 128 x 64 tiles
    (2048, 2048, 2048, jnp.float8_e4m3fn, "row"),
])
@pytest.mark.parametrize("fast", [False, True])
def test_scaled_matmul_matches_golden(m, n, k, dtype, mode, fast):
    """Promoted: 128 x 128 tiles; fast accumulation: the wide tiles at 2048^2 (128 x 256),
    the smallest at 1024^2 and below (128 x 64)."""
    rng = np.random.default_rng(m + k)
    a, b = random(rng, (m, k), dtype), random(rng, (k, n), dtype)
    if mode == "tensor":
        scale_a, scale_b = jnp.float32(0.7), jnp.float32(1.3)
    else:
        scale_a = jnp.asarray(rng.uniform(0.5, 2, m), jnp.float32)
        scale_b = jnp.asarray(rng.uniform(0.5, 2, n), jnp.float32)
    bias = random(rng, (n,), jnp.float32)
    run = jax.jit(functools.partial(jattn.scaled_matmul, use_fast_accum=fast,
                                    implementation=MOSAIC))
    out = run(a, b, scale_a, scale_b, bias=bias)
    reference = lambda a, b, sa, sb, c: scaled_matmul_reference(a, b, sa, sb, bias=c,
                                                                out_dtype=jnp.bfloat16)
    args = (a, b, scale_a, scale_b, bias)
    assert out.dtype == jnp.bfloat16
    assert_close(out, golden(reference, *args), low_precision(reference, *args))


# ------------------------------------------------------------------------------------------------
# Numerics in JAX's Mosaic GPU interpreter (jax >= 0.11; its wgmma reads shared memory, as
# this kernel's does)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [
    jattn.MosaicMatmulConfig(block_m=128, block_n=128, split="m", num_stages=2, group=2),
    jattn.MosaicMatmulConfig(block_m=128, block_n=256, num_stages=3, minor="m", group=1),
])
def test_tile_orders_and_bias_match_golden_interpreted(mosaic_interpreted, config):
    rng = np.random.default_rng(config.num_stages)
    a, b = random(rng, (384, 320), jnp.bfloat16), random(rng, (320, 512), jnp.bfloat16)
    _check_matmul(MOSAIC, a, b, config=config, bias=random(rng, (512,), jnp.float32))


@pytest.mark.parametrize("fast", [False, True])
def test_fp8_scales_match_golden_interpreted(mosaic_interpreted, fast):
    rng = np.random.default_rng(int(fast))
    f8 = jnp.float8_e4m3fn
    a, b = random(rng, (256, 512)).astype(f8), random(rng, (512, 256)).astype(f8)
    scale_a, scale_b = random(rng, (256,)) ** 2, random(rng, (256,)) ** 2
    out = jattn.scaled_matmul(a, b, scale_a, scale_b, use_fast_accum=fast,
                              config=jattn.MosaicMatmulConfig(128, 128, 128, 2, split="m"),
                              implementation=MOSAIC)
    args = (a, b, scale_a, scale_b)
    assert_close(out, golden(scaled_matmul_reference, *args),
                 low_precision(scaled_matmul_reference, *args))
