"""jattn kernels registered as torch custom ops: `torch.library.custom_op` with a fake (meta)
implementation for torch.compile and an autograd formula whose backward is another custom op
running `jax.vjp` of the same jattn function, so torch gradients equal JAX's bit for bit.

Each op converts its tensors through `_dlpack` (zero-copy), calls a jitted JAX function (compiled
once per shapes, dtypes and options by jit's cache) and hands the result back as a tensor.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import torch
from torch import Tensor

import jattn
from interop._dlpack import same_device, to_jax, to_torch

# ------------------------------------------------------------------------------------------------
# Implementation choice from the tensors' device
# ------------------------------------------------------------------------------------------------


def implementation_for(fn: str, device: torch.device, implementation: Optional[str]) -> str:
    """The jattn implementation for tensors on `device`: the Pallas kernels on CUDA, XLA on the
    CPU, unless the caller named one (the GPU kernel on CPU tensors is an error)."""
    if implementation is None:
        return "pallas_triton" if device.type == "cuda" else "xla"
    if implementation == "pallas_triton" and device.type != "cuda":
        raise ValueError(f"{fn}: implementation='pallas_triton' runs on CUDA tensors, got tensors "
                         f"on {device}; move them with .cuda() or use 'xla'.")
    return implementation


def _arrays(**tensors: Tensor | None) -> list[jax.Array | None]:
    return [None if t is None else to_jax(t, name) for name, t in tensors.items()]


# ------------------------------------------------------------------------------------------------
# matmul / bmm
# ------------------------------------------------------------------------------------------------

_GEMMS = {"matmul": jattn.matmul, "bmm": jattn.bmm}


@functools.partial(jax.jit, static_argnames=("kind", "implementation"))
def _gemm(a, b, bias, *, kind: str, implementation: str):
    return _GEMMS[kind](a, b, bias=bias, implementation=implementation)


@functools.partial(jax.jit, static_argnames=("kind", "implementation"))
def _gemm_vjp(grad, a, b, bias, *, kind: str, implementation: str):
    def gemm(a, b, bias):
        return _GEMMS[kind](a, b, bias=bias, implementation=implementation)
    return jax.vjp(gemm, a, b, bias)[1](grad)


def _run_gemm(kind: str, a: Tensor, b: Tensor, bias: Optional[Tensor],
              implementation: Optional[str]) -> Tensor:
    device = same_device(kind, a=a, b=b, bias=bias)
    impl = implementation_for(kind, device, implementation)
    return to_torch(_gemm(*_arrays(a=a, b=b, bias=bias), kind=kind, implementation=impl))


def _run_gemm_backward(kind: str, grad: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor],
                       implementation: Optional[str]) -> list[Tensor]:
    device = same_device(kind, grad=grad, a=a, b=b, bias=bias)
    impl = implementation_for(kind, device, implementation)
    grads = _gemm_vjp(*_arrays(grad=grad, a=a, b=b, bias=bias), kind=kind, implementation=impl)
    return [to_torch(g) for g in grads if g is not None]


@torch.library.custom_op("jattn::matmul", mutates_args=())
def matmul(a: Tensor, b: Tensor, bias: Optional[Tensor], implementation: Optional[str]) -> Tensor:
    return _run_gemm("matmul", a, b, bias, implementation)


@torch.library.custom_op("jattn::matmul_backward", mutates_args=())
def matmul_backward(grad: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor],
                    implementation: Optional[str]) -> list[Tensor]:
    return _run_gemm_backward("matmul", grad, a, b, bias, implementation)


@torch.library.custom_op("jattn::bmm", mutates_args=())
def bmm(a: Tensor, b: Tensor, bias: Optional[Tensor], implementation: Optional[str]) -> Tensor:
    return _run_gemm("bmm", a, b, bias, implementation)


@torch.library.custom_op("jattn::bmm_backward", mutates_args=())
def bmm_backward(grad: Tensor, a: Tensor, b: Tensor, bias: Optional[Tensor],
                 implementation: Optional[str]) -> list[Tensor]:
    return _run_gemm_backward("bmm", grad, a, b, bias, implementation)


@matmul.register_fake
def _matmul_fake(a, b, bias, implementation):
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


@bmm.register_fake
def _bmm_fake(a, b, bias, implementation):
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return a.new_empty((*batch, a.shape[-2], b.shape[-1]))


def _gemm_backward_fake(grad, a, b, bias, implementation):
    return [torch.empty_like(x) for x in (a, b, bias) if x is not None]


matmul_backward.register_fake(_gemm_backward_fake)
bmm_backward.register_fake(_gemm_backward_fake)


def _gemm_setup_context(ctx, inputs, output):
    a, b, bias, implementation = inputs
    ctx.save_for_backward(a, b, bias)
    ctx.implementation = implementation


def _gemm_autograd(backward_op):
    def backward(ctx, grad):
        a, b, bias = ctx.saved_tensors
        grads = backward_op(grad, a, b, bias, ctx.implementation)
        return grads[0], grads[1], grads[2] if bias is not None else None, None
    return backward


matmul.register_autograd(_gemm_autograd(matmul_backward), setup_context=_gemm_setup_context)
bmm.register_autograd(_gemm_autograd(bmm_backward), setup_context=_gemm_setup_context)
