"""jattn for PyTorch: the same kernels as torch ops (`torch.ops.jattn.*`), on torch tensors.

Users import the package (`import jattn.torch as jt`), which re-exports this module's names.

Tensors cross to JAX and back without copies (see `_dlpack.py`); autograd and
`torch.compile(fullgraph=True)` work through the registered custom ops. On CUDA tensors the
Pallas-Triton kernels run, on CPU tensors the XLA implementation, unless `implementation` says
otherwise.
"""

from __future__ import annotations

import dataclasses
import operator
import typing
import warnings

import jax
import torch
import torch.nn.attention.flex_attention as _flex
# torch's mask helpers and types, so that `from jattn.torch import ...` replaces
# `from torch.nn.attention.flex_attention import ...` (jattn's ops take them as torch's do)
from torch.nn.attention.flex_attention import (AuxOutput, AuxRequest, BlockMask,
                                               FlexKernelOptions, and_masks, create_mask,
                                               noop_mask, or_masks)

import jattn
from jattn._src.bridge import check_pool_sizes
from . import _decode_ops, _dlpack, _gemm_ops, _ops  # they register torch.ops.jattn.*
from ._capture import capture

__all__ = ["AuxOutput", "AuxRequest", "BlockMask", "FlexKernelOptions", "PagedKVCache",
           "and_masks", "b2b_matmul", "bmm", "create_block_mask", "create_mask",
           "flex_attention", "flex_decode", "matmul", "mixed_matmul", "mm_plus_mm", "noop_mask",
           "or_masks", "quantize_weight", "scaled_matmul"]

# ------------------------------------------------------------------------------------------------
# GEMMs
# ------------------------------------------------------------------------------------------------


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
           implementation: str | None = None) -> torch.Tensor:
    """a @ b + bias with float32 accumulation, as `jattn.matmul`.

    a: [..., M, K], b: [K, N], bias: [N] or None; bfloat16, float16 or float32 (a and b alike),
    all on one device. Returns [..., M, N] of a's dtype. Differentiable in a, b and bias.

    Example::

        a = torch.randn(4, 32, 64, requires_grad=True)  # [..., M, K] float32
        b, bias = torch.randn(64, 16), torch.zeros(16)  # [K, N], [N]
        out = jt.matmul(a, b, bias)
        out.sum().backward()
        print(out.shape, a.grad.shape)  # torch.Size([4, 32, 16]) torch.Size([4, 32, 64])
    """
    return _gemm_ops.run_op("matmul", a, b, bias, implementation)


def bmm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
        implementation: str | None = None) -> torch.Tensor:
    """Batched a @ b + bias, as `jattn.bmm`: a [..., M, K], b [..., K, N] with broadcasting
    batch dims, bias [N] or None; bfloat16, float16 or float32 (a and b alike), all on one
    device. Returns [..., M, N] of a's dtype.

    Example::

        a = torch.randn(4, 64, 32, dtype=torch.bfloat16)  # [batch, M, K]
        b = torch.randn(1, 32, 16, dtype=torch.bfloat16)  # [1, K, N]: shared by the batch
        print(jt.bmm(a, b).shape)  # torch.Size([4, 64, 16])
    """
    return _gemm_ops.run_op("bmm", a, b, bias, implementation)


def mm_plus_mm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
               bias: torch.Tensor | None = None, *,
               implementation: str | None = None) -> torch.Tensor:
    """a @ b + c @ d + bias, both products in one float32 accumulator (one kernel), as
    `jattn.mm_plus_mm`.

    a: [..., M, K1], b: [K1, N], c: [..., M, K2] (a's leading dims; K2 may differ from K1),
    d: [K2, N], bias: [N] or None; bfloat16, float16 or float32 (a, b, c, d alike), all on one
    device. Returns [..., M, N] of a's dtype. Differentiable in a, b, c, d and bias.

    Example::

        a, b = torch.randn(64, 32), torch.randn(32, 16)  # [M, K1], [K1, N]
        c, d = torch.randn(64, 48), torch.randn(48, 16)  # [M, K2], [K2, N]
        print(jt.mm_plus_mm(a, b, c, d).shape)  # torch.Size([64, 16])
    """
    return _gemm_ops.run_op("mm_plus_mm", a, b, c, d, bias, implementation)


