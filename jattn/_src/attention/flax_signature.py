"""Flax's `nnx.dot_product_attention` signature on jattn: `nnx.MultiHeadAttention(...,
attention_fn=jattn.flax_dot_product_attention)` runs a Flax model's attention on jattn.

Flax calls an attention_fn with [batch..., length, heads, dim] arrays (any number of batch
axes, or none) and its own keywords (mask, dropout, dtype, precision, module, is_causal).
The batch axes are flattened into one and the call is `jattn.dot_product_attention`'s.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jattn._src.attention.dot_product import dot_product_attention

_FN = "flax_dot_product_attention"


def flax_dot_product_attention(query, key, value, bias=None, mask=None,
                               broadcast_dropout: bool = True, dropout_rng=None,
                               dropout_rate: float = 0.0, deterministic: bool = False,
                               dtype=None, precision=None, module=None, promote_dtype=None,
                               is_causal: bool = False, *, implementation: str | None = None):
    """`flax.nnx.dot_product_attention` computed by `jattn.flex_attention`.

    Args:
      query: [batch..., T, N, H]; key, value: [batch..., S, K, H] (N a multiple of K).
      bias, mask: broadcastable to [batch..., N, T, S]; a logit takes part where the mask is
        True or non-zero (Flax's masks are float 0/1 by default), as in Flax.
      broadcast_dropout, dropout_rng, dropout_rate, deterministic: Flax's dropout of the
        attention weights, applied where Flax applies it (rate > 0 and not deterministic) by
        `jattn.flex_attention`'s dropout: the same rate, one mask for every batch and head
        with broadcast_dropout, drawn from dropout_rng (not the mask Flax would draw from
        it: jattn hashes positions, so the backward regenerates it).
      dtype, promote_dtype: the computation's dtype, as Flax promotes (default: query's, key's
        and value's common dtype).
      precision: float32 products (`jattn.flex_attention`'s precision; a jax.lax.Precision or
        its name).
      module: Flax's module to sow the attention weights into; jattn never forms the weights,
        so a module (MultiHeadAttention(sow_weights=True)) raises.
      is_causal: query t attends keys <= t.
      implementation: a jattn implementation (None: jattn's choice).

    Returns: [batch..., T, N, H] in the computation's dtype.

    Example::

        from flax import nnx

        layer = nnx.MultiHeadAttention(num_heads=4, in_features=64, decode=False,
                                       attention_fn=jattn.flax_dot_product_attention,
                                       rngs=nnx.Rngs(0))
        y = layer(jnp.ones((2, 128, 64)), mask=nnx.make_causal_mask(jnp.ones((2, 128))))
    """
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"{_FN}: `dropout_rate` must be in [0, 1); got {dropout_rate}.")
    dropping = dropout_rate > 0.0 and not deterministic
    if dropping and dropout_rng is None:
        raise ValueError(f"{_FN}: dropout_rate={dropout_rate} with deterministic=False needs a "
                         "`dropout_rng` (MultiHeadAttention passes its rngs' dropout key).")
    if module is not None:
        raise NotImplementedError(
            f"{_FN}: jattn never forms the attention weights, so it cannot sow them "
            "(MultiHeadAttention(sow_weights=True)); use Flax's default attention_fn to "
            "inspect them.")
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
        common = jnp.result_type(query, key, value) if dtype is None else dtype
        query, key, value = (x.astype(common) for x in (query, key, value))
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(f"{_FN}: query, key and value must be [batch..., length, heads, dim] "
                         f"with the same batch axes; got {query.shape}, {key.shape}, "
                         f"{value.shape}.")
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise ValueError(f"{_FN}: query, key and value must share their batch axes; got "
                         f"{query.shape}, {key.shape}, {value.shape}.")
    flat = lambda x: x.reshape(math.prod(batch), *x.shape[-3:])  # noqa: E731
    if mask is not None:  # Flax's masks are often float 0/1 (nnx.make_attention_mask)
        mask = jnp.asarray(mask).astype(jnp.bool_)
    pairwise = (_flattened(name, x, batch, query.shape[-2], query.shape[-3], key.shape[-3])
                for name, x in (("bias", bias), ("mask", mask)))
    out = dot_product_attention(flat(query), flat(key), flat(value), *pairwise,
                                is_causal=is_causal, implementation=implementation,
                                precision=precision,
                                dropout_rate=dropout_rate if dropping else 0.0,
                                dropout_key=dropout_rng if dropping else None,
                                broadcast_dropout=broadcast_dropout)
    return out.reshape(*batch, *out.shape[1:])


def _flattened(name: str, x, batch: tuple[int, ...], N: int, T: int, S: int):
    """A bias or mask broadcastable to [batch..., N, T, S] as a 4-D array whose first axis is
    the flattened batch (or 1 where x does not vary over the batch)."""
    if x is None:
        return None
    x = jnp.asarray(x)
    full = (*batch, N, T, S)
    if x.ndim > len(full):
        raise ValueError(f"{_FN}: `{name}` must be broadcastable to [batch..., N, T, S] = "
                         f"{list(full)}; got shape {x.shape}.")
    x = x.reshape((1,) * (len(full) - x.ndim) + x.shape)
    if any(d not in (1, f) for d, f in zip(x.shape, full)):
        raise ValueError(f"{_FN}: `{name}` must be broadcastable to [batch..., N, T, S] = "
                         f"{list(full)}; got shape {x.shape}.")
    lead = x.shape[:len(batch)]
    if all(d == 1 for d in lead):
        return x.reshape(1, *x.shape[len(batch):])
    x = jnp.broadcast_to(x, (*batch, *x.shape[len(batch):]))  # varies over some batch axes
    return x.reshape(math.prod(batch), *x.shape[len(batch):])
