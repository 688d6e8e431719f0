"""PyTorch bridge for jattn kernels (torch is imported only under this package).

`interop.torch` holds the public torch API; the ops are registered as `torch.ops.jattn.*`.

Importing `interop` sets XLA_PYTHON_CLIENT_PREALLOCATE=false unless the user already set it, so
JAX does not claim most of the GPU's memory next to torch's allocator. Like any XLA client
option it takes effect only if JAX has not yet initialised its GPU backend in this process.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
