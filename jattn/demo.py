"""`python -m jattn.demo`: every op family on the default device against its reference.

For each op it prints the implementation that ran, the error against a float32 reference on the
same inputs (max |out − ref| over max |ref|), the tolerance for the op's precision and PASS or
FAIL; the process exits 1 if any op fails. Sizes are small on a CPU (the whole demo takes well
under a minute there) and larger on a GPU.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn._src import backends, hardware
from jattn._src.attention.reference import attention_reference
from jattn._src.decoding.reference import decode_reference
from jattn._src.gemm.reference import (b2b_reference, matmul_reference, mixed_matmul_reference,
                                       mm_plus_mm_reference, scaled_matmul_reference)

# Tolerances for max |error| / max |reference|: a bf16 result is within a few of bf16's
# relative step (2**-8) of the float32 reference; fp8 operands are exact in float32.
BF16_TOLERANCE = 2e-2


def _error(out: Any, reference: Any) -> float:
    """max |out − reference| / max |reference| over every leaf."""
    worst = 0.0
    for x, ref in zip(jax.tree.leaves(out), jax.tree.leaves(reference)):
        x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
        worst = max(worst, float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30)))
    return worst


class _Report:
    def __init__(self):
        self.failed = []

    def check(self, name: str, op: str, out: Any, reference: Any,
              tolerance: float = BF16_TOLERANCE) -> None:
        error = _error(out, reference)
        verdict = "PASS" if error <= tolerance else "FAIL"
        if verdict == "FAIL":
            self.failed.append(name)
        print(f"  {name:<40} {backends.resolve(op).name:<14} error {error:8.1e}   "
              f"tolerance {tolerance:.0e}   {verdict}")


def _random(rng: np.random.Generator, dtype=jnp.bfloat16) -> Callable[..., jax.Array]:
    return lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)


def _f32(*xs: jax.Array) -> list[jax.Array]:
    return [x.astype(jnp.float32) for x in xs]


def _attention(report: _Report, on_gpu: bool) -> None:
    B, H, L, E = (2, 8, 2048, 128) if on_gpu else (1, 4, 256, 64)
    normal = _random(np.random.default_rng(1))
    q, k, v, d_out = (normal(B, H, L, E) for _ in range(4))
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)
    alibi = jattn.mods.alibi(jattn.mods.alibi_slopes(H))
    forward = jax.jit(lambda q, k, v: jattn.flex_attention(q, k, v, alibi, mask))
    reference = attention_reference(*_f32(q, k, v), alibi, mask)[0]
    report.check(f"flex_attention forward B{B} H{H} L{L}", "flex_attention", forward(q, k, v),
                 reference)

    def grads(fn, *args):
        return jax.vjp(fn, *args)[1](d_out.astype(args[0].dtype))

    ours = jax.jit(lambda q, k, v: grads(forward, q, k, v))(q, k, v)
    expected = grads(lambda q, k, v: attention_reference(q, k, v, alibi, mask)[0],
                     *_f32(q, k, v))
    report.check("flex_attention backward (dq, dk, dv)", "flex_attention", ours, expected,
                 2 * BF16_TOLERANCE)


def _decode(report: _Report, on_gpu: bool) -> None:
    B, Hq, Hkv, S, E, page = (8, 32, 8, 8192, 128, 64) if on_gpu else (2, 8, 2, 512, 64, 64)
    normal = _random(np.random.default_rng(2))
    q, k, v = normal(B, Hq, 1, E), normal(B, Hkv, S, E), normal(B, Hkv, S, E)
    kv_len = jnp.asarray(np.linspace(S // 4, S, B).astype(np.int32))
    decode = jax.jit(lambda q, k, v, kv_len: jattn.flex_decode(q, k, v, kv_len=kv_len))
    reference = decode_reference(*_f32(q, k, v), kv_len=kv_len)[0]
    report.check(f"flex_decode contiguous B{B} S{S}", "flex_decode", decode(q, k, v, kv_len),
                 reference)
    # The same cache on pages in reversed pool order.
    pages = S // page
    table = (B * pages - 1 - np.arange(B * pages, dtype=np.int32)).reshape(B, pages)
    pools = [jnp.zeros((Hkv, B * pages, page, E), jnp.bfloat16) for _ in range(2)]
    pools = [pool.at[:, table.reshape(-1)].set(
        x.reshape(B, Hkv, pages, page, E).transpose(1, 0, 2, 3, 4).reshape(Hkv, -1, page, E))
        for pool, x in zip(pools, (k, v))]
    cache = jattn.PagedKVCache(pools[0], pools[1], jnp.asarray(table))
    paged = jax.jit(lambda q, cache, kv_len: jattn.flex_decode(q, cache, None, kv_len=kv_len))
    report.check("flex_decode paged", "flex_decode", paged(q, cache, kv_len), reference)


def _gemms(report: _Report, on_gpu: bool) -> None:
    M, N, K = (4096, 4096, 4096) if on_gpu else (256, 192, 320)
    normal = _random(np.random.default_rng(3))
    a, b, c, d = normal(M, K), normal(K, N), normal(M, K // 2), normal(K // 2, N)
    bias = normal(N)
    gelu = lambda x: jax.nn.gelu(x, approximate=True)  # noqa: E731
    report.check(f"matmul + bias + gelu {M}x{N}x{K}", "matmul",
                 jax.jit(lambda a, b, bias: jattn.matmul(a, b, bias=bias, epilogue=gelu))(
                     a, b, bias),
                 matmul_reference(*_f32(a, b), bias=bias.astype(jnp.float32), epilogue=gelu))
    batched = normal(4, M // 4, K)
    report.check("bmm", "bmm", jax.jit(jattn.bmm)(batched, b),
                 matmul_reference(*_f32(batched, b)))
    report.check("mm_plus_mm", "mm_plus_mm", jax.jit(jattn.mm_plus_mm)(a, b, c, d),
                 mm_plus_mm_reference(*_f32(a, b, c, d)))
    narrow = normal(N, 128)
    report.check("b2b_matmul (gelu between)", "b2b_matmul",
                 jax.jit(lambda a, b, c: jattn.b2b_matmul(a, b, c, gelu))(a, b, narrow),
                 b2b_reference(*_f32(a, b, narrow), gelu))
    qweight, scales = jattn.quantize_weight(b.astype(jnp.float32), bits=4, group_size=64)
    mixed = jax.jit(lambda a, qweight, scales: jattn.mixed_matmul(a, qweight, scales, bits=4,
                                                                  group_size=64))
    report.check("mixed_matmul int4 weights", "mixed_matmul", mixed(a, qweight, scales),
                 mixed_matmul_reference(a.astype(jnp.float32), qweight, scales, bits=4,
                                        group_size=64))
    a8, b8 = (x.astype(jnp.float8_e4m3fn) for x in (a, b))
    scale_a, scale_b = jnp.float32(0.5), jnp.full((N,), 2.0, jnp.float32)
    report.check("scaled_matmul fp8 e4m3", "scaled_matmul",
                 jax.jit(jattn.scaled_matmul)(a8, b8, scale_a, scale_b),
                 scaled_matmul_reference(a8, b8, scale_a, scale_b, out_dtype=jnp.float32))


def _torch_bridge_module():
    """`jattn.torch` once installed; in a source checkout run in place, its folder `interop`."""
    try:
        import jattn.torch as jt
    except ModuleNotFoundError as error:
        if error.name != "jattn.torch":
            raise
        import interop as jt
    return jt


def _torch_bridge(report: _Report, on_gpu: bool) -> None:
    try:
        import torch
        from torch.nn.attention.flex_attention import flex_attention as torch_flex

        jt = _torch_bridge_module()
    except ImportError:
        print("  torch bridge                             skipped (torch is not installed)")
        return
    device = "cuda" if on_gpu else "cpu"
    generator = torch.Generator(device).manual_seed(4)
    q, k, v = (torch.randn(1, 4, 256, 64, device=device, generator=generator) for _ in range(3))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask = jt.create_block_mask(causal, None, None, 256, 256, device=device)
    out = jt.flex_attention(q, k, v, block_mask=mask)
    with warnings.catch_warnings():  # torch's eager flex_attention says to compile it
        warnings.simplefilter("ignore")
        expected = torch_flex(q.double(), k.double(), v.double(), block_mask=mask)
    report.check("torch flex_attention (float32)", "flex_attention",
                 out.detach().cpu().numpy(), expected.float().cpu().numpy(), 1e-4)


def main() -> None:
    on_gpu = hardware.has_cuda()
    print(f"jattn {jattn.__version__} on {jax.devices()[0].device_kind} (jax {jax.__version__})")
    print(f"  {'op':<40} {'implementation':<14} error against a float32 reference")
    report = _Report()
    _attention(report, on_gpu)
    _decode(report, on_gpu)
    _gemms(report, on_gpu)
    _torch_bridge(report, on_gpu)
    if report.failed:
        print(f"FAILED: {', '.join(report.failed)}")
        sys.exit(1)
    print("all passed")


if __name__ == "__main__":
    main()
