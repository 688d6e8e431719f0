"""jattn kernels registered as torch custom ops: `torch.library.custom_op` with a fake (meta)
implementation for torch.compile and an autograd formula whose backward is another custom op
running `jax.vjp` of the same jattn function, so torch gradients equal JAX's bit for bit.

Each op converts its tensors through `_dlpack` (zero-copy), calls a jitted JAX function (compiled
once per shapes, dtypes and options by jit's cache) and hands the result back as a tensor.
Under torch.compile the public functions call the registered ops (`traced_flex`; `_gemm_ops.
run_op` for the GEMMs); in eager mode an autograd.Function runs the same implementation and
gradient formula (the dispatcher's per-call cost avoided), or that implementation alone when
nothing needs a gradient (`run_flex`, with a `FlexPlan` found once per mask layout and options);
an eager flex forward that is one kernel on CUDA is launched without JAX (`_direct`).
Torch-written mods reach the ops as a key naming their translations and the tensors they read
on this call (`capture_mods`, `traced_mods`; `_capture.py`, and `_mod_parts.py` for mods made
inside a compiled region).
This module holds the helpers every op uses and flex_attention; the GEMMs are in `_gemm_ops`,
flex_decode in `_decode_ops`.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

import jattn
from ._direct import DirectProgram
from ._capture import capture, lookup
from . import _mod_parts
from ._dlpack import DTYPES, jax_views, narrowed, run, to_torch, wait_for_torch, x64_scope
from ._translate import TranslatedMod
from jattn._src import bridge

# ------------------------------------------------------------------------------------------------
# Implementation choice from the tensors' device
# ------------------------------------------------------------------------------------------------


def implementation_for(fn: str, device: torch.device, implementation: Optional[str],
                       **facts) -> str:
    """The jattn implementation of op `fn` for tensors on `device`: jattn's own choice for that
    platform ($JATTN_IMPLEMENTATION included); a named one must run there. facts: what the
    op's implementations judge support by (as jattn's own call of the op passes them)."""
    if device.type == "meta":  # shapes only: any implementation infers them
        implementation = None
    return bridge.resolve(fn, implementation, on_cuda=device.type == "cuda", **facts)


def ready_views(fn: str, tensors: Sequence[Tensor | jax.Array | None],
                names: Sequence[str]) -> tuple[torch.device, list[jax.Array | None]]:
    """The op's tensors as JAX views (JAX arrays kept from a forward and None pass through) and
    their one device; on CUDA, JAX's next kernels there are ordered after the work queued so
    far on torch's current stream. names: the tensors' argument names, for errors."""
    device, arrays = jax_views(fn, tensors, names)
    wait_for_torch(device)
    return device, arrays


def float32_precision(dtype: torch.dtype) -> str | None:
    """torch's float32 products, as jattn's `precision`: full float32 unless torch allows TF32
    (torch.backends.cuda.matmul.allow_tf32, which torch.set_float32_matmul_precision sets), as
    its own kernels do; None (no effect) for other dtypes."""
    if dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32:
        return None
    return "highest"


def needs_autograd(tensors) -> bool:
    """Whether autograd must record a call on these op arguments: grad mode is on and a tensor
    among them requires grad. (Otherwise the eager ops skip the autograd.Function, ~35 us of
    host time per call on the CPU machine.)"""
    return torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in tensors)


# ------------------------------------------------------------------------------------------------
# flex attention
# ------------------------------------------------------------------------------------------------

# Mods cannot be op arguments, so ops receive a key naming their translations (a constant string
# in a torch.compile graph): "score key,mask key", either empty when there is no such mod.


def capture_mods(score_mod, mask_mod, float64: bool = False) -> tuple[str, tuple[Tensor, ...]]:
    """The op key of (score_mod, mask_mod) and the tensors they read now: score_mod's, then
    mask_mod's (see `_capture.py`; float64: the call's, whose score_mod sees a float64
    score)."""
    score, score_tensors = (None, ()) if score_mod is None else capture(score_mod, "score",
                                                                        float64)
    mask, mask_tensors = (None, ()) if mask_mod is None else capture(mask_mod, "mask")
    key = f"{'' if score is None else score.key},{'' if mask is None else mask.key}"
    # int64 ids narrowed once here, so that the forward and the backward share them and an
    # eager forward can still be one directly launched kernel
    return key, tuple(narrowed(t) for t in (*score_tensors, *mask_tensors))


# runs (and translates) at trace time: a constant key
@bridge.compat.torch_assume_constant_result
def _key_while_tracing(float64: bool, n_score: int, *parts) -> str:
    score = _mod_parts.rebuild(parts[:n_score]) if n_score else None
    mask = _mod_parts.rebuild(parts[n_score:]) if len(parts) > n_score else None
    return capture_mods(score, mask, float64)[0]


def traced_mods(score_mod, mask_mod, float64: bool = False) -> tuple[str, list[Tensor]]:
    """`capture_mods` inside torch.compile: the key is fixed at trace time; every value the
    translation depends on is read where the mods read it, so that Dynamo guards on it (a
    changed scalar re-traces), and the tensors they read become graph inputs (new values
    reach the op without recompiling)."""
    score_parts = () if score_mod is None else _mod_parts.parts(score_mod)
    mask_parts = () if mask_mod is None else _mod_parts.parts(mask_mod)
    key = _key_while_tracing(float64, len(score_parts), *score_parts, *mask_parts)
    tensors, state = [], []
    for mod, name in zip((score_mod, mask_mod), key.split(",")):
        if name:
            translation = lookup(name)
            if translation.is_torch:
                state.extend(translation.read_state(mod))
                tensors.extend(translation.fetch(mod))
    _guard_on(*(_mod_parts.specialised(value) for value in state
                if not _mod_parts.made_in_trace(value)))
    return key, tensors


# its arguments are realised, hence guarded, at trace time
@bridge.compat.torch_assume_constant_result
def _guard_on(*values) -> int:
    return 0


def translated_mods(key: str) -> tuple[TranslatedMod | None, TranslatedMod | None]:
    """The (score, mask) translations an op key names."""
    score, mask = key.split(",")
    return (lookup(score).mod if score else None, lookup(mask).mod if mask else None)


# Order of a BlockMask's lists among an op's mask tensors: partial lists, then full ones if any.
MASK_FIELDS = bridge.MaskLists._fields  # jattn's one flattening of a BlockMask


# Positions of the kv-major lists in MASK_FIELDS (partial, then full): all a forward reads.
_KV_MAJOR = (0, 1, 4, 5)


def kv_major(mask_fields: Sequence) -> list:
    """The kv-major entries of an op's mask tensors (or of MASK_FIELDS)."""
    return [mask_fields[i] for i in _KV_MAJOR if i < len(mask_fields)]


