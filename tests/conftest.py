"""Markers: `gpu` tests run only where JAX sees a CUDA device. The CPU platform has 8 devices
(forced host devices) for the multi-device tests; single-device tests run on the first."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to torch too
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import pytest

from jattn._src.hardware import has_cuda


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
