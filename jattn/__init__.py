"""jattn: FlexAttention, flex decoding and GEMM kernels for JAX, written in Pallas."""

from jattn import masks as masks
from jattn import mods as mods
from jattn._src import source_checkout as _source_checkout
from jattn._src.attention.api import flex_attention as flex_attention
from jattn._src.attention.config import AttentionConfig as AttentionConfig
from jattn._src.attention.dot_product import dot_product_attention as dot_product_attention
from jattn._src.attention.flax_signature import (
    flax_dot_product_attention as flax_dot_product_attention)
from jattn._src.decoding.api import flex_decode as flex_decode
from jattn._src.attention.split_kv_config import DecodeConfig as DecodeConfig
from jattn._src.backends import explain as explain
from jattn._src.decoding.paged import PagedKVCache as PagedKVCache
from jattn._src.gemm.api import bmm as bmm
from jattn._src.gemm.api import matmul as matmul
from jattn._src.gemm.b2b import b2b_matmul as b2b_matmul
from jattn._src.gemm.config import B2BConfig as B2BConfig
from jattn._src.gemm.config import MatmulConfig as MatmulConfig
from jattn._src.gemm.config import MosaicMatmulConfig as MosaicMatmulConfig
from jattn._src.gemm.config import MosaicMixedConfig as MosaicMixedConfig
from jattn._src.gemm.mixed_matmul import mixed_matmul as mixed_matmul
from jattn._src.gemm.mm_plus_mm import mm_plus_mm as mm_plus_mm
from jattn._src.gemm.quantize import dequantize_weight as dequantize_weight
from jattn._src.gemm.quantize import quantize_weight as quantize_weight
from jattn._src.gemm.scaled_matmul import scaled_matmul as scaled_matmul
from jattn._src.masks.block_mask import BlockMask as BlockMask
from jattn._src.masks.create import create_block_mask as create_block_mask
from jattn._src.masks.create import create_mask as create_mask
from jattn._src.programs import clear_caches as clear_caches
from jattn._src.ring.attention import ring_flex_attention as ring_flex_attention
from jattn._src.ring.layout import from_zigzag as from_zigzag
from jattn._src.ring.sharded import sharded_flex_attention as sharded_flex_attention
from jattn._src.ring.layout import to_zigzag as to_zigzag

__all__ = ["AttentionConfig", "B2BConfig", "BlockMask", "DecodeConfig", "MatmulConfig",
           "MosaicMatmulConfig", "MosaicMixedConfig",
           "PagedKVCache", "b2b_matmul", "bmm", "clear_caches", "create_block_mask", "create_mask",
           "dequantize_weight", "dot_product_attention", "explain", "flax_dot_product_attention",
           "flex_attention", "flex_decode", "from_zigzag", "masks", "matmul", "mixed_matmul",
           "mm_plus_mm", "mods", "quantize_weight", "ring_flex_attention", "scaled_matmul",
           "sharded_flex_attention", "to_zigzag"]

__version__ = "0.1.0"

_source_checkout.install()  # `import jattn.torch` from a checkout on PYTHONPATH