def jattn_block_mask(arrays, block_size, seq_lengths, mask_mod, *, kv_only: bool = False):
    """The jattn.BlockMask of an op's mask arrays: all lists in MASK_FIELDS order, or with
    kv_only only the kv-major ones (forwards). The q-major lists, which only the backward
    reads, are then zero placeholders of their shapes (constants under jit): a forward call
    passes half the arrays, and each array argument costs ~2.5 us of dispatch (H100)."""
    if not arrays:
        return None
    if kv_only:
        Bm, Hm, n_q, n_kv = arrays[1].shape
        q_major = [np.zeros((Bm, Hm, n_kv), np.int32), np.zeros((Bm, Hm, n_kv, n_q), np.int32)]
        arrays = [*arrays[:2], *q_major, *arrays[2:], *(q_major if len(arrays) > 2 else ())]
    fields = dict.fromkeys(MASK_FIELDS)
    fields.update(zip(MASK_FIELDS, arrays))
    return jattn.BlockMask(**fields, block_size=block_size, seq_lengths=seq_lengths,
                           mask_mod=mask_mod)


def _flex_call(fn, kv_only, mods, block_size, seq_lengths, scale, enable_gqa, implementation,
               config):
    """fn(q, k, v, *rest, score_mod, block_mask, **options) for `mods`, the mask lists (with
    kv_only the kv-major ones) and the capture arrays, which fn is told (score_mod's first):
    `fn` is the bridge's flex_attention or its backward. config: an AttentionConfig and a
    precision as `encode_config` writes them, or None."""
    score, mask = translated_mods(mods)
    n_score = 0 if score is None else score.n_captures

    def call(q, k, v, *rest, mask_arrays, capture_arrays, differentiated=None, **kwargs):
        if differentiated is not None:  # (the backward's: for every capture) score_mod's
            kwargs["differentiated"] = differentiated[:n_score]
        score_mod = None if score is None else score.bind(capture_arrays[:n_score])
        mask_mod = None if mask is None else mask.bind(capture_arrays[n_score:])
        block_mask = jattn_block_mask(mask_arrays, block_size, seq_lengths, mask_mod,
                                      kv_only=kv_only)
        attention_config, precision = decode_config(config)
        return fn(q, k, v, *rest, score_mod, block_mask,
                  score_captures=tuple(capture_arrays[:n_score]),
                  mask_captures=tuple(capture_arrays[n_score:]), scale=scale,
                  enable_gqa=enable_gqa, implementation=implementation,
                  config=attention_config, precision=precision, **kwargs)
    return call