def b2b_matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, side: str = "left",
               implementation: str | None = None) -> torch.Tensor:
    """Back-to-back GEMM (a @ b) @ c (side="left") or a @ (b @ c) (side="right"), as
    `jattn.b2b_matmul` with fn=None: the intermediate is accumulated in float32, rounded to the
    input dtype and multiplied on chip, chunk by chunk.

    left: a [..., M, K], b [K, P], c [P, N]; right: a [..., M, P], b [P, K], c [K, N].
    bfloat16, float16 or float32 (one dtype), one device. Returns [..., M, N] of the input
    dtype. Differentiable in a, b and c. jattn's elementwise `fn` on the intermediate is not
    supported from torch yet (a torch-written fn would need translating to JAX, as
    flex_attention's mods are); compose `matmul` calls instead, e.g.
    `matmul(fn(matmul(a, b)), c)`.

    Example::

        a = torch.randn(64, 32, dtype=torch.float16)  # [M, K]
        b = torch.randn(32, 128, dtype=torch.float16)  # [K, P]
        c = torch.randn(128, 16, dtype=torch.float16)  # [P, N]
        print(jt.b2b_matmul(a, b, c).shape)  # torch.Size([64, 16])
    """
    return _gemm_ops.run_op("b2b_matmul", a, b, c, side, implementation)


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                  scale_b: torch.Tensor, *, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16, use_fast_accum: bool = False,
                  implementation: str | None = None) -> torch.Tensor:
    """(a @ b) * scale_a * scale_b + bias on fp8 tensors, as torch._scaled_mm and
    `jattn.scaled_matmul` (float32 accumulation; scales, then bias, then the cast, in-kernel).

    a: [M, K], b: [K, N] (any strides; a non-contiguous one is copied once), one fp8 dtype:
    torch.float8_e4m3fn or torch.float8_e5m2. scale_a: float32, a scalar (tensor-wise) or [M] /
    [M, 1] (row-wise); scale_b: float32, a scalar or [N] / [1, N]. bias: [N] of any float dtype,
    added after scaling. out_dtype: torch.bfloat16, torch.float16 or torch.float32.
    use_fast_accum: as torch._scaled_mm's (see `jattn.scaled_matmul`). All on one device.
    Returns [M, N] of out_dtype. Forward (inference) only: inputs may require grad, but
    backward through the result raises NotImplementedError (in compiled code too).

    Example::

        a = torch.randn(64, 32).to(torch.float8_e4m3fn)  # [M, K]
        b = torch.randn(32, 16).to(torch.float8_e4m3fn)  # [K, N]
        scale_a, scale_b = torch.tensor(0.5), torch.ones(16)  # tensor-wise, row-wise [N]
        out = jt.scaled_matmul(a, b, scale_a, scale_b, out_dtype=torch.float32)
        print(out.shape, out.dtype)  # torch.Size([64, 16]) torch.float32
    """
    return _gemm_ops.run_op("scaled_matmul", a, b, scale_a, scale_b, bias, out_dtype,
                            use_fast_accum, implementation)


