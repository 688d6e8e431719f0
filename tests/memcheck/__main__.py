"""python -m tests.memcheck: the kernel subset run without pytest, as `make memcheck` runs it
under compute-sanitizer (which crashes in pytest's start-up on the GPU machine)."""

import pytest

from tests.memcheck import test_kernels_small as kernels

for name in sorted(vars(kernels)):
    if name.startswith("test_"):
        try:
            getattr(kernels, name)()
        except pytest.skip.Exception as skipped:
            print(f"{name}: skipped ({skipped.msg})", flush=True)
            continue
        print(f"{name}: ok", flush=True)
