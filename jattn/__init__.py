"""jattn: FlexAttention, flex decoding and GEMM kernels for JAX, written in Pallas."""

from jattn._src.gemm.api import bmm as bmm
from jattn._src.gemm.api import matmul as matmul
from jattn._src.gemm.config import MatmulConfig as MatmulConfig

__version__ = "0.1.0"
