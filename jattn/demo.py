"""`python -m jattn.demo`: run each kernel on the default device against its reference.

Prints the device and implementation, then for each kernel the relative error against a
float32 reference and the median time of a call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn._src import backends, hardware
from jattn._src.attention.reference import attention_reference
from jattn._src.gemm.reference import matmul_reference
from jattn._src.tuning.autotune import median_seconds


def _relative_error(x: jax.Array, reference: jax.Array) -> float:
    x, reference = np.asarray(x, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(x - reference) / np.linalg.norm(reference))


def _report(name: str, fn, reference: jax.Array, args, flops: float) -> None:
    fn = jax.jit(fn)
    error = _relative_error(fn(*args).astype(jnp.float32), reference)
    seconds = median_seconds(lambda: fn(*args))
    print(f"  {name:<34} rel. error {error:.1e}   {seconds * 1e3:8.3f} ms"
          f"   {flops / seconds / 1e12:7.2f} TFLOP/s")


def _report_attention(on_gpu: bool) -> None:
    B, H, L, E = (2, 8, 2048, 128) if on_gpu else (1, 4, 512, 64)
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((B, H, L, E)), jnp.bfloat16) for _ in range(3))
    block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)
    alibi = jattn.mods.alibi(jattn.mods.alibi_slopes(H))
    reference = attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), alibi,
                                    block_mask)[0]
    print(f"flex attention, bf16 B{B} H{H} L{L} D{E}, causal + alibi, vs a float32 reference:")
    _report("flex_attention forward",
            lambda q, k, v: jattn.flex_attention(q, k, v, alibi, block_mask), reference,
            (q, k, v), 4.0 * B * H * L * L * E * 0.5)


def main() -> None:
    implementation = backends.resolve("matmul")
    size = 4096 if hardware.has_cuda() else 512
    print(f"jattn {jattn.__version__} on {jax.devices()[0].device_kind} "
          f"(jax {jax.__version__}), implementation: {implementation.name}")
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((size, size)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((size, size)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal((size,)), jnp.bfloat16)
    gelu = functools.partial(jax.nn.gelu, approximate=True)
    f32 = [x.astype(jnp.float32) for x in (a, b, bias)]
    flops = 2.0 * size**3
    print(f"bf16 {size}x{size}x{size}, compared with a float32 reference:")
    _report("matmul", jattn.matmul, matmul_reference(*f32[:2]), (a, b), flops)
    _report("matmul + bias + gelu epilogue",
            lambda a, b, bias: jattn.matmul(a, b, bias=bias, epilogue=gelu),
            matmul_reference(*f32[:2], bias=f32[2], epilogue=gelu), (a, b, bias), flops)
    if not implementation.backend.interpret:
        small = [x[:128, :128] for x in (a, b)]
        _report("matmul, Pallas interpreter, 128^3",
                functools.partial(jattn.matmul, implementation="interpret"),
                matmul_reference(*[x.astype(jnp.float32) for x in small]), small, 2.0 * 128**3)
    _report_attention(hardware.has_cuda())


if __name__ == "__main__":
    main()
