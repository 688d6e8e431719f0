"""Attention sinks: a learnable logit per query head in every row's softmax denominator.

With a sink s_h, row i of head h attends as softmax over [scores_i, s_h] with the sink's column
dropped: the keys' weights shrink by exp(lse_i) / (exp(lse_i) + exp(s_h)). From the LSE of the
attention without the sink, that is

    lse'_i = logaddexp(lse_i, s_h),    out'_i = out_i · exp(lse_i − lse'_i)

so sinks compose with any implementation's (out, lse), and their gradient (and the extra LSE
cotangent the kernels already take) follows from these two lines by JAX's own differentiation.
A row that attends to no key gives 0 and LSE s_h.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def checked_sinks(fn: str, sinks, heads: int | None) -> jax.Array | None:
    """`sinks` as a float32 [heads] array (None passes through); a bad one raises naming the
    argument. heads None: not known yet (q itself is malformed, which the call reports)."""
    if sinks is None:
        return None
    if not isinstance(sinks, jax.Array):
        sinks = jnp.asarray(sinks)
    if heads is not None and sinks.shape != (heads,):
        raise ValueError(f"{fn}: `sinks` must hold one logit per query head, shape ({heads},); "
                         f"got {sinks.shape}.")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"{fn}: `sinks` must be floating point (float32 logits), got "
                        f"{sinks.dtype}.")
    return sinks.astype(jnp.promote_types(sinks.dtype, jnp.float32))


def with_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(out, lse) of attention [B, H, L, Ev] / [B, H, L] with the per-head `sinks` [H] added to
    every row's denominator."""
    sink = sinks.astype(lse.dtype)[:, None]
    new_lse = jnp.logaddexp(lse, sink)
    # exp(-inf - sink) = 0 for a row without keys (its out is 0 already)
    kept = jnp.exp(lse - new_lse)
    return (out.astype(kept.dtype) * kept[..., None]).astype(out.dtype), new_lse