def encode_config(config: jattn.AttentionConfig | None, precision: str | None) -> str | None:
    """An AttentionConfig and a float32 precision as an op argument (a string: ops take no
    dataclasses); None when both are None."""
    items = {} if config is None else dataclasses.asdict(config)
    if precision is not None:
        items["precision"] = precision
    return ",".join(f"{k}={v}" for k, v in items.items()) or None


def decode_config(text: str | None) -> tuple[jattn.AttentionConfig | None, str | None]:
    """(config, precision) of `encode_config`'s string."""
    if text is None:
        return None, None
    fields = dict(item.split("=") for item in text.split(","))
    precision = fields.pop("precision", None)
    config = jattn.AttentionConfig(**{k: v if k.endswith("compiler") else int(v)
                                      for k, v in fields.items()}) if fields else None
    return config, precision


@functools.lru_cache(maxsize=256)  # bounded: mods re-translated after a changed scalar add keys
def _flex_program(return_lse: bool, max_scores: bool = False, **static) -> Callable:
    """The jitted forward for one set of static options (bound, not passed per call: cheaper
    to dispatch): (q, k, v, mask_arrays, captures) -> out, or (out, lse) with return_lse, then
    the rows' largest scores with max_scores; mask_arrays: the kv-major lists."""
    def forward(q, k, v, mask_arrays, captures):
        return _flex_call(bridge.flex_attention, True, **static)(
            q, k, v, mask_arrays=mask_arrays, capture_arrays=captures, return_lse=return_lse,
            return_max_scores=max_scores)
    return jax.jit(forward)


def _flex_backward(d_out, d_lse, q, k, v, out, lse, mask_arrays, captures, differentiated,
                   dropout=None, **static):
    """(dq, dk, dv, gradients of the floating-point captures), reusing the forward's out/lse;
    a cotangent that is None (an output autograd saw no gradient for) counts as zeros.
    differentiated: for each capture, whether its gradient is wanted (None: all); the others'
    are zeros, and cost nothing. dropout: the forward's (a bridge.Dropout), or None."""
    if d_out is None:
        d_out = jnp.zeros_like(out)
    dq, dk, dv, d_score_captures = _flex_call(bridge.flex_attention_backward, False, **static)(
        q, k, v, out, lse, d_out, d_lse, mask_arrays=mask_arrays, capture_arrays=captures,
        differentiated=differentiated, **({} if dropout is None else {"dropout": dropout}))
    # score_mod's captures first, in order; the mask_mod's have no gradient
    d_captures = [*d_score_captures, *[None] * (len(captures) - len(d_score_captures))]
    learnable = [jnp.issubdtype(c.dtype, jnp.floating) for c in captures]
    return dq, dk, dv, *(jnp.zeros_like(c) if d is None else d
                         for c, d, wanted in zip(captures, d_captures, learnable) if wanted)


@functools.lru_cache(maxsize=1024)
def tensor_names(leading: tuple[str, ...], n_masks: int, n_captures: int, *,
                 kv_only: bool = False) -> tuple[str, ...]:
    """Argument names of an op's tensors, for errors: `leading`, then its mask lists (in
    MASK_FIELDS order; with kv_only the kv-major ones), then the tensors its mods close
    over."""
    fields = kv_major(MASK_FIELDS) if kv_only else MASK_FIELDS
    return (*leading, *fields[:n_masks], *(f"captured tensor {i}" for i in range(n_captures)))


def ready_op_views(fn: str, names: tuple[str, ...], leading: Sequence, lists: Sequence,
                   captures: Sequence, *, kv_only: bool = False):
    """`ready_views` of an op's tensors in its three groups: (device, the `leading` tensors'
    views (names: theirs), the mask lists' (all in MASK_FIELDS order; with kv_only only the
    kv-major ones are taken), the captured tensors')."""
    if kv_only:
        lists = kv_major(lists)
    device, arrays = ready_views(fn, (*leading, *lists, *captures),
                                 tensor_names(names, len(lists), len(captures), kv_only=kv_only))
    first, n = len(leading), len(lists)
    return device, arrays[:first], arrays[first:first + n], arrays[first + n:]


def flex_facts(q, v, mods: str, captures: Sequence) -> dict:
    """What flex_attention's implementations judge support by, besides the lengths and block
    size: dtype, head dims and how the mods (`mods`: their op key) read the arrays they
    capture (q, v, captures: tensors or JAX arrays)."""
    specs = tuple((tuple(c.shape), DTYPES.get(c.dtype, c.dtype)) for c in captures)
    seq_lengths = (q.shape[-2], v.shape[-2])
    return dict(dtype=DTYPES.get(q.dtype, q.dtype), head_dim=q.shape[-1],
                value_dim=v.shape[-1],
                unreadable_capture=_unreadable_capture(mods, specs, seq_lengths))


