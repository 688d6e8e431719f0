"""Every GPU kernel family once, at small ragged shapes, against the XLA implementation: the
subset that runs under compute-sanitizer's memcheck (`make memcheck` runs `python -m
tests.memcheck`), where each buffer is its own allocation (XLA_PYTHON_CLIENT_ALLOCATOR=platform)
so an overrun is caught.

Lengths and head dims are not tile multiples, heads are grouped (GQA), the decode cache is
paged, and a GEMM splits K: the tails are where an unmasked access would read or write past
an end. The Mosaic GPU kernels (Hopper) take tile multiples only; they run at the smallest
shapes their defaults choose them for, with their transposed and fp8 paths.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src import hardware
from jattn._src.attention.reference import attention_reference
from tests.decoding.test_paged import _cache_like as cache_like
from tests.helpers import random

pytestmark = pytest.mark.gpu
GPU = "pallas_triton"
MOSAIC = "pallas_mosaic_gpu"


def _close(got, expected, tolerance=2e-2):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                               rtol=tolerance, atol=tolerance)


def _close_to_fp8_sums(got, a, b, scale_a, scale_b):
    """Within fp8 accumulation's error of the float64 product: the tensor cores keep partial
    sums to ~2^-11 of their size (fast accumulation, or within each promoted K step), so a
    result that cancels large terms may be off by far more than its own size allows (seen:
    0.27 at -3.5, whose terms' absolute values summed to 8249); a wrong tile is off by
    ~sqrt(K) times a term."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scales = np.outer(np.asarray(scale_a, np.float64), np.asarray(scale_b, np.float64))
    expected, size = (a @ b) * scales, (np.abs(a) @ np.abs(b)) * scales
    error = np.abs(np.asarray(got, np.float64) - expected)
    assert np.all(error <= 2.0**-11 * size + 2.0**-7 * np.abs(expected)), error.max()


def test_flex_attention_forward_backward():
    for L, S, E, Ev in [(77, 93, 40, 24), (5, 200, 64, 64)]:  # flex kernels; split-KV forward
        _attention_forward_backward(L, S, E, Ev)


def _attention_forward_backward(L, S, E, Ev):
    rng = np.random.default_rng(0)
    q, k, v = (random(rng, shape, jnp.bfloat16) for shape in
               ((2, 4, L, E), (2, 2, S, E), (2, 2, S, Ev)))
    bias = random(rng, (4,))
    mask = jattn.create_block_mask(lambda b, h, qi, ki: ki <= qi + (S - L), None, None, L, S,
                                   block_size=32)

    def loss(impl, q, k, v, bias):
        out = jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + bias[h], mask,
                                   enable_gqa=True, implementation=impl)
        return out.astype(jnp.float32).sum(), out

    def reference_loss(q, k, v, bias):  # dense: XLA's blocked backward crashes the sanitizer
        out, _ = attention_reference(q, k, v, lambda s, b, h, qi, ki: s + bias[h], mask)
        return out.astype(jnp.float32).sum(), out

    argnums = (0, 1, 2)  # (the bias gradient is an XLA pass, which crashes the sanitizer)
    got = jax.grad(functools.partial(loss, GPU), argnums, has_aux=True)(q, k, v, bias)
    expected = jax.grad(reference_loss, argnums, has_aux=True)(q, k, v, bias)
    for got_leaf, expected_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        _close(got_leaf, expected_leaf, 5e-2)


def test_flex_decode_paged_and_contiguous():
    rng = np.random.default_rng(1)
    B, Hq, Hkv, S, E = 3, 8, 2, 96, 40
    q = random(rng, (B, Hq, 2, E), jnp.bfloat16)
    k, v = (random(rng, (B, Hkv, S, E), jnp.bfloat16) for _ in range(2))
    kv_len = jnp.array([96, 41, 2])
    expected = jattn.flex_decode(q, k, v, kv_len=kv_len, implementation="xla")
    _close(jattn.flex_decode(q, k, v, kv_len=kv_len, implementation=GPU), expected)
    cache = cache_like(rng, k, v, [96, 41, 2], num_pages=20)
    _close(jattn.flex_decode(q, cache, None, kv_len=kv_len, implementation=GPU), expected)