def quantize_weight(w: torch.Tensor, bits: int = 8,
                    group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`jattn.quantize_weight` on a torch [K, N] weight (N output channels; for an
    nn.Linear, `linear.weight.T`): symmetric int8 or int4 with one scale per output channel
    (group_size None) or per group of group_size K rows. w: a floating-point tensor.

    Returns (qweight, scales) on w's device, in jattn's quantised layout (see
    `jattn.quantize_weight`; its shapes are jattn's business): pass both to `mixed_matmul`
    unchanged. The scales have w's dtype and may be made learnable (`requires_grad_()`).
    (For reference: qweight int8 [N, K] (bits=8) or uint8 [N, K/2] (bits=4); scales [N] or
    [K / group_size, N].)

    Example::

        w = torch.randn(128, 64, dtype=torch.bfloat16)  # [K, N]
        qweight, scales = jt.quantize_weight(w, bits=4, group_size=32)  # uint8, bfloat16
        print(tuple(qweight.shape), tuple(scales.shape))  # (64, 64) (4, 64)
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"quantize_weight: `w` must be a torch.Tensor, got {type(w).__name__}.")
    return _gemm_ops.quantize_weight(w, bits, group_size)


def mixed_matmul(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, *, bits: int,
                 group_size: int | None = None,
                 implementation: str | None = None) -> torch.Tensor:
    """a @ W for a weight W ≈ q · scales stored as int8 or int4 (qweight, scales from
    `quantize_weight` with the same bits and group_size), dequantised inside the kernel, as
    `jattn.mixed_matmul`.

    a: [..., M, K] bfloat16 or float16; all on one device. Returns [..., M, N] of a's dtype.
    Differentiable in a and scales; the integer qweight is frozen.

    Example::

        linear = torch.nn.Linear(128, 64, bias=False, dtype=torch.bfloat16)  # K = 128, N = 64
        qweight, scales = jt.quantize_weight(linear.weight.detach().T, bits=8)
        x = torch.randn(8, 128, dtype=torch.bfloat16)  # [M, K]
        out = jt.mixed_matmul(x, qweight, scales, bits=8)
        print(out.shape, out.dtype)  # torch.Size([8, 64]) torch.bfloat16
    """
    return _gemm_ops.run_op("mixed_matmul", a, qweight, scales, bits, group_size,
                            implementation)


# ------------------------------------------------------------------------------------------------
# Flex attention
# ------------------------------------------------------------------------------------------------


def _mask_tensors(block_mask, L: int, S: int, fn: str = "flex_attention", batch_heads=None
                  ) -> tuple[list[torch.Tensor], list[int]]:
    """A torch BlockMask's lists in the ops' order (zero-copy; the q-major ones derived from
    the kv-major ones where the mask has none), and its block size. Given q's (batch, heads),
    the lists are read as torch's kernels read them (`_read_as_torch`)."""
    _check_block_mask(block_mask, L, S, fn)
    fields = [getattr(block_mask, name) for name in _ops.MASK_FIELDS]
    if fields[2] is None:
        fields = _with_q_major(fields, block_mask.seq_lengths, block_mask.BLOCK_SIZE)
    fields = [f for f in fields if f is not None]
    if batch_heads is not None:
        fields = _read_as_torch(fields, *batch_heads)
    return fields, list(block_mask.BLOCK_SIZE)


def _read_as_torch(lists: list[torch.Tensor], B: int, Hq: int) -> list[torch.Tensor]:
    """The lists at q's batch and heads where the mask's are neither 1 nor q's: torch's
    kernels read batch b and head h of a mask at (b % its batch, h % its heads), so a mask
    built for 2 heads serves 4 query heads as heads 0, 1, 0, 1."""
    Bm, Hm = lists[0].shape[:2]
    if Bm in (1, B) and Hm in (1, Hq):
        return lists
    device = lists[0].device
    batches = torch.arange(B, device=device) % Bm if Bm != 1 else slice(None)
    heads = torch.arange(Hq, device=device) % Hm if Hm != 1 else slice(None)
    return [x[batches][:, heads] for x in lists]


def _check_block_mask(block_mask, L: int, S: int, fn: str) -> None:
    if not isinstance(block_mask, _flex.BlockMask):
        raise TypeError(f"{fn}: `block_mask` must be a torch BlockMask (from "
                        "jattn.torch.create_block_mask or torch's create_block_mask), got "
                        f"{type(block_mask).__name__}.")
    if tuple(block_mask.seq_lengths) != (L, S):
        raise ValueError(f"{fn}: block_mask was built for (Q_LEN, KV_LEN) = "
                         f"{tuple(block_mask.seq_lengths)} but q has length {L} and k {S}.")
    _check_block_size(tuple(block_mask.BLOCK_SIZE), fn)


def _check_block_size(block_size: tuple[int, int], fn: str) -> None:
    if len(block_size) != 2 or not all(isinstance(b, int) and b >= 1 for b in block_size):
        raise ValueError(f"{fn}: BLOCK_SIZE must be a positive int or a pair of them, got "
                         f"{block_size}.")


def _with_q_major(fields: list, seq_lengths, block_size) -> list:
    """MASK_FIELDS' lists with the q-major ones (which only the backward reads) made from the
    kv-major ones, for a BlockMask built with compute_q_blocks=False."""
    kv_num, kv_idx, _, _, full_num, full_idx, _, _ = fields
    arrays = [None if x is None else _dlpack.to_jax(x, name) for x, name in
              zip((kv_num, kv_idx, full_num, full_idx), _ops.kv_major(_ops.MASK_FIELDS))]
    mask = jattn.BlockMask.from_kv_blocks(
        arrays[0], arrays[1], arrays[2], arrays[3], block_size=tuple(block_size),
        seq_lengths=tuple(seq_lengths))
    device = kv_num.device
    q_major = [None if x is None else _dlpack.to_torch(x, device) for x in (
        mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)]
    return [kv_num, kv_idx, *q_major[:2], full_num, full_idx, *q_major[2:]]


def _block_mask_mod(block_mask):
    """The mask_mod a BlockMask's partial blocks apply (None: torch's noop_mask)."""
    if block_mask is None or block_mask.mask_mod is _flex.noop_mask:
        return None
    if block_mask.mask_mod is getattr(_flex, "_sliced_mask_mod_error", None):
        raise RuntimeError("flex_attention: cannot use the mask_mod of a sliced BlockMask (as "
                           "torch says): give the slice its own, e.g. "
                           "`mask.mask_mod = offset_mask_mod` for decoding.")
    return block_mask.mask_mod


def _aux_request(return_lse: bool, return_aux) -> tuple[bool, bool]:
    """Whether the caller wants the LSE (from torch's two ways of asking for it) and the rows'
    largest scores."""
    if return_aux is None:
        if return_lse:
            _warn_return_lse()
        return bool(return_lse), False
    if return_lse:
        raise ValueError("flex_attention: pass return_lse or return_aux, not both (torch "
                         "deprecates return_lse; use return_aux=AuxRequest(lse=True)).")
    if not isinstance(return_aux, _flex.AuxRequest):
        raise TypeError(f"flex_attention: `return_aux` must be an AuxRequest, got "
                        f"{type(return_aux).__name__}.")
    return bool(return_aux.lse), bool(return_aux.max_scores)


_RETURN_LSE_WARNED = []  # (torch warns once a process)


def _warn_return_lse() -> None:
    """torch's FutureWarning for return_lse, once a process and never while compiling."""
    if not _RETURN_LSE_WARNED and not torch.compiler.is_compiling():
        _RETURN_LSE_WARNED.append(True)
        warnings.warn("return_lse is deprecated in torch's flex_attention (which jattn's "
                      "follows); use return_aux=AuxRequest(lse=True) instead.", FutureWarning,
                      stacklevel=5)


# torch's kernel_options -> AttentionConfig fields. torch's backward has a tile per kernel (M1 x
# N1 for dK/dV, M2 x N2 for dQ); jattn's two backward kernels share one. Unprefixed warps and
# stages set both passes; fwd_/bwd_ prefixes set one (and win).
_KERNEL_OPTIONS = {"BLOCK_M": ("block_q",), "BLOCK_N": ("block_k",),
                   "BLOCK_M1": ("bwd_block_q",), "BLOCK_M2": ("bwd_block_q",),
                   "BLOCK_N1": ("bwd_block_k",), "BLOCK_N2": ("bwd_block_k",),
                   "num_warps": ("num_warps", "bwd_num_warps"),
                   "num_stages": ("num_stages", "bwd_num_stages"),
                   "fwd_num_warps": ("num_warps",), "fwd_num_stages": ("num_stages",),
                   "bwd_num_warps": ("bwd_num_warps",), "bwd_num_stages": ("bwd_num_stages",),
                   "fwd_BLOCK_M": ("block_q",), "fwd_BLOCK_N": ("block_k",),
                   "bwd_BLOCK_M1": ("bwd_block_q",), "bwd_BLOCK_M2": ("bwd_block_q",),
                   "bwd_BLOCK_N1": ("bwd_block_k",), "bwd_BLOCK_N2": ("bwd_block_k",)}


def _option_priority(key: str) -> tuple[bool, bool]:
    """Keys applied in this order, later ones winning: unprefixed before `fwd_`/`bwd_`
    prefixed, and the dQ kernel's tile (BLOCK_M2/N2) before the dK/dV kernel's (M1/N1):
    jattn's two backward kernels share one tile, which torch's usual (M1, N1, M2, N2) =
    (32, 64, 64, 32) cannot give both."""
    return key.startswith(("fwd_", "bwd_")), not key.endswith(("BLOCK_M2", "BLOCK_N2"))


def _config(kernel_options, dtype: torch.dtype) -> str | None:
    """The AttentionConfig that torch's kernel_options ask for (its other fields at
    AttentionConfig's defaults) and torch's float32 precision for `dtype`, encoded for the op;
    None when neither applies. Keys without a jattn counterpart (PRESCALE_QK, BACKEND, USE_TMA,
    ...) are ignored."""
    precision = _ops.float32_precision(dtype)
    if kernel_options is None:
        return _ops.encode_config(None, precision)
    if not isinstance(kernel_options, dict):
        raise TypeError(f"flex_attention: `kernel_options` must be a dict or None, got "
                        f"{type(kernel_options).__name__}.")
    _check_backend(kernel_options)
    fields = {}
    for key in sorted(kernel_options, key=_option_priority):
        for name in _KERNEL_OPTIONS.get(key, ()):
            fields[name] = kernel_options[key]
    if not fields:
        return _ops.encode_config(None, precision)
    try:
        return _ops.encode_config(jattn.AttentionConfig(**fields), precision)
    except (TypeError, ValueError) as error:
        raise ValueError(f"flex_attention: kernel_options {kernel_options} give an invalid "
                         f"jattn config: {error}") from None


def _check_backend(kernel_options: dict) -> None:
    """torch's checks of kernel_options["BACKEND"]: jattn picks its own kernels, but a value
    torch rejects is a mistake torch users rely on hearing about."""
    if "BACKEND" not in kernel_options:
        return
    if kernel_options.get("FORCE_USE_FLEX_ATTENTION", False):
        raise RuntimeError("flex_attention: kernel_options BACKEND cannot be combined with the "
                           "legacy FORCE_USE_FLEX_ATTENTION; drop FORCE_USE_FLEX_ATTENTION.")
    valid = typing.get_args(getattr(_flex, "_Backend", None))
    if valid and kernel_options["BACKEND"] not in valid:
        raise ValueError(f"flex_attention: invalid kernel_options BACKEND value "
                         f"{kernel_options['BACKEND']!r}; must be one of {valid}.")


def _check_dense(query, key, value) -> None:
    if any(isinstance(x, torch.Tensor) and x.is_nested for x in (query, key, value)):
        raise NotImplementedError(
            "flex_attention does not take NestedTensor (jagged) query, key or value, as "
            "torch's does not: convert them to dense tensors, or pack the sequences into one "
            "and keep them apart with a document mask_mod.")


def _autocast(*tensors):
    """q, k and v as torch's flex_attention takes them under `torch.autocast`: each floating
    tensor on query's device type, float64 excepted, cast to that device's autocast dtype."""
    first = tensors[0]
    device_type = first.device.type if isinstance(first, torch.Tensor) else None
    if (device_type is None or not torch.amp.is_autocast_available(device_type)
            or not torch.is_autocast_enabled(device_type)):  # (meta tensors have no autocast)
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                 and x.dtype != torch.float64 and x.device.type == device_type else x
                 for x in tensors)


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype the call computes in: q's, k and v cast to it as torch does (float64 runs
    on jattn's xla implementation, in JAX's x64 mode)."""
    return query.dtype


def _follow_layout(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`out` with `like`'s stride order (torch's flex_attention output follows q's)."""
    if like.is_contiguous() or out.dim() != like.dim():
        return out
    order = sorted(range(like.dim()), key=lambda d: (-like.stride(d), d))
    if order[-1] != like.dim() - 1:
        order.remove(like.dim() - 1)
        order.append(like.dim() - 1)  # the feature dim stays innermost
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return out.permute(order).contiguous().permute(inverse)


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   score_mod=None, block_mask=None, scale: float | None = None,
                   enable_gqa: bool = False, return_lse: bool = False, kernel_options=None,
                   *, return_aux=None, implementation: str | None = None,
                   sinks: torch.Tensor | None = None, dropout_p: float = 0.0):
    """`jattn.flex_attention` on torch tensors, with torch FlexAttention's signature and
    behaviour (`torch.nn.attention.flex_attention.flex_attention`).

    query [B, Hq, L, E], key [B|1, Hkv, S, E], value [B|1, Hkv, S, Ev] on one device, any of
    bfloat16, float16, float32 and float64: key and value are cast to query's dtype and the
    output has it (float64 is computed in float64, on the CPU). score_mod
    `f(score, b, h, q_idx, kv_idx)` and the block mask's mask_mod `f(b, h, q_idx, kv_idx)` are
    torch-written (any callable: function, lambda, bound method, functools.partial,
    nn.Module) or JAX functions such as `jattn.mods`. What a torch mod reads is re-read on
    every call: tensors it closes over are passed to the kernels (and get gradients), a
    changed Python value re-translates it (see the README). block_mask is a torch BlockMask
    (`create_block_mask` below, or torch's).
    kernel_options: BLOCK_M/BLOCK_N (forward tile), BLOCK_M1/N1/M2/N2 (jattn's one backward
    tile: M1/N1 where the pairs differ), num_warps/num_stages (all fwd_/bwd_ prefixed too)
    become a `jattn.AttentionConfig`, its other fields at their defaults; a BACKEND torch
    rejects raises as in torch; other keys are ignored. NestedTensor inputs raise
    NotImplementedError, as torch's do. Under torch.autocast, q, k and v are cast to the
    autocast dtype first, as torch does.
    Returns out [B, Hq, L, Ev] in query's stride order; with return_lse=True (deprecated, as
    in torch: a FutureWarning once a process) also the float32 natural-log LSE [B, Hq, L],
    with return_aux=AuxRequest(lse=..., max_scores=...) torch's AuxOutput (max_scores: each
    row's largest score, float32 [B, Hq, L]). In eager mode on CUDA, a forward that is one
    kernel compiled by the `triton` package is launched on torch's current stream without
    going through JAX (README).
    sinks (a jattn addition to torch's signature): attention sinks, one logit per query head
    [Hq], as in `jattn.flex_attention`; a tensor that requires grad gets its gradient, and
    the LSE returned includes them.
    dropout_p (a jattn addition, SDPA's name): dropout of the attention weights, as
    `jattn.flex_attention`'s dropout_rate, its mask drawn from torch's random generator (so
    torch.manual_seed repeats it) and regenerated in the backward. Run eagerly (under
    torch.compile: a graph break); return_aux's max_scores are the scores before dropout.

    Example::

        q, k, v = torch.randn(3, 1, 2, 128, 32).unbind(0)  # each [B, H, L, E] float32
        causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        mask = jt.create_block_mask(causal, None, None, 128, 128, device="cpu")
        bias = lambda score, b, h, q_idx, kv_idx: score - 0.01 * (q_idx - kv_idx)
        out, aux = jt.flex_attention(q, k, v, bias, block_mask=mask,
                                     return_aux=jt.AuxRequest(lse=True))
        print(out.shape, aux.lse.shape)  # torch.Size([1, 2, 128, 32]) torch.Size([1, 2, 128])
    """
    query, key, value = _autocast(query, key, value)
    with _dlpack.x64_scope(query):
        return _flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa,
                               return_lse, kernel_options, return_aux, implementation, sinks,
                               dropout_p)


