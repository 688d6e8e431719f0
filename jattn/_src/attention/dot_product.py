"""`jax.nn.dot_product_attention`'s signature on jattn's FlexAttention: switching a JAX model is
an import change.

The [batch, length, heads, dim] arrays are transposed to flex_attention's [batch, heads,
length, dim]; `is_causal`, `local_window_size` and the sequence lengths become one mask_mod (and
a BlockMask, so that blocks nothing attends to are skipped); a boolean `mask` is read by the
mask_mod and a `bias` by a score_mod, both as captured arrays (the bias gets its gradient).
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

from jattn._src.attention.api import flex_attention_with_captures
from jattn._src.attention.dropout import checked_dropout
from jattn._src.masks.create import create_block_mask

_FN = "dot_product_attention"


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale: float | None = None,
                          is_causal: bool = False, query_seq_lengths=None,
                          key_value_seq_lengths=None,
                          local_window_size: int | tuple[int, int] | None = None,
                          implementation: str | None = None, return_residual: bool = False,
                          block_size: int = 128, precision=None, dropout_rate: float = 0.0,
                          dropout_key=None, broadcast_dropout: bool = False):
    """`jax.nn.dot_product_attention` computed by `jattn.flex_attention`.

    Args:
      query: [B, T, N, H] (or [T, N, H]); key, value: [B, S, K, H] (or [S, K, H]), N a
        multiple of K (grouped-query attention).
      bias: added to the scaled logits, broadcastable to [B, N, T, S] with missing leading
        axes counted as 1, as in jax.nn ([T, S] serves every batch and head); differentiable.
      mask: bool, True where a logit takes part; broadcastable likewise.
      scale, is_causal, query_seq_lengths, key_value_seq_lengths ([B] int32),
        local_window_size ((left, right) or one int for both), return_residual: as in
        jax.nn.dot_product_attention. The causal mask is aligned at the first query and key,
        as there (query t attends keys <= t).
      implementation: a jattn implementation ("pallas_triton", "pallas_mosaic_gpu", "xla",
        "interpret"; None: jattn's choice), not jax's names.
      block_size: the BlockMask's block when a mask applies.
      precision: float32 products, as `jattn.flex_attention`'s (None: the caller's setting).
      dropout_rate, dropout_key: dropout of the attention weights, as `jattn.flex_attention`'s
        (an addition to jax.nn's signature); broadcast_dropout: one mask for every batch and
        head (Flax's broadcast_dropout).

    Returns:
      [B, T, N, H] like query (with return_residual also the natural-log LSE [B, T, N]). A
      query that attends to no key (masked everywhere) gives the values' mean as in jax.nn,
      and one past its query_seq_length 0; their LSE is -inf (jax.nn's is a large negative
      number).

    Example::

        q = jax.random.normal(jax.random.key(0), (2, 128, 4, 32))   # [B, T, N, H]
        k = v = jax.random.normal(jax.random.key(1), (2, 128, 2, 32))  # [B, S, K, H]
        out = jattn.dot_product_attention(q, k, v, is_causal=True,
                                          key_value_seq_lengths=jnp.array([128, 100]))
        print(out.shape)  # (2, 128, 4, 32)
    """
    query, key, value = (x if isinstance(x, jax.Array) else jnp.asarray(x)
                         for x in (query, key, value))
    batched = query.ndim == 4
    if query.ndim not in (3, 4) or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(f"{_FN}: query, key and value must all be [B, T|S, heads, dim] (or "
                         f"without B); got {query.shape}, {key.shape}, {value.shape}.")
    if not batched:
        query, key, value = (x[None] for x in (query, key, value))
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"{_FN}: query, key and value must share a dtype (as jax.nn's), got "
                        f"{query.dtype}, {key.dtype} and {value.dtype}.")
    if implementation == "cudnn":
        raise ValueError(f"{_FN}: implementation='cudnn' names jax.nn's cuDNN kernel; jattn's "
                         "are 'pallas_mosaic_gpu', 'pallas_triton', 'xla' and 'interpret' "
                         "(None picks the fastest on the device).")
    B, T, N, _ = query.shape
    S = key.shape[1]
    bias = _checked_pairwise("bias", bias, B, N, T, S)
    mask = _checked_pairwise("mask", mask, B, N, T, S)
    if mask is not None and mask.dtype != jnp.bool_:
        raise TypeError(f"{_FN}: `mask` must be bool (True: take part); got {mask.dtype}. "
                        "An additive mask belongs in `bias`.")
    window = _window(local_window_size)
    q_lengths = _lengths("query_seq_lengths", query_seq_lengths, B)
    kv_lengths = _lengths("key_value_seq_lengths", key_value_seq_lengths, B)

    def mask_mod(b, h, q_idx, kv_idx):
        keep = jnp.ones(jnp.broadcast_shapes(*(jnp.shape(x) for x in (b, h, q_idx, kv_idx))),
                        jnp.bool_)
        if is_causal:
            keep &= q_idx >= kv_idx
        if window is not None:
            keep &= (kv_idx >= q_idx - window[0]) & (kv_idx <= q_idx + window[1])
        if q_lengths is not None:
            keep &= q_idx < q_lengths[b]
        if kv_lengths is not None:
            keep &= kv_idx < kv_lengths[b]
        if mask is not None:
            keep &= _read(mask, b, h, q_idx, kv_idx)
        return keep

    block_mask = None
    if is_causal or window is not None or mask is not None or q_lengths is not None or (
            kv_lengths is not None):
        per_batch = q_lengths is not None or kv_lengths is not None or (
            mask is not None and mask.shape[0] > 1)
        per_head = mask is not None and mask.shape[1] > 1
        block_mask = create_block_mask(mask_mod, B if per_batch else None,
                                       N if per_head else None, T, S, block_size=block_size)
    score_mod = None if bias is None else (
        lambda score, b, h, q_idx, kv_idx: score + _read(bias, b, h, q_idx, kv_idx))
    dropout = checked_dropout(_FN, dropout_rate, dropout_key, shared=broadcast_dropout)
    out, lse = flex_attention_with_captures(
        *(jnp.swapaxes(x, 1, 2) for x in (query, key, value)), score_mod, block_mask,
        scale=scale, enable_gqa=N != key.shape[2], return_lse=True,
        implementation=implementation, precision=precision, dropout=dropout)
    out, lse = jnp.swapaxes(out, 1, 2), jnp.swapaxes(lse, 1, 2)
    if block_mask is not None or bias is not None:
        out = _values_mean_where_empty(out, lse, value, q_lengths)
    if not batched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_residual else out


def _values_mean_where_empty(out, lse, value, q_lengths):
    """out [B, T, N, H] with each query that attends to no key (LSE -inf) within its length
    given the values' mean over every key, as jax.nn's uniform softmax of equally masked
    logits gives (the gradient reaches the values alone, as there); queries past their length
    stay 0, as jax.nn zeroes them."""
    empty = jnp.isneginf(lse)  # [B, T, N]
    if q_lengths is not None:
        empty &= (jnp.arange(lse.shape[1]) < q_lengths[:, None])[..., None]
    groups = out.shape[2] // value.shape[2]
    mean = jnp.repeat(value.mean(axis=1), groups, axis=1)  # [B, N, H]
    return jnp.where(empty[..., None], mean[:, None].astype(out.dtype), out)


def _checked_pairwise(name: str, x, B: int, N: int, T: int, S: int):
    """A bias or mask as a 4-D array broadcastable to [B, N, T, S], leading axes of size 1
    added as jax.nn adds them ([T, S] serves every batch and head); None passes through."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.ndim <= 4:
        x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    if x.ndim != 4 or any(d not in (1, full) for d, full in zip(x.shape, (B, N, T, S))):
        raise ValueError(f"{_FN}: `{name}` must have at most 4 axes and broadcast to "
                         f"[B, N, T, S] = {[B, N, T, S]} (missing leading axes count as 1); "
                         f"got shape {x.shape}.")
    return x


def _read(x, b, h, q_idx, kv_idx):
    """x[b, h, q_idx, kv_idx] with its broadcast (size 1) axes read at 0."""
    return x[tuple(i if size > 1 else 0 for i, size in zip((b, h, q_idx, kv_idx), x.shape))]


def _window(size) -> tuple[int, int] | None:
    """(left, right) as Python ints; NumPy integers and 0-d integer arrays count as ints."""
    if size is None:
        return None
    try:
        pair = (size, size) if np.ndim(size) == 0 else tuple(size)
        left, right = (operator.index(side) for side in pair)
    except (TypeError, ValueError):
        left = right = -1
    if left < 0 or right < 0:
        raise ValueError(f"{_FN}: `local_window_size` must be a non-negative int or a pair "
                         f"(left, right) of them; got {size!r}.")
    return left, right


def _lengths(name: str, lengths, B: int):
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"{_FN}: `{name}` must be an int array of shape ({B},), one length "
                         f"per batch row; got {lengths.dtype} {lengths.shape}.")
    return lengths.astype(jnp.int32)