def test_gemm_family():
    rng = np.random.default_rng(2)
    a, b = random(rng, (70, 200), jnp.bfloat16), random(rng, (200, 90), jnp.bfloat16)
    split = jattn.MatmulConfig(block_m=32, block_n=32, block_k=32, split_k=4)
    for config in (None, split):
        _close(jattn.matmul(a, b, config=config, implementation=GPU),
               jattn.matmul(a, b, implementation="xla"))
    c, d = random(rng, (70, 40), jnp.bfloat16), random(rng, (40, 90), jnp.bfloat16)
    _close(jattn.mm_plus_mm(a, b, c, d, implementation=GPU),
           jattn.mm_plus_mm(a, b, c, d, implementation="xla"))
    e = random(rng, (90, 30), jnp.bfloat16)
    _close(jattn.b2b_matmul(a, b, e, implementation=GPU),
           jattn.b2b_matmul(a, b, e, implementation="xla"), 5e-2)
    qweight, scales = jattn.quantize_weight(random(rng, (192, 90)), bits=4, group_size=64)
    mixed = functools.partial(jattn.mixed_matmul, a[:, :192], qweight, scales, bits=4,
                              group_size=64)
    _close(mixed(implementation=GPU), mixed(implementation="xla"))
    a8, b8 = (x.astype(jnp.float8_e4m3fn) for x in (a, b))
    one = jnp.ones((), jnp.float32)
    _close(jattn.scaled_matmul(a8, b8, one, one, implementation=GPU),
           jattn.scaled_matmul(a8, b8, one, one, implementation="xla"))


def test_mosaic_gpu_kernels():
    if not hardware.is_hopper():
        pytest.skip("the Mosaic GPU kernels need a Hopper GPU")
    rng = np.random.default_rng(3)
    # The GEMM, forward with bias and both backward products (each has at least 256 rows and
    # 2**20 outputs: Mosaic's).
    a, b = random(rng, (2048, 1024), jnp.bfloat16), random(rng, (1024, 2048), jnp.bfloat16)
    bias = random(rng, (2048,))

    def loss(impl, a, b, bias):
        out = jattn.matmul(a, b, bias=bias, implementation=impl)
        return out.astype(jnp.float32).sum(), out

    got = jax.grad(functools.partial(loss, MOSAIC), (0, 1), has_aux=True)(a, b, bias)
    expected = jax.grad(functools.partial(loss, "xla"), (0, 1), has_aux=True)(a, b, bias)
    for got_leaf, expected_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        _close(got_leaf, expected_leaf, 5e-2)
    # fp8, row-wise scales, promoted and fast accumulation.
    a8, b8 = (random(rng, shape, jnp.float8_e4m3fn) for shape in ((256, 512), (512, 384)))
    scale_a, scale_b = random(rng, (256,)) ** 2, random(rng, (384,)) ** 2
    for fast in (False, True):
        scaled = functools.partial(jattn.scaled_matmul, a8, b8, scale_a, scale_b,
                                   use_fast_accum=fast)
        _close_to_fp8_sums(scaled(implementation=MOSAIC), a8, b8, scale_a, scale_b)
    # The weight-only kernel: int4 per channel (64 weight rows a program) and int8 per group.
    for bits, group_size in ((4, None), (8, 128)):
        w = random(rng, (512, 384))
        qweight, scales = jattn.quantize_weight(w, bits=bits, group_size=group_size)
        mixed = functools.partial(jattn.mixed_matmul, random(rng, (24, 512), jnp.bfloat16),
                                  qweight, scales, bits=bits, group_size=group_size)
        _close(mixed(implementation=MOSAIC), mixed(implementation="xla"))
    # Attention: forward and both backward kernels, a per-head score_mod and a causal mask.
    q, k, v = (random(rng, (1, 2, 256, 128), jnp.bfloat16) for _ in range(3))
    head_bias = random(rng, (2,))
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 256, 256)

    def attention_loss(impl, q, k, v):
        out = jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + head_bias[h], mask,
                                   implementation=impl)
        return out.astype(jnp.float32).sum(), out

    got = jax.grad(functools.partial(attention_loss, MOSAIC), (0, 1, 2), has_aux=True)(q, k, v)
    expected = jax.grad(functools.partial(attention_loss, GPU), (0, 1, 2), has_aux=True)(q, k, v)
    for got_leaf, expected_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        _close(got_leaf, expected_leaf, 5e-2)