@functools.lru_cache(maxsize=256)
def _unreadable_capture(mods: str, specs: tuple, seq_lengths: tuple[int, int]) -> str | None:
    """The `unreadable_capture` fact of `mods` reading captured arrays of `specs` ((shape,
    JAX dtype) each) on sequences of `seq_lengths`."""
    score, mask = translated_mods(mods)
    if score is None and mask is None:
        return None
    return bridge.unreadable_capture(None if score is None else score.bind,
                                     None if mask is None else mask.bind,
                                     0 if score is None else score.n_captures, specs,
                                     seq_lengths)


def _flex_static(device, facts, mods, block_size, seq_lengths, scale, enable_gqa,
                 implementation, config) -> dict:
    """The static jit arguments of a flex op call on tensors on `device` (facts: `flex_facts`
    of the call, for the implementation choice)."""
    chosen = implementation_for("flex_attention", device, implementation,
                                seq_lengths=tuple(seq_lengths), block_size=tuple(block_size),
                                score_mod=not mods.startswith(","), **facts)
    return dict(mods=mods, block_size=tuple(block_size), seq_lengths=tuple(seq_lengths),
                scale=scale, enable_gqa=enable_gqa, implementation=chosen, config=config)


_FORWARD_TENSORS = ("q", "k", "v")
_BACKWARD_TENSORS = ("d_out", "d_lse", "q", "k", "v", "out", "lse")


def _flex_forward_arrays(q, k, v, mask_tensors, captures, *static, max_scores: bool = False):
    """jattn::flex_attention's (out, lse), with max_scores also the rows' largest scores, as
    JAX arrays, and the tensors' device."""
    device, qkv, lists, capture_arrays = ready_op_views(
        "flex_attention", _FORWARD_TENSORS, (q, k, v), mask_tensors, captures,
        kv_only=True)
    facts = flex_facts(qkv[0], qkv[2], static[0], capture_arrays)
    options = _flex_static(device, {**facts, "max_scores": max_scores}, *static)
    results = run(_flex_program(True, max_scores, **options), device, *qkv, lists,
                  capture_arrays)
    return *results, device


def _flex_forward(q: Tensor, k: Tensor, v: Tensor, mask_tensors: list[Tensor],
                  captures: list[Tensor], mods: str, block_size: list[int],
                  seq_lengths: list[int], scale: Optional[float], enable_gqa: bool,
                  implementation: Optional[str],
                  config: Optional[str]) -> tuple[Tensor, Tensor]:
    with x64_scope(q):
        return _flex_forward_tensors(q, k, v, mask_tensors, captures, mods, block_size,
                                     seq_lengths, scale, enable_gqa, implementation, config)


def _flex_forward_tensors(q, k, v, mask_tensors, captures, mods, block_size, seq_lengths, scale,
                          enable_gqa, implementation, config) -> tuple[Tensor, Tensor]:
    out, lse, device = _flex_forward_arrays(q, k, v, mask_tensors, captures, mods, block_size,
                                            seq_lengths, scale, enable_gqa, implementation,
                                            config)
    return to_torch(out, device), to_torch(lse, device)


def _flex_backward_op(d_out: Optional[Tensor], d_lse: Optional[Tensor], q: Tensor, k: Tensor,
                      v: Tensor, out: Tensor, lse: Tensor, mask_tensors: list[Tensor],
                      captures: list[Tensor], mods: str,
                      block_size: list[int], seq_lengths: list[int],
                      scale: Optional[float], enable_gqa: bool,
                      implementation: Optional[str],
                      config: Optional[str],
                      differentiated: Optional[list[bool]] = None) -> list[Tensor]:
    """[dq, dk, dv, then a gradient for each floating-point captured tensor: zeros for those
    `differentiated` (one bool per capture; default all) leaves out]."""
    with x64_scope(q):
        return _flex_gradients(d_out, d_lse, q, k, v, out, lse, mask_tensors, captures, mods,
                               block_size, seq_lengths, scale, enable_gqa, implementation,
                               config, differentiated)


def _flex_gradients(d_out, d_lse, q, k, v, out, lse, mask_tensors, captures, mods, block_size,
                    seq_lengths, scale, enable_gqa, implementation, config,
                    differentiated) -> list[Tensor]:
    device, leading, lists, capture_arrays = ready_op_views(
        "flex_attention", _BACKWARD_TENSORS, (d_out, d_lse, q, k, v, out, lse), mask_tensors,
        captures)
    static = _flex_static(device, flex_facts(leading[2], leading[4], mods, capture_arrays),
                          mods, block_size, seq_lengths, scale, enable_gqa, implementation,
                          config)
    program = _backward_program(None if differentiated is None else tuple(differentiated),
                                **static)
    grads = run(program, device, *leading, lists, capture_arrays)
    return [to_torch(g, device) for g in grads]


