"""Markers: `gpu` tests run only where JAX sees a CUDA device; `slow` marks long CPU tests."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to torch too

import pytest

from jattn._src.hardware import has_cuda


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
