"""Importing the torch bridge: a clear error without torch; no environment change once JAX has
started (where the variable could no longer take effect)."""

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_without_torch_the_error_names_the_extra():
    result = _run("import sys; sys.modules['torch'] = None; import interop.torch")
    assert result.returncode != 0
    assert "pip install 'jattn[torch]'" in result.stderr.splitlines()[-1]


def test_preallocation_is_set_only_before_jax_starts():
    before = _run("import os; os.environ.pop('XLA_PYTHON_CLIENT_PREALLOCATE', None); "
                  "import interop; print(os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'))")
    after = _run("import os; os.environ.pop('XLA_PYTHON_CLIENT_PREALLOCATE', None); "
                 "import jax.numpy as jnp; jnp.ones(1); import interop; "
                 "print(os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'))")
    assert before.stdout.split() == ["false"] and after.stdout.split() == ["None"]
