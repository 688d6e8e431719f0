"""The torch bridge's one internal entry point: what interop/ needs beyond jattn's public API.

interop imports jattn's public names and this module, nothing else under jattn._src, so the
internals can move without breaking the bridge.
"""

from __future__ import annotations

import jax

from jattn._src import backends, compat
from jattn._src.attention import pallas_mosaic_gpu
from jattn._src.attention.api import flex_attention_backward
from jattn._src.attention.api import flex_attention_with_captures as flex_attention
from jattn._src.attention.dropout import Dropout
from jattn._src.decoding.paged import check_pool_sizes
from jattn._src.pallas_triton.launch import Constant, ConstantArray, KernelProgram, kernel_program
from jattn._src.masks.block_mask import MaskLists
from jattn._src.pallas_triton.compile import triton_compiler_available
from jattn._src.programs import register_cache

__all__ = ["Constant", "ConstantArray", "Dropout", "KernelProgram", "MaskLists",
           "backward_launches_directly", "check_pool_sizes", "compat", "flex_attention",
           "flex_attention_backward", "kernel_program", "launches_directly", "register_cache",
           "resolve", "torch_eager_facts", "unreadable_capture"]


def resolve(op: str, implementation: str | None, *, on_cuda: bool, **facts) -> str:
    """The implementation of an `op` call on CUDA tensors (on_cuda) or CPU ones: jattn's own
    choice for that platform, $JATTN_IMPLEMENTATION included; a named one must run there.
    facts: the call's facts that implementations judge support by (see backends.resolve)."""
    try:
        return backends.resolve(op, implementation, platform="gpu" if on_cuda else "cpu",
                                **facts).name
    except ValueError as error:
        if on_cuda or implementation is None:
            raise
        raise ValueError(f"{error} Here the tensors are on the CPU: an implementation that "
                         "runs on CUDA tensors needs them moved with .cuda().") from None


def torch_eager_facts(work: int) -> dict:
    """What an eager torch flex_attention call adds to its facts for the implementation
    choice, where pallas_triton's forward is the `triton` package's kernel the op launches
    without JAX: its attention work, 4 * B * Hq * L * S * E (`pallas_mosaic_gpu.slower`)."""
    return {"torch_eager_work": work} if triton_compiler_available() else {}


def launches_directly(implementation: str) -> bool:
    """Whether the implementation's forward is one compiled kernel the torch ops may launch
    without JAX's dispatch."""
    return backends.BACKENDS[implementation].direct_launch


def backward_launches_directly(implementation: str) -> bool:
    """Whether flex_attention's backward on the implementation is pallas_triton's kernels,
    which the torch ops may launch without JAX's dispatch."""
    found = backends.implementations("flex_attention")
    return (not backends.BACKENDS[implementation].interpret
            and found[implementation].module.backward is found["pallas_triton"].module.backward)


def unreadable_capture(bind_score, bind_mask, n_score: int, specs,
                       seq_lengths: tuple[int, int]) -> str | None:
    """flex_attention's `unreadable_capture` fact of translated mods on sequences of
    `seq_lengths` (L, S): bind_score(arrays) and bind_mask(arrays) make the mods reading
    captured arrays of `specs` ((shape, dtype) each, score_mod's `n_score` first); None for
    either absent mod."""
    found = []

    def trace(*captures):
        score_mod = None if bind_score is None else bind_score(captures[:n_score])
        mask_mod = None if bind_mask is None else bind_mask(captures[n_score:])
        found.append(pallas_mosaic_gpu.unreadable_capture(score_mod, mask_mod,
                                                          captures[:n_score],
                                                          captures[n_score:],
                                                          seq_lengths))
        return ()

    jax.eval_shape(trace, *(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs))
    return found[0]