def _flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                    kernel_options, return_aux, implementation, sinks=None, dropout_p=0.0):
    _check_dense(query, key, value)
    want_lse, want_max = _aux_request(return_lse, return_aux)
    _check_sinks(sinks, query)
    dropout_p = _checked_dropout(dropout_p)
    original, dtype = query, _compute_dtype(query)
    config = _config(kernel_options, dtype)
    query, key, value = (x.to(dtype) if isinstance(x, torch.Tensor) and x.dtype != dtype
                         else x for x in (query, key, value))
    L, S = query.shape[-2], key.shape[-2]
    mask_mod = _block_mask_mod(block_mask)
    largest = None
    compiling = torch.compiler.is_compiling()
    if dropout_p or compiling or want_max:
        # the registered ops (the largest scores: eager too), or dropout's eager path
        mask_tensors, block_size = [], [128, 128]
        if block_mask is not None:
            mask_tensors, block_size = _mask_tensors(block_mask, L, S,
                                                     batch_heads=query.shape[:2])
        traced = compiling and not dropout_p
        mods, captures = (_ops.traced_mods if traced else _ops.capture_mods)(
            score_mod, mask_mod, dtype == torch.float64)
        static = (mods, block_size, [L, S], scale, enable_gqa, implementation, config)
        if dropout_p:  # (hashable static: the dropout programs are cached by it)
            out, lse, *maybe_largest = _ops.flex_attention_dropout(
                query, key, value, mask_tensors, captures,
                (mods, tuple(block_size), (L, S), scale, enable_gqa, implementation, config),
                dropout_p, want_max)
            largest = maybe_largest[0] if want_max else None
        elif want_max:
            out, lse, largest = _ops.flex_attention_max_scores(
                query, key, value, mask_tensors, list(captures), *static)
        else:
            out, lse = _ops.traced_flex(query, key, value, mask_tensors, captures, *static,
                                        return_lse=True)
    else:
        out, lse = _eager_flex(query, key, value, score_mod, block_mask, mask_mod, L, S,
                               scale, enable_gqa, implementation, config,
                               want_lse or sinks is not None)
    if sinks is not None:
        out, lse = _with_sinks(out, lse, sinks)
    out = _follow_layout(out, original)
    if out.dtype != original.dtype:
        out = out.to(original.dtype)
    if return_aux is not None:
        return out, _flex.AuxOutput(lse=lse if want_lse else None, max_scores=largest)
    return (out, lse) if want_lse else out