@functools.lru_cache(maxsize=256)
def _backward_program(differentiated: tuple[bool, ...] | None, **static) -> Callable:
    """The jitted _flex_backward with its static options bound (dispatching them as static
    arguments costs more per call)."""
    return jax.jit(functools.partial(_flex_backward, differentiated=differentiated, **static))


def _flex_forward_max(q: Tensor, k: Tensor, v: Tensor, mask_tensors: list[Tensor],
                      captures: list[Tensor], mods: str, block_size: list[int],
                      seq_lengths: list[int], scale: Optional[float], enable_gqa: bool,
                      implementation: Optional[str],
                      config: Optional[str]) -> tuple[Tensor, Tensor, Tensor]:
    """jattn::flex_attention's (out, lse) and each row's largest score (torch's
    AuxRequest(max_scores=True))."""
    with x64_scope(q):
        *results, device = _flex_forward_arrays(q, k, v, mask_tensors, captures, mods,
                                                block_size, seq_lengths, scale, enable_gqa,
                                                implementation, config, max_scores=True)
        return tuple(to_torch(x, device) for x in results)


flex_attention = torch.library.custom_op("jattn::flex_attention", mutates_args=())(
    _flex_forward)
flex_attention_max_scores = torch.library.custom_op(
    "jattn::flex_attention_max_scores", mutates_args=())(_flex_forward_max)
flex_attention_backward = torch.library.custom_op("jattn::flex_attention_backward",
                                                  mutates_args=())(_flex_backward_op)


