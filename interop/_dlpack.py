"""The one place tensors cross between torch and JAX: DLPack, zero-copy both ways.

What is shared rather than copied: a contiguous tensor's memory becomes a JAX array's buffer
(same address) and a JAX result becomes a torch tensor on the same buffer. The exceptions are
explicit: a non-contiguous tensor is made contiguous first (one copy), int64 becomes int32 unless
JAX runs with x64 enabled (one copy; JAX's default integer is 32-bit), and the CPU backend copies
a tensor whose address is not aligned to XLA's requirement (e.g. a view at an odd offset).

Streams on the GPU: JAX's `from_dlpack` passes its stream to the tensor's `__dlpack__`, so our
kernels start after the work already queued on torch's current stream; `torch.from_dlpack` passes
torch's current stream to the array's `__dlpack__`, so later torch work waits for our result.
Each JAX array keeps its DLPack capsule, hence the torch storage, alive until JAX is done with it.
"""

from __future__ import annotations

import jax
import jax.dlpack
import jax.numpy as jnp
import torch

# torch dtype -> JAX dtype, for every dtype that crosses.
DTYPES = {
    torch.bfloat16: jnp.bfloat16,
    torch.float16: jnp.float16,
    torch.float32: jnp.float32,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.bool: jnp.bool_,
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.float8_e5m2: jnp.float8_e5m2,
}


def to_jax(tensor: torch.Tensor, name: str) -> jax.Array:
    """A JAX array on the same device and memory as `tensor` (detached from autograd).

    name: the argument's name, for errors.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.dtype not in DTYPES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise TypeError(f"`{name}` has dtype {tensor.dtype}; supported: {supported}.")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"`{name}` is on {tensor.device}; jattn runs on CPU and CUDA tensors.")
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()  # the one documented copy
    return jax.dlpack.from_dlpack(tensor)


def to_torch(array: jax.Array) -> torch.Tensor:
    """A torch tensor on the same device and memory as `array`."""
    return torch.from_dlpack(array)


def same_device(fn: str, **tensors: torch.Tensor | None) -> torch.device:
    """The one device all given tensors (None skipped) are on, else a clear error."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        seen = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"{fn}: all tensors must be on one device, got {seen}.")
    return next(iter(devices.values()))