def _checked_dropout(dropout_p) -> float:
    """dropout_p as a float in [0, 1)."""
    if isinstance(dropout_p, (bool, str)) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"flex_attention: `dropout_p` must be a float in [0, 1), got "
                        f"{type(dropout_p).__name__} {dropout_p!r}.")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"flex_attention: `dropout_p` must be in [0, 1), got {dropout_p!r}.")
    return float(dropout_p)


def _check_sinks(sinks, query) -> None:
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"flex_attention: `sinks` must be a tensor, got {type(sinks).__name__}.")
    heads = query.shape[1] if query.dim() == 4 else None
    if heads is not None and tuple(sinks.shape) != (heads,):
        raise ValueError(f"flex_attention: `sinks` must hold one logit per query head, shape "
                         f"({heads},); got {tuple(sinks.shape)}.")
    if not sinks.is_floating_point():
        raise TypeError(f"flex_attention: `sinks` must be floating point, got {sinks.dtype}.")
    if sinks.device != query.device:
        raise ValueError(f"flex_attention: `sinks` is on {sinks.device}, query on "
                         f"{query.device}: move it with .to(query.device).")


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """(out, lse) with the sinks in every row's denominator, in torch ops (autograd takes
    them, the op's LSE cotangent included): jattn/_src/attention/sinks.py's formula."""
    new_lse = torch.logaddexp(lse, sinks.to(lse.dtype)[:, None])
    kept = torch.exp(lse - new_lse)
    return (out.to(kept.dtype) * kept[..., None]).to(out.dtype), new_lse


