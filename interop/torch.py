"""jattn for PyTorch: the same kernels as torch ops (`torch.ops.jattn.*`), on torch tensors.

Tensors cross to JAX and back without copies (see `interop._dlpack`); autograd and
`torch.compile(fullgraph=True)` work through the registered custom ops. On CUDA tensors the
Pallas-Triton kernels run, on CPU tensors the XLA implementation, unless `implementation` says
otherwise.
"""

from __future__ import annotations

import torch

from interop import _ops  # noqa: F401  (registers torch.ops.jattn.*)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
           implementation: str | None = None) -> torch.Tensor:
    """a @ b + bias with float32 accumulation, as `jattn.matmul`.

    a: [..., M, K], b: [K, N], bias: [N] or None; bfloat16, float16 or float32 (a and b alike),
    all on one device. Returns [..., M, N] of a's dtype. Differentiable in a, b and bias.
    """
    return torch.ops.jattn.matmul(a, b, bias, implementation)


def bmm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
        implementation: str | None = None) -> torch.Tensor:
    """Batched a @ b + bias, as `jattn.bmm`: a [..., M, K], b [..., K, N] with broadcasting
    batch dims, bias [N] or None. Returns [..., M, N] of a's dtype."""
    return torch.ops.jattn.bmm(a, b, bias, implementation)
