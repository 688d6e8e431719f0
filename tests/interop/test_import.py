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
    # before JAX starts: unset becomes false; a user's value stands (the import's code run
    # again by a reload, JAX still not started)
    before = _run("import importlib, os; os.environ.pop('XLA_PYTHON_CLIENT_PREALLOCATE', None); "
                  "import interop; print(os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')); "
                  "os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'true'; "
                  "importlib.reload(interop); print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])")
    after = _run("import os; os.environ.pop('XLA_PYTHON_CLIENT_PREALLOCATE', None); "
                 "import jax.numpy as jnp; jnp.ones(1); import interop; "
                 "print(os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'))")
    assert before.stdout.split() == ["false", "true"], before.stderr[-2000:]
    assert after.stdout.split() == ["None"]


def test_a_source_checkout_on_the_path_imports_jattn_torch():
    """PYTHONPATH at an uninstalled checkout (the README's GPU instructions): `jattn.torch` is
    the `interop` package, as installed."""
    import pathlib
    import site

    root = pathlib.Path(__file__).resolve().parents[2]
    paths = [str(root), *site.getsitepackages()]  # without site's .pth files (no install)
    code = (f"import sys; sys.path[:0] = {paths!r}; import jattn.torch as jt, torch; "
            "print(jt.matmul(torch.ones(2, 3), torch.ones(3, 4)).shape)")
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.split() == ["torch.Size([2,", "4])"], result.stderr