def _eager_flex(query, key, value, score_mod, block_mask, mask_mod, L, S, scale, enable_gqa,
                implementation, config, want_lse):
    """(out, lse or None) outside torch.compile: the few fields a forward reads, and a plan
    worked out once per translation, layout and options."""
    if block_mask is None:
        kv_lists, block_size, seq_lengths = (), (128, 128), (L, S)
    else:
        _check_block_mask(block_mask, L, S, "flex_attention")
        *kv_lists, seq_lengths, block_size = _FORWARD_FIELDS(block_mask)
        kv_lists = _read_as_torch(kv_lists[:2] if kv_lists[2] is None else kv_lists,
                                  *query.shape[:2])
    mods, captures = _ops.capture_mods(score_mod, mask_mod, query.dtype == torch.float64)
    plan = _ops.flex_plan((mods, tuple(block_size), tuple(seq_lengths), len(kv_lists),
                           len(captures), L, S, query.shape[0], query.shape[1], query.dtype,
                           query.shape[-1], value.shape[-1],
                           scale, enable_gqa, implementation, config, query.device.type),
                          query.device,
                          lambda: _ops.flex_facts(query, value, mods, captures))
    result = _ops.run_flex(
        plan, query, key, value, kv_lists, captures,
        lambda: [] if block_mask is None else _mask_tensors(
            block_mask, L, S, batch_heads=query.shape[:2])[0],
        return_lse=want_lse)
    return result if want_lse else (result, None)


# A BlockMask's fields an eager forward reads: its kv-major lists (partial, then full),
# seq_lengths and BLOCK_SIZE.
_FORWARD_FIELDS = operator.attrgetter(
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "seq_lengths",
    "BLOCK_SIZE")


def _default_device() -> torch.device:
    """torch's create_block_mask default: the current accelerator, else the CPU."""
    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None else (
        torch.device("cuda") if torch.cuda.is_available() else None)
    return torch.device(current) if current is not None else torch.device("cpu")


def create_block_mask(mask_mod, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                      device=None, BLOCK_SIZE: int | tuple[int, int] = 128,
                      _compile: bool = False, separate_full_blocks: bool = True,
                      compute_dq_write_order: bool = False, dq_kv_order: bool = True):
    """A torch BlockMask built by `jattn.create_block_mask`, with torch's signature and
    defaults (`torch.nn.attention.flex_attention.create_block_mask`): device defaults to the
    current accelerator (else the CPU), BLOCK_SIZE is an int or (Q, KV) tuple, _compile is
    accepted and has no effect (the builder is JAX-compiled). separate_full_blocks=False lists
    every visited block as partial (no full lists), as torch's; compute_dq_write_order and
    dq_kv_order are accepted and have no effect (jattn's backward is deterministic without
    write-order metadata). The lists are shared with JAX without copies. mask_mod is
    torch-written (translated to JAX; what it reads is read now) or a JAX function; the
    BlockMask keeps it as given. Under torch.compile the builder runs eagerly (a graph break:
    it is a JAX program, not torch ops).

    mask_mod takes int32 index tensors b, h, q_idx, kv_idx that broadcast to [B, H, q, kv] and
    returns bool. The result is a `torch.nn.attention.flex_attention.BlockMask` with int32
    lists, kv_num_blocks [B|1, H|1, nQ] and kv_indices [B|1, H|1, nQ, nKV] and the like.

    Example::

        window = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 64)
        mask = jt.create_block_mask(window, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
        print(mask.shape, mask.kv_indices.shape)  # (1, 1, 256, 256) torch.Size([1, 1, 4, 4])
    """
    return _build_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE,
                             bool(separate_full_blocks))


