"""Markers: `gpu` tests run only where JAX sees a CUDA device. The CPU platform has 8 devices
(forced host devices) for the multi-device tests; single-device tests run on the first.
Fixtures: `as_if_on_hopper`."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to torch too
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
# Without a GPU the suite's time is mostly XLA's CPU compiler optimising thousands of small
# programs that then run once or twice: the same programs with unoptimised machine code (no
# fast math either way) compile about a third faster. Set before JAX starts; the docs' and
# packaging tests' subprocesses inherit it.
if (not os.path.exists("/dev/nvidiactl")
        and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]):
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax
import pytest

from jattn._src import hardware
from jattn._src.hardware import has_cuda


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def as_if_on_hopper(monkeypatch):
    """Selects the GPU paths without a GPU (only lowering runs, nothing executes)."""
    monkeypatch.setattr(hardware, "has_cuda", lambda: True)
    monkeypatch.setattr(hardware, "is_hopper", lambda: True)


@pytest.fixture
def mosaic_interpreted(as_if_on_hopper, monkeypatch):
    """Mosaic GPU kernels run in JAX's GPU interpreter on the CPU (jax >= 0.11: 0.10's cannot
    load from global memory), their programs walking several tiles each."""
    if tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11):
        pytest.skip("jax 0.10's Mosaic GPU interpreter cannot load from global memory "
                    "(jax >= 0.11 runs these; the GPU machine has it)")
    from jax._src.pallas.mosaic_gpu.interpret.params import (InterpretGPUParams,
                                                              force_gpu_interpret_mode)

    monkeypatch.setattr(hardware, "num_sms", lambda: 3)
    with force_gpu_interpret_mode(InterpretGPUParams()):
        yield