def _row_dtype(q: Tensor) -> torch.dtype:
    """The LSE's (and the largest scores') dtype: float32, float64 for float64 inputs."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@flex_attention.register_fake
def _flex_fake(q, k, v, mask_tensors, captures, *static):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, q.new_empty(q.shape[:-1], dtype=_row_dtype(q))


@flex_attention_max_scores.register_fake
def _flex_max_fake(q, k, v, mask_tensors, captures, *static):
    return (*_flex_fake(q, k, v, mask_tensors, captures, *static),
            q.new_empty(q.shape[:-1], dtype=_row_dtype(q)))


@flex_attention_backward.register_fake
def _flex_backward_fake(d_out, d_lse, q, k, v, out, lse, mask_tensors, captures, *static):
    # (contiguous, as the real op returns them: gradients come back from JAX row-major)
    return [x.new_empty(x.shape) for x in (q, k, v, *captures) if x.is_floating_point()]


def _flex_setup_context(ctx, inputs, output):
    q, k, v, mask_tensors, captures, *static = inputs
    ctx.save_for_backward(q, k, v, *output, *mask_tensors, *captures)
    ctx.counts = len(mask_tensors), len(captures)
    ctx.static = static
    ctx.differentiated = [c.requires_grad for c in captures]


def _flex_autograd(ctx, d_out, d_lse):
    """The op's gradients, through jattn::flex_attention_backward (what torch.compile and
    opcheck must see)."""
    q, k, v, out, lse, *rest = ctx.saved_tensors
    n_masks, n_captures = ctx.counts
    mask_tensors, captures = rest[:n_masks], rest[n_masks:n_masks + n_captures]
    dq, dk, dv, *d_floats = flex_attention_backward(d_out, d_lse, q, k, v, out, lse,
                                                    mask_tensors, captures, *ctx.static,
                                                    ctx.differentiated)
    d_floats = iter(d_floats)
    d_captures = [next(d_floats) if c.is_floating_point() else None for c in captures]
    return (dq, dk, dv, [None] * n_masks, d_captures, *[None] * len(ctx.static))


flex_attention.register_autograd(_flex_autograd, setup_context=_flex_setup_context)


def _flex_max_setup_context(ctx, inputs, output):
    _flex_setup_context(ctx, inputs, output[:2])
    ctx.mark_non_differentiable(output[2])  # the largest scores


flex_attention_max_scores.register_autograd(
    lambda ctx, d_out, d_lse, d_max: _flex_autograd(ctx, d_out, d_lse),
    setup_context=_flex_max_setup_context)


class _EagerFlex(torch.autograd.Function):
    """jattn::flex_attention outside torch.compile; captured tensors come flat so autograd sees
    them, the mask lists (integers, never differentiated) in a list it does not look into:
    each tensor argument adds to the Function's per-call cost. A forward run by JAX keeps out
    and LSE as JAX arrays for the backward (no crossing back); the LSE handed to the caller is
    a copy, theirs to edit in place. A forward launched directly makes both tensors; a
    backward launched directly (`FlexBackward.direct`) reads tensors either way."""

    @staticmethod
    def forward(ctx, plan, masks, return_lse, q, k, v, *captures):
        kv_lists = kv_major(masks)
        # strided q, k, v (as after a transpose) copied once, for the forward and the backward
        dense = [x.contiguous() for x in (q, k, v)]
        direct = None if plan.direct is None else plan.direct[True](
            (*dense, *kv_lists, *captures))
        if direct is not None:
            out_tensor, lse_tensor = direct
            ctx.arrays = ctx.tensors = *dense, out_tensor, lse_tensor
        else:
            (out, lse), device, qkv = _run_plan(plan, *dense, kv_lists, captures,
                                                return_lse=True)
            out_tensor = to_torch(out, device)
            lse_tensor = (to_torch(lse, device)
                          if return_lse or plan.backward_direct else None)
            # the JAX backward reads them without crossing again; a backward launched
            # directly reads the tensors
            ctx.arrays, ctx.tensors = (*qkv, out, lse), (*dense, out_tensor, lse_tensor)
        lse_tensor = lse_tensor.clone() if return_lse else None
        ctx.save_for_backward(q, k, v, out_tensor, *captures)  # version checks
        ctx.masks, ctx.plan = masks, plan
        return (out_tensor, lse_tensor) if return_lse else out_tensor

    @staticmethod
    @once_differentiable  # (no double backward: differentiating the gradients raises)
    def backward(ctx, d_out, d_lse=None):
        _, _, _, _, *captures = ctx.saved_tensors  # (checks that none changed in place)
        plan = ctx.plan
        backward = plan.backward(tuple(ctx.needs_input_grad[6:]))
        grads = None
        if backward.direct is not None:
            grads = backward.direct[d_lse is not None](
                (d_out, *(() if d_lse is None else (d_lse,)), *ctx.tensors, *ctx.masks,
                 *captures))
        if grads is None:
            with x64_scope(d_out):  # the plan's backward: resolved once, with the forward
                device, leading, lists, capture_arrays = ready_op_views(
                    "flex_attention", _BACKWARD_TENSORS, (d_out, d_lse, *ctx.arrays),
                    ctx.masks, captures)
                grads = [to_torch(g, device) for g in run(
                    backward.program, device, *leading, lists, capture_arrays)]
        grads = iter(grads)
        dq, dk, dv = next(grads), next(grads), next(grads)
        d_captures = [next(grads) if c.is_floating_point() else None for c in captures]
        return None, None, None, dq, dk, dv, *d_captures


class _DropoutFlex(torch.autograd.Function):
    """flex attention with dropout of the weights, eager: JAX's programs through DLPack, the
    seed an int32[2] tensor drawn from torch's generator (`flex_attention_dropout`). Out, LSE,
    the views of q, k, v, the seed, the mask lists and the captures are kept for the backward
    as JAX arrays. With want_max, also each row's largest score (before dropout, as without
    it; not differentiable)."""

    @staticmethod
    def forward(ctx, static, rate, want_max, masks, q, k, v, seed, *captures):
        device, leading, lists, capture_arrays = ready_op_views(
            "flex_attention", _DROPOUT_TENSORS, (q, k, v, seed), masks, captures)
        facts = {**flex_facts(leading[0], leading[2], static[0], capture_arrays),
                 "dropout": True}
        options = _flex_static(device, facts, *static)
        forward, backward = _dropout_programs(rate, want_max, **options)
        out, lse, *largest = run(forward, device, *leading, lists, capture_arrays)
        ctx.arrays, ctx.lists, ctx.captures = (*leading, out, lse), lists, capture_arrays
        ctx.backward = backward
        ctx.save_for_backward(*captures)  # (checks that none changed in place)
        results = (to_torch(out, device), to_torch(lse, device).clone(),
                   *(to_torch(x, device).clone() for x in largest))
        ctx.mark_non_differentiable(*results[2:])
        return results

    @staticmethod
    @once_differentiable  # (no double backward: differentiating the gradients raises)
    def backward(ctx, d_out, d_lse, *d_largest):
        captures = ctx.saved_tensors
        with x64_scope(d_out):
            device, cotangents = ready_views("flex_attention", (d_out, d_lse),
                                             ("d_out", "d_lse"))
            grads = iter([to_torch(g, device) for g in run(
                ctx.backward, device, *cotangents, *ctx.arrays, ctx.lists, ctx.captures)])
        dq, dk, dv = next(grads), next(grads), next(grads)
        d_captures = [next(grads) if c.is_floating_point() else None for c in captures]
        return None, None, None, None, dq, dk, dv, None, *d_captures


_DROPOUT_TENSORS = ("q", "k", "v", "dropout seed")


@functools.lru_cache(maxsize=64)
def _dropout_programs(rate: float, want_max: bool, **static) -> tuple[Callable, Callable]:
    """The jitted forward (q, k, v, seed, mask arrays, captures) -> (out, lse), with want_max
    (out, lse, largest scores), and backward (d_out, d_lse, q, k, v, seed, out, lse, mask
    arrays, captures) -> gradients of flex attention with dropout at `rate`, the seed an
    argument."""
    def forward(q, k, v, seed, mask_arrays, captures):
        return _flex_call(bridge.flex_attention, False, **static)(
            q, k, v, mask_arrays=mask_arrays, capture_arrays=captures, return_lse=True,
            return_max_scores=want_max, dropout=bridge.Dropout(rate, seed))

    def backward(d_out, d_lse, q, k, v, seed, out, lse, mask_arrays, captures):
        return _flex_backward(d_out, d_lse, q, k, v, out, lse, mask_arrays, captures, None,
                              dropout=bridge.Dropout(rate, seed), **static)

    return jax.jit(forward), jax.jit(backward)


@torch.compiler.disable  # under torch.compile: a graph break, the call run eagerly
def flex_attention_dropout(q, k, v, masks, captures, static, rate: float,
                           want_max: bool = False):
    """(out, lse) of flex attention with dropout at `rate` of the weights (eager), with
    want_max (out, lse, each row's largest score): the seed drawn from torch's generator of
    q's device, so torch.manual_seed makes a call repeat. masks: every mask list (MASK_FIELDS
    order); static: the op's trailing arguments."""
    seed = torch.randint(-2 ** 31, 2 ** 31 - 1, (2,), dtype=torch.int32, device=q.device)
    dense = [x.contiguous() for x in (q, k, v)]
    with x64_scope(q):
        return _DropoutFlex.apply(static, rate, want_max, list(masks), *dense, seed, *captures)


