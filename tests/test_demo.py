"""`python -m jattn.demo` runs every op family against its reference and passes."""

import subprocess
import sys
import time


def test_demo_passes_within_a_minute():
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "jattn.demo"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "all passed"
    for family in ("flex_attention forward", "flex_attention backward", "flex_decode paged",
                   "matmul", "bmm", "mm_plus_mm", "b2b_matmul", "mixed_matmul",
                   "scaled_matmul", "torch flex_attention"):
        assert any(line.strip().startswith(family) and line.endswith("PASS") for line in lines)
    assert time.perf_counter() - start < 60
