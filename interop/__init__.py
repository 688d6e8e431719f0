"""PyTorch bridge for jattn kernels (torch is imported only under this package).

`interop.torch` holds the public torch API; the ops are registered as `torch.ops.jattn.*`.

Importing `interop` before JAX has started a backend sets XLA_PYTHON_CLIENT_PREALLOCATE=false
(unless the user set it), so that JAX does not claim most of the GPU's memory next to torch's
allocator. Once JAX has started, the variable could no longer take effect, so it is left alone.
"""

import os
import sys


def _jax_has_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


if not _jax_has_started():
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

try:
    import torch  # noqa: F401
except ImportError:
    raise ImportError("jattn's torch bridge needs PyTorch: pip install 'jattn[torch]' (or "
                      "install torch for your platform first).") from None