def traced_flex(q, k, v, masks, captures, *static, return_lse: bool):
    """jattn::flex_attention under torch.compile: (out, lse), the LSE dropped unless asked
    for."""
    out, lse = torch.ops.jattn.flex_attention(q, k, v, masks, captures, *static)
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------------------------------------
# flex attention in eager mode
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FlexPlan:
    """What an eager flex_attention call needs besides its tensors, worked out once per
    (mods' translations, mask layout, lengths, options, device type) and kept in
    `FLEX_PLANS`: each call then costs a dictionary lookup instead of the options' checks and
    jit's static-argument handling.

    static: the op's trailing arguments (mods key, block size, (L, S), scale, enable_gqa,
    implementation as given, config). names: the argument names of (q, k, v, kv-major mask lists,
    captured tensors), for errors. forward, forward_lse: the jitted programs (q, k, v, mask
    arrays, capture arrays) -> out, or (out, lse). direct: for the Pallas kernels on CUDA,
    the two as `DirectProgram`s on (q, k, v, kv-major lists, captures), launched without JAX
    where they are one kernel; else None. options: `_flex_static`'s, for the backwards.
    backward_direct: whether the backward is pallas_triton's kernels, which may be launched
    without JAX (`FlexBackward.direct`).
    """

    static: tuple
    names: tuple[str, ...]
    forward: Callable
    forward_lse: Callable
    direct: tuple[DirectProgram, DirectProgram] | None
    options: dict
    backward_direct: bool
    _backwards: dict = dataclasses.field(default_factory=dict)

    def backward(self, differentiated: tuple[bool, ...]) -> FlexBackward:
        """The backward that differentiates the captures where `differentiated` says so."""
        found = self._backwards.get(differentiated)
        if found is None:
            found = self._backwards[differentiated] = FlexBackward.make(
                _backward_program(differentiated, **self.options), self.backward_direct,
                len(differentiated))
        return found


@dataclasses.dataclass(frozen=True)
class FlexBackward:
    """program: the jitted `_flex_backward` (d_out, d_lse, q, k, v, out, lse, mask arrays,
    capture arrays) -> gradients. direct: where the backward is pallas_triton's kernels, it as
    `DirectProgram`s on the flat tensors (d_out, q, k, v, out, lse, all mask lists, captures)
    and on the same with d_lse after d_out; else None."""

    program: Callable
    direct: tuple[DirectProgram, DirectProgram] | None

    @classmethod
    def make(cls, program: Callable, direct: bool, n_captures: int) -> FlexBackward:
        if not direct:
            return cls(program, None)

        def pack(tensors, with_d_lse):  # flat, with or without d_lse -> arguments
            d_out, d_lse = tensors[0], tensors[1] if with_d_lse else None
            rest = tensors[1 + with_d_lse:]  # q, k, v, out, lse, mask lists, captures
            split = len(rest) - n_captures
            return (d_out, d_lse, *rest[:5], rest[5:split], rest[split:])
        return cls(program, tuple(DirectProgram(program, functools.partial(pack, with_d_lse=w))
                                  for w in (False, True)))


