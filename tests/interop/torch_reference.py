"""Torch-side references for the torch bridge's tests (import after `pytest.importorskip`).

`torch_flex` is torch's own flex_attention (CPU eager: forward only, inputs must not require
grad); `dense` is the same attention written with torch ops, mods vmapped over (b, h, q_idx,
kv_idx) as torch does, differentiable and float64-capable: the golden value for outputs and
gradients. `assert_like_torch` applies STYLE.md's rule with torch's float32 result as the
low-precision reference.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.attention.flex_attention as flex

_F32_ULP = 2.0**-23


def torch_flex(q, k, v, score_mod=None, mask_mod=None, *, block_size=32, **kwargs):
    """torch's flex_attention on detached inputs (a torch BlockMask built from mask_mod)."""
    L, S = q.shape[-2], k.shape[-2]
    mask = None if mask_mod is None else flex.create_block_mask(
        mask_mod, None, None, L, S, device=q.device, BLOCK_SIZE=block_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex.flex_attention(*(x.detach() for x in (q, k, v)), score_mod, mask,
                                   enable_gqa=q.shape[1] != k.shape[1], **kwargs)


def dense(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """softmax(score_mod(scale q kᵀ) where mask_mod) v, as torch ops (GQA by repetition)."""
    B, Hq, L, E = q.shape
    S, groups = k.shape[-2], Hq // k.shape[1]
    k, v = (x.repeat_interleave(groups, 1).expand(B, -1, -1, -1) for x in (k, v))
    scores = q @ k.transpose(-1, -2) * (E**-0.5 if scale is None else scale)
    index = [torch.arange(n, device=q.device, dtype=torch.int32) for n in (B, Hq, L, S)]
    if score_mod is not None:
        scores = flex._vmap_for_bhqkv(score_mod, prefix=(0,))(scores, *index)
    if mask_mod is not None:
        allowed = flex._vmap_for_bhqkv(mask_mod, prefix=())(*index)
        scores = scores.masked_fill(~allowed.expand_as(scores), -torch.inf)
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v


def as64(*tensors):
    return [t.detach().double().requires_grad_(t.requires_grad) for t in tensors]


def assert_like_torch(actual, gold, reference, *, what="output"):
    """|actual - gold| <= 2 |reference - gold| + 8 float32 ulps of gold's scale (max norms)."""
    actual, gold, reference = (x.detach().double().cpu() for x in (actual, gold, reference))
    allowed = 2 * (reference - gold).abs().max() + 8 * _F32_ULP * gold.abs().max()
    error = (actual - gold).abs().max()
    assert error <= allowed, f"{what}: error {error:.3g} above {allowed:.3g}"
