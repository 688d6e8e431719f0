"""The GEMM kernel lowers to Triton for CUDA, checked on any machine (no GPU needed).

The interpreter accepts things the Triton lowering rejects (non-power-of-two tensors, value
slicing, gathers), so every representative config is lowered here, as CI would see it.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from jattn._src.gemm import pallas_triton
from jattn._src.gemm.config import MatmulConfig, heuristic_config
from jattn._src.user_functions import trace_with_captures
from tests.helpers import lower_for_cuda


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("m,n,k,dtype", [
    (8192, 8192, 8192, jnp.bfloat16),   # the large bf16 tile
    (1000, 1030, 520, jnp.float16),     # ragged M, N and K
    (512, 256, 384, jnp.float32),
    (16, 8192, 8192, jnp.bfloat16),     # decode-shaped: split-K
    (1, 80, 96, jnp.bfloat16),          # tiles larger than the problem
])
def test_heuristic_configs_lower(m, n, k, dtype):
    config = heuristic_config(m, n, k, dtype)
    fn = functools.partial(pallas_triton.matmul, bias=None, captures=(), config=config,
                           out_dtype=dtype)
    text = lower_for_cuda(fn, _spec((m, k), dtype), _spec((k, n), dtype))
    assert "triton" in text and "jattn_matmul" in text


@pytest.mark.parametrize("transpose_a,transpose_b", [(True, False), (False, True)])
def test_transposed_operands_lower(transpose_a, transpose_b):
    m, n, k = 300, 200, 100
    a = _spec((k, m) if transpose_a else (m, k), jnp.bfloat16)
    b = _spec((n, k) if transpose_b else (k, n), jnp.bfloat16)
    fn = functools.partial(pallas_triton.matmul, bias=None, captures=(), config=MatmulConfig(),
                           out_dtype=jnp.bfloat16, transpose_a=transpose_a,
                           transpose_b=transpose_b)
    assert "jattn_matmul" in lower_for_cuda(fn, a, b)


def test_bias_epilogue_with_indices_and_capture_lowers():
    config = MatmulConfig(block_m=64, block_n=128, block_k=64)
    scale = jnp.float32(0.5)
    col_bias = jnp.ones((515,))  # not a power of two: read element-wise, never whole

    def epilogue(x, rows, cols):
        return jnp.where(rows > cols, jax.nn.gelu(x) * scale, jnp.tanh(x)) + col_bias[cols]

    def tile_signature(m, n):
        return (_spec((m, n), jnp.float32), _spec((m, 1), jnp.int32), _spec((1, n), jnp.int32))

    (on_tile,), captures = trace_with_captures(epilogue, tile_signature(64, 128))
    fn = functools.partial(pallas_triton.matmul, config=config, out_dtype=jnp.bfloat16,
                           epilogue=on_tile, save_preact=True)
    text = lower_for_cuda(lambda a, b, bias, caps: fn(a, b, bias, caps),
                          _spec((333, 250), jnp.bfloat16), _spec((250, 515), jnp.bfloat16),
                          _spec((515,), jnp.float32), captures)
    assert "jattn_matmul" in text