# (mods key, block size, seq lengths, number of kv-major lists, number of captures, L, S, B,
# Hq, q's dtype, head dims, scale, enable_gqa, implementation, config, device type) -> FlexPlan;
# the latest made are kept (a lookup does not reorder: it is on every call's path).
FLEX_PLANS: OrderedDict[tuple, FlexPlan] = OrderedDict()
_MAX_FLEX_PLANS = 256
_PLANS_LOCK = threading.Lock()


def flex_plan(key: tuple, device: torch.device, facts: Callable[[], dict]) -> FlexPlan:
    """The plan of `key` (FLEX_PLANS' layout), made on first use with the call's `facts()`
    (`flex_facts`). The caller has validated the mask layout."""
    plan = FLEX_PLANS.get(key)
    if plan is not None:
        return plan
    mods, block_size, seq_lengths, n_lists, n_captures, L, S, B, Hq, _, E, _, scale, \
        enable_gqa, implementation, config, _ = key
    static = (mods, list(block_size), list(seq_lengths), scale, enable_gqa, implementation,
              config)
    call_facts = facts()
    if device.type == "cuda" and decode_config(config)[0] is None:
        # (pallas_triton's forward, compiled by `triton` with the default config, is launched
        # without JAX: the implementation choice weighs that)
        call_facts.update(bridge.torch_eager_facts(4 * B * Hq * L * S * E))
    options = _flex_static(device, call_facts, *static)
    forward, forward_lse = _flex_program(False, **options), _flex_program(True, **options)
    direct = None
    if bridge.launches_directly(options["implementation"]):
        def pack(tensors, n=3 + n_lists):  # flat tensors -> the programs' arguments
            return (*tensors[:3], tensors[3:n], tensors[n:])
        direct = DirectProgram(forward, pack), DirectProgram(forward_lse, pack)
    plan = FlexPlan(static, tensor_names(_FORWARD_TENSORS, n_lists, n_captures, kv_only=True),
                    forward, forward_lse, direct, options,
                    bridge.backward_launches_directly(options["implementation"]))
    with _PLANS_LOCK:
        FLEX_PLANS[key] = plan
        while len(FLEX_PLANS) > _MAX_FLEX_PLANS:
            FLEX_PLANS.popitem(last=False)
    return plan


for _name, _clear in (("torch.flex_programs", _flex_program.cache_clear),
                      ("torch.tensor_names", tensor_names.cache_clear),
                      ("torch.unreadable_capture", _unreadable_capture.cache_clear),
                      ("torch.flex_backward_programs", _backward_program.cache_clear),
                      ("torch.flex_dropout_programs", _dropout_programs.cache_clear),
                      ("torch.flex_plans", FLEX_PLANS.clear)):
    bridge.register_cache(_name, _clear)


def run_flex(plan: FlexPlan, q, k, v, kv_lists: Sequence[Tensor], captures: Sequence[Tensor],
             all_lists, *, return_lse: bool):
    """jattn::flex_attention in eager mode: its autograd.Function twin when a gradient is
    needed (all_lists(): every mask list, MASK_FIELDS order), else the plan's program alone
    on q, k, v, the kv-major lists and the captured tensors: its one kernel launched directly
    where it can be."""
    if needs_autograd((q, k, v, *captures)):
        return _EagerFlex.apply(plan, all_lists(), return_lse, q, k, v, *captures)
    if plan.direct is not None:
        result = plan.direct[return_lse]((q, k, v, *kv_lists, *captures))
        if result is not None:
            return tuple(result) if return_lse else result[0]
    result, device, _ = _run_plan(plan, q, k, v, kv_lists, captures, return_lse=return_lse)
    if not return_lse:
        return to_torch(result, device)
    return to_torch(result[0], device), to_torch(result[1], device)


def _run_plan(plan: FlexPlan, q, k, v, kv_lists: Sequence[Tensor], captures: Sequence[Tensor],
              *, return_lse: bool):
    """The plan's program on q, k, v, the kv-major lists and the captured tensors: (its JAX
    result, the tensors' device, the JAX views of q, k and v)."""
    device, arrays = ready_views("flex_attention", (q, k, v, *kv_lists, *captures), plan.names)
    n = 3 + len(kv_lists)
    program = plan.forward_lse if return_lse else plan.forward
    return run(program, device, *arrays[:3], arrays[3:n], arrays[n:]), device, arrays[:3]
