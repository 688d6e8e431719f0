"""jattn for PyTorch: the kernels as torch ops (`torch.ops.jattn.*`) on torch tensors.

    import jattn.torch as jt

    out = jt.flex_attention(q, k, v, score_mod, block_mask)   # torch's signature and behaviour

Installed, this package is `jattn.torch`; its source is the repository's `interop/` folder, so a
source checkout that is not installed imports it as `interop`. Functions: flex_attention,
create_block_mask, flex_decode, PagedKVCache, matmul, bmm, mm_plus_mm, b2b_matmul,
scaled_matmul, mixed_matmul, quantize_weight (docs/torch.md).

Importing it before JAX has started a backend sets XLA_PYTHON_CLIENT_PREALLOCATE=false (unless
the user set it), so that JAX does not claim most of the GPU's memory next to torch's allocator.
Once JAX has started, the variable could no longer take effect, so it is left alone.
"""

import os
import sys

# An editable install in a source checkout can import this package under both of its names. Two
# copies would register the torch ops twice, so the second name is bound to the first's modules.
_NAMES = ("jattn.torch", "interop")
_twin = next((name for name in _NAMES if name != __name__ and name in sys.modules), None)


def _share_modules(twin: str, name: str) -> None:
    for module_name, module in list(sys.modules.items()):
        if module_name == twin or module_name.startswith(twin + "."):
            sys.modules[name + module_name[len(twin):]] = module


def _jax_has_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jattn._src.bridge import compat

    return compat.backends_started()


if _twin is not None:
    _share_modules(_twin, __name__)
else:
    if not _jax_has_started():
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ImportError("jattn's torch bridge needs PyTorch: pip install 'jattn[torch]' (or "
                          "install torch for your platform first).") from None
    from .torch import *  # noqa: F403
    from .torch import __all__  # noqa: F401
