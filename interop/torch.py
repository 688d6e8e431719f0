"""jattn for PyTorch: the same kernels as torch ops (`torch.ops.jattn.*`), on torch tensors.

Tensors cross to JAX and back without copies (see `interop._dlpack`); autograd and
`torch.compile(fullgraph=True)` work through the registered custom ops. On CUDA tensors the
Pallas-Triton kernels run, on CPU tensors the XLA implementation, unless `implementation` says
otherwise.
"""

from __future__ import annotations

import jax
import torch

import jattn
from interop import _dlpack, _ops  # _ops registers torch.ops.jattn.*


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
           implementation: str | None = None) -> torch.Tensor:
    """a @ b + bias with float32 accumulation, as `jattn.matmul`.

    a: [..., M, K], b: [K, N], bias: [N] or None; bfloat16, float16 or float32 (a and b alike),
    all on one device. Returns [..., M, N] of a's dtype. Differentiable in a, b and bias.
    """
    return _ops.run_op("matmul", a, b, bias, implementation)


def bmm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
        implementation: str | None = None) -> torch.Tensor:
    """Batched a @ b + bias, as `jattn.bmm`: a [..., M, K], b [..., K, N] with broadcasting
    batch dims, bias [N] or None. Returns [..., M, N] of a's dtype."""
    return _ops.run_op("bmm", a, b, bias, implementation)


def _mask_tensors(block_mask, L: int, S: int) -> tuple[list[torch.Tensor], list[int]]:
    """A torch BlockMask's lists in the ops' order (zero-copy), and its block size."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise TypeError("flex_attention: `block_mask` must be a torch BlockMask (from "
                        "interop.torch.create_block_mask or torch's create_block_mask), got "
                        f"{type(block_mask).__name__}.")
    if tuple(block_mask.seq_lengths) != (L, S):
        raise ValueError(f"flex_attention: block_mask was built for (Q_LEN, KV_LEN) = "
                         f"{tuple(block_mask.seq_lengths)} but q has length {L} and k {S}.")
    fields = [getattr(block_mask, name) for name in _ops.MASK_FIELDS]
    if fields[2] is None:
        raise ValueError("flex_attention: block_mask has no q-major lists (q_num_blocks, "
                         "q_indices); build it with compute_q_blocks=True.")
    return [f for f in fields if f is not None], list(block_mask.BLOCK_SIZE)


def _jax_mask_mod(block_mask):
    from torch.nn.attention.flex_attention import noop_mask

    if block_mask is None or block_mask.mask_mod is noop_mask:
        return None
    return block_mask.mask_mod


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod=None,
                   block_mask=None, *, scale: float | None = None, enable_gqa: bool = False,
                   return_lse: bool = False, implementation: str | None = None):
    """`jattn.flex_attention` on torch tensors, with torch FlexAttention's signature.

    q [B, Hq, L, E], k [B|1, Hkv, S, E], v [B|1, Hkv, S, Ev]: bfloat16, float16 or float32 on
    one device. score_mod (`f(score, b, h, q_idx, kv_idx)`) and the block mask's mask_mod
    (`f(b, h, q_idx, kv_idx)`) are torch-written — translated to JAX once per function, the
    tensors they close over passed to the kernels — or JAX functions such as `jattn.mods`.
    block_mask is a torch BlockMask (from `create_block_mask` below or torch's builder).
    Returns out [B, Hq, L, Ev] (and the float32 natural-log LSE [B, Hq, L] with return_lse);
    differentiable in q, k, v and floating-point tensors the score_mod closes over.
    """
    L, S = q.shape[-2], k.shape[-2]
    mask_tensors, block_size = [], [128, 128]
    if block_mask is not None:
        mask_tensors, block_size = _mask_tensors(block_mask, L, S)
    mods = _ops.register_mods(score_mod, _jax_mask_mod(block_mask))
    out, lse = _ops.run_op("flex_attention", q, k, v, mask_tensors, _ops.mod_captures(mods),
                         mods, block_size, [L, S], scale, enable_gqa, implementation)
    return (out, lse) if return_lse else out


def create_block_mask(mask_mod, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int, *,
                      block_size: int | tuple[int, int] = 128, device="cpu"):
    """A torch BlockMask built by `jattn.create_block_mask` (on the JAX device matching
    `device`), its lists shared with JAX without copies. mask_mod is torch-written (translated
    to JAX) or a JAX function; the BlockMask keeps it as given."""
    from torch.nn.attention.flex_attention import BlockMask

    device = torch.device(device)
    platform = "cuda" if device.type == "cuda" else "cpu"
    translated = _ops.as_jax_mod(mask_mod, "mask") if callable(mask_mod) else None
    captured = [] if translated is None else [t.to(device) for t in translated.captures]
    _dlpack.wait_for_torch(device)
    jax_mask_mod = mask_mod if translated is None else translated.bind(
        [_dlpack.to_jax(t, "captured tensor") for t in captured])
    with jax.default_device(jax.devices(platform)[device.index or 0]):
        mask = jattn.create_block_mask(jax_mask_mod, B, H, Q_LEN, KV_LEN, block_size=block_size)
    lists = [None if x is None else _dlpack.to_torch(x) for x in (
        mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
        mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)]
    return BlockMask(mask.seq_lengths, *lists, mask.block_size, mask_mod)