@torch.compiler.disable  # a JAX program: torch.compile calls it as it is
def _build_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE,
                      separate_full_blocks: bool):
    device = _default_device() if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    platform = "cuda" if device.type == "cuda" else "cpu"
    block_size = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    _check_block_size(block_size, "create_block_mask")
    bind, captures = (lambda arrays: mask_mod), []
    if callable(mask_mod):
        translation, tensors = capture(mask_mod, "mask")
        _dlpack.wait_for_torch(device)
        bind = translation.mod.bind
        captures = [_dlpack.to_jax(_dlpack.narrowed(t.to(device)), "captured tensor")
                    for t in tensors]

    def build(*arrays):
        mask = jattn.create_block_mask(bind(arrays), B, H, Q_LEN, KV_LEN, block_size=block_size)
        if separate_full_blocks:
            return mask
        return jattn.BlockMask.from_dense_blocks(
            mask.partial_blocks() | mask.full_blocks(), None, block_size=mask.block_size,
            seq_lengths=mask.seq_lengths, mask_mod=None)
    # On meta tensors the mask's lists are shapes: the builder runs abstractly (its checks
    # included), as torch's does on meta.
    with jax.default_device(jax.devices(platform)[0 if device.type == "meta" else
                                                  device.index or 0]):
        mask = _dlpack.run(build, device, *captures)
    lists = [None if x is None else _dlpack.to_torch(x, device) for x in (
        mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
        mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)]
    return _flex.BlockMask(mask.seq_lengths, *lists, mask.block_size, mask_mod)


# ------------------------------------------------------------------------------------------------
# Flex decoding and the paged KV cache
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """A paged KV cache of torch tensors, in `jattn.PagedKVCache`'s layout (see its docstring):

    k_pages [Hkv, num_pages, page_size, E], v_pages [Hkv, num_pages, page_size, Ev]: contiguous,
    one dtype; page_table [B, max_pages] int32 maps logical page j of sequence b to a physical
    page, -1 where none is assigned yet. Capacity per sequence: max_pages · page_size. Pass it
    to `flex_decode` as `k` with v=None. `assign` writes into the pools in place (JAX reads the
    same memory, no copy); which pages a sequence gets is the caller's choice.

    Example::

        cache = jt.PagedKVCache.create(4, 16, 2, 32, [[0, 1], [2, -1]], dtype=torch.float32)
        new_k, new_v = torch.randn(2, 2, 2, 10, 32).unbind(0)  # each [B, Hkv, Ln, E]
        cache.assign(new_k, new_v, torch.tensor([0, 0]))  # positions 0..9 of both sequences
        q = torch.randn(2, 4, 1, 32)  # [B, Hq, Lq, E]
        out = jt.flex_decode(q, cache, None, kv_len=torch.tensor([10, 10]))
        print(cache.capacity, out.shape)  # 32 torch.Size([2, 4, 1, 32])
    """

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    page_table: torch.Tensor

    def __post_init__(self):
        k, v, table = self.k_pages, self.v_pages, self.page_table
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"PagedKVCache: k_pages {list(k.shape)} and v_pages "
                             f"{list(v.shape)} must be [Hkv, num_pages, page_size, dim] with "
                             "equal first three axes.")
        if k.dtype != v.dtype or not (k.is_contiguous() and v.is_contiguous()):
            raise TypeError(f"PagedKVCache: k_pages ({k.dtype}) and v_pages ({v.dtype}) must "
                            "share a dtype and be contiguous (assign writes through views).")
        if table.dim() != 2 or table.dtype != torch.int32:
            raise ValueError(f"PagedKVCache: page_table must be an int32 [B, max_pages] tensor, "
                             f"got {table.dtype} {list(table.shape)}.")

    @classmethod
    def create(cls, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
               page_table, *, dtype=torch.bfloat16, value_dim: int | None = None,
               device="cpu") -> PagedKVCache:
        """Zeroed pools on `device` and the given page table [B, max_pages] (int, -1:
        unassigned), as `jattn.PagedKVCache.create`."""
        check_pool_sizes(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim)
        value_dim = head_dim if value_dim is None else value_dim
        pools = [torch.zeros((num_kv_heads, num_pages, page_size, dim), dtype=dtype,
                             device=device) for dim in (head_dim, value_dim)]
        table = torch.as_tensor(page_table, device=device).to(torch.int32)
        _decode_ops.check_page_table("PagedKVCache.create", table, num_pages)
        return cls(*pools, table)

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def capacity(self) -> int:
        """Logical positions per sequence: page-table width x page size."""
        return self.page_table.shape[1] * self.page_size

    def assign(self, k: torch.Tensor, v: torch.Tensor, positions, *,
               batch_idx=None) -> PagedKVCache:
        """Writes new tokens k [Bn, Hkv, Ln, E], v [Bn, Hkv, Ln, Ev] (cast to the pools' dtype)
        into the pools in place, as `jattn.PagedKVCache.assign`; returns this cache.

        positions: int [Bn] (the first new token's position; the rest follow) or [Bn, Ln].
        batch_idx: int [Bn], the page-table rows the tokens belong to (default: all B, in
        order). A position outside the capacity or on an unassigned page raises ValueError,
        checked on the host before anything is written (on CUDA a small read that waits for the
        GPU: an out-of-range index would otherwise be a device-side assert).
        """
        slots = _decode_ops.token_slots(self.k_pages, self.v_pages, self.page_table, k, v,
                                        positions, batch_idx)
        for pages, new in ((self.k_pages, k), (self.v_pages, v)):
            flat = pages.view(pages.shape[0], -1, pages.shape[3])  # [Hkv, pool rows, dim]
            flat[:, slots] = new.transpose(0, 1).reshape(flat.shape[0], -1, flat.shape[2]).to(
                pages.dtype)
        return self


