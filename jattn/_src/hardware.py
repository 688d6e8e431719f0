"""Facts about the hardware the kernels run on: which platform, how many SMs, how much smem."""

from __future__ import annotations

import functools

import jax

# An H100's streaming multiprocessors: the split choices' target where JAX reports no count
# (the CPU, when tests lower the GPU kernels there).
H100_NUM_SMS = 132

# Shared memory one Triton program may use on an H100 (227 KiB): configs needing more are
# skipped by the GEMM search space and shrunk by the mixed-precision heuristic.
SHARED_MEMORY_BYTES = 227 * 1024


@functools.cache
def has_cuda() -> bool:
    """True when JAX sees at least one CUDA device."""
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def default_platform() -> str:
    """"gpu" when JAX sees a CUDA device, else "cpu": the platform a JAX call runs on."""
    return "gpu" if has_cuda() else "cpu"


def device_kind() -> str:
    """The kind of JAX's default device, e.g. 'NVIDIA H100 80GB HBM3' or 'cpu'."""
    return jax.devices()[0].device_kind


def is_hopper() -> bool:
    """Whether JAX's default device is a Hopper GPU (compute capability 9.x: H100, H200)."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    return isinstance(capability, str) and capability.startswith("9.")


def num_sms() -> int:
    """SMs of the default device (JAX reports them for GPUs; elsewhere an H100's count)."""
    return getattr(jax.devices()[0], "core_count", None) or H100_NUM_SMS
