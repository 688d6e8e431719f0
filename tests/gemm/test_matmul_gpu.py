"""The GEMM kernel on the GPU at realistic shapes with its default (heuristic) configs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.gemm.reference import matmul_reference
from tests.helpers import assert_close, golden, low_precision, random

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m,n,k,dtype", [
    (1024, 1024, 1024, jnp.bfloat16),
    (1000, 1030, 520, jnp.float16),
    (512, 768, 640, jnp.float32),
    (16, 4096, 4096, jnp.bfloat16),     # split-K
    (128, 2048, 2048, jnp.bfloat16),
])
def test_default_configs_match_golden(m, n, k, dtype):
    rng = np.random.default_rng(m + n + k)
    a, b = random(rng, (m, k), dtype), random(rng, (k, n), dtype)
    bias = random(rng, (n,), jnp.float32)
    gelu = functools.partial(jax.nn.gelu, approximate=True)
    out = jax.jit(functools.partial(jattn.matmul, epilogue=gelu,
                                    implementation="pallas_triton"))(a, b, bias=bias)
    ref = functools.partial(matmul_reference, epilogue=gelu)
    reference = lambda a, b, c: ref(a, b, bias=c)
    assert_close(out, golden(reference, a, b, bias), low_precision(reference, a, b, bias))