def _decode_mask_tensors(block_mask, S: int) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """A torch BlockMask's lists (zero-copy), block size and (Q_LEN, KV_LEN), for a cache of
    length S."""
    if not isinstance(block_mask, _flex.BlockMask):
        _check_block_mask(block_mask, S, S, "flex_decode")  # raises its TypeError
    Q_LEN, KV_LEN = block_mask.seq_lengths
    if KV_LEN != S or Q_LEN < S:
        raise ValueError(f"flex_decode: block_mask covers (Q_LEN={Q_LEN}, KV_LEN={KV_LEN}); a "
                         f"decode mask is indexed by absolute positions, so build it for ({S}, "
                         f"{S}), the cache length (create_block_mask(mask_mod, B, H, {S}, {S})).")
    tensors, block_size = _mask_tensors(block_mask, Q_LEN, KV_LEN, "flex_decode")
    return tensors, block_size, [Q_LEN, KV_LEN]


def flex_decode(q: torch.Tensor, k, v: torch.Tensor | None, score_mod=None, block_mask=None, *,
                kv_len=None, scale: float | None = None, return_lse: bool = False,
                implementation: str | None = None):
    """`jattn.flex_decode` on torch tensors: a few new queries per sequence over a KV cache.

    q [B, Hq, Lq, E] (Lq 1-16 runs the decode kernel); k, v a contiguous cache [B|1, Hkv, S, E]
    and [B|1, Hkv, S, Ev], or k a `PagedKVCache` (S: its capacity) and v None. bfloat16,
    float16 or float32, one dtype, one device; Hq % Hkv == 0. Query i of sequence b sits at
    position kv_len[b] - Lq + i, the q_idx the mods see. score_mod: torch-written or JAX, as in
    `flex_attention`. block_mask: a torch BlockMask built for (S, S) at logical positions.
    kv_len: an int or an int32/int64 tensor [B] of valid keys per sequence, in [0, S] (default
    S). Out-of-range values raise ValueError where the host has them (an int; kv_len and the
    page table on the CPU); CUDA tensors are not read back, and a sequence with a bad length or
    an unassigned page below it comes out NaN, as jattn.flex_decode under jit.
    Returns out [B, Hq, Lq, Ev] of q's dtype (and the float32 natural-log LSE [B, Hq, Lq] with
    return_lse). Inference only: with grad mode on, an input (or tensor the mods close over)
    that requires grad raises NotImplementedError; train with `flex_attention`.

    Example::

        q = torch.randn(2, 8, 1, 64, dtype=torch.bfloat16)  # [B, Hq, 1, E]: one new token
        k, v = torch.randn(2, 2, 2, 256, 64, dtype=torch.bfloat16).unbind(0)  # [B, Hkv, S, E]
        out = jt.flex_decode(q, k, v, kv_len=torch.tensor([100, 256]))
        print(out.shape, out.dtype)  # torch.Size([2, 8, 1, 64]) torch.bfloat16
    """
    if isinstance(k, PagedKVCache):
        if v is not None:
            raise ValueError("flex_decode: with a PagedKVCache as `k`, pass v=None (the cache "
                             "holds both pools).")
        k, v, page_table, S = k.k_pages, k.v_pages, k.page_table, k.capacity
    elif isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        page_table, S = None, k.shape[-2]
    else:
        raise TypeError(f"flex_decode: `k` and `v` must be torch tensors [B|1, Hkv, S, dim], or "
                        f"`k` a jattn.torch.PagedKVCache and v None; got "
                        f"{type(k).__name__} and {type(v).__name__}.")
    mask_tensors, block_size, seq_lengths = [], [128, 128], [S, S]
    if block_mask is not None:
        mask_tensors, block_size, seq_lengths = _decode_mask_tensors(block_mask, S)
    capture_mods = _ops.traced_mods if torch.compiler.is_compiling() else _ops.capture_mods
    mods, captures = capture_mods(score_mod, _block_mask_mod(block_mask))
    out, lse = _decode_ops.flex_decode(q, k, v, page_table,
                                       _decode_ops.kv_len_tensor(kv_len, q, S), mask_tensors,
                                       list(captures), mods, block_size, seq_lengths, scale,
                                       implementation)
    return (out, lse) if return_lse else out
