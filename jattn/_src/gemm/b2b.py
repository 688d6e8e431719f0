"""b2b_matmul: fn(a @ b) @ c or a @ fn(b @ c), the intermediate kept on chip, and its custom_vjp.

When the kernel runs: the output side a program holds whole (N for "left", M for "right"),
padded to a power of two, must be <= B2B_MAX_HELD (256). The intermediate width and K can be
anything: they are walked in chunks. Otherwise the op runs as two `jattn.matmul` calls (fn as
the first one's epilogue), with the same rounding of the intermediate and matmul's gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jattn._src import backends
from jattn._src.backends import Implementation
from jattn._src.gemm import pallas_triton_b2b, xla
from jattn._src.gemm.api import check_operands, matmul, product_for_shape
from jattn._src.gemm.config import B2B_MAX_HELD, B2BConfig, heuristic_b2b_config
from jattn._src.precision import applied as precision_applied
from jattn._src.precision import canonical as canonical_precision
from jattn._src.programs import jitted
from jattn._src.user_functions import TracedFunction, trace_with_captures

_OP = "b2b_matmul"
_SIDES = ("left", "right")

backends.register_xla_and_kernels(_OP, xla, pallas_triton_b2b, config_class=B2BConfig,
                                  heuristic=heuristic_b2b_config)


@dataclasses.dataclass(frozen=True)
class _Options:
    """Everything static about one b2b call (the custom_vjp's non-differentiable argument)."""

    implementation: Implementation
    side: str
    config: B2BConfig | None
    fn_tile: TracedFunction | None
    fn_full: TracedFunction | None
    precision: str | None  # float32 products (jattn._src.precision)

    def product(self, a, b, c, captures):
        with precision_applied(self.precision):
            return self.implementation.module.b2b_product(
                a, b, c, captures, side=self.side, config=self.config, fn_tile=self.fn_tile,
                fn_full=self.fn_full, interpret=self.implementation.backend.interpret)

    def plain(self, x, y, out_dtype, **transposes):
        with precision_applied(self.precision):
            return product_for_shape(self.implementation, x, y, out_dtype, **transposes)


class _Residuals(NamedTuple):
    a: jax.Array
    b: jax.Array
    c: jax.Array
    captures: tuple[Any, ...]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _b2b(options: _Options, a, b, c, captures):
    return options.product(a, b, c, captures)


def _b2b_fwd(options: _Options, a, b, c, captures):
    return options.product(a, b, c, captures), _Residuals(a, b, c, captures)


def _b2b_bwd(options: _Options, res: _Residuals, d_out):
    # The intermediate S is recomputed in fp32 (never saved); T = fn(S) rounded as in the
    # forward. With Z = T @ c (left) or a @ T (right), each gradient is one plain product.
    a, b, c, dtype = res.a, res.b, res.c, res.a.dtype
    left = options.side == "left"
    s = options.plain(a, b, jnp.float32) if left else options.plain(b, c, jnp.float32)

    def fn(s, captures):
        return s if options.fn_full is None else options.fn_full(captures, s)[0]

    t_fn, fn_vjp = jax.vjp(fn, s, res.captures)
    t = t_fn.astype(dtype)
    d_out = d_out.astype(dtype)
    if left:
        d_c = options.plain(t, d_out, dtype, transpose_a=True)
        d_t = options.plain(d_out, c, jnp.float32, transpose_b=True)
    else:
        d_a = options.plain(d_out, t, dtype, transpose_b=True)
        d_t = options.plain(a, d_out, jnp.float32, transpose_a=True)
    d_s, d_captures = fn_vjp(d_t.astype(t_fn.dtype))
    d_s = d_s.astype(dtype)
    if left:
        d_a = options.plain(d_s, b, dtype, transpose_b=True)
        d_b = options.plain(a, d_s, dtype, transpose_a=True)
    else:
        d_b = options.plain(d_s, c, dtype, transpose_b=True)
        d_c = options.plain(b, d_s, dtype, transpose_a=True)
    return d_a, d_b, d_c, d_captures


_b2b.defvjp(_b2b_fwd, _b2b_bwd)


def _trace_fn(fn: Callable[[jax.Array], jax.Array], *shapes: tuple[int, int]):
    """Traces fn on fp32 arrays of each shape; checks it is elementwise-shaped and floating."""
    traced, captures = trace_with_captures(
        fn, *[(jax.ShapeDtypeStruct(shape, jnp.float32),) for shape in shapes])
    for on_shape, shape in zip(traced, shapes):
        outs = on_shape.out_avals
        if len(outs) != 1 or outs[0].shape != shape or not jnp.issubdtype(outs[0].dtype,
                                                                          jnp.floating):
            seen = ", ".join(f"{o.dtype}{list(o.shape)}" for o in outs)
            raise ValueError(f"{_OP}: `fn` must be elementwise, returning one floating array "
                             f"shaped like its input {list(shape)}; it returned {seen}.")
    return traced, tuple(captures)


def b2b_matmul(a: jax.Array, b: jax.Array, c: jax.Array,
               fn: Callable[[jax.Array], jax.Array] | None = None, *, side: str = "left",
               config: B2BConfig | None = None, implementation: str | None = None,
               precision: str | None = None) -> jax.Array:
    """Back-to-back GEMM: fn(a @ b) @ c (side="left") or a @ fn(b @ c) (side="right").

    The intermediate (a @ b, or b @ c) is accumulated in float32, passed through fn, rounded to
    the input dtype and multiplied, chunk by chunk on chip: it never makes an HBM round trip.

    Args:
      a: left: [..., M, K]; right: [..., M, P]. bfloat16, float16 or float32; leading dims are
        flattened into M.
      b: left: [K, P]; right: [P, K]; same dtype as `a`.
      c: left: [P, N]; right: [K, N]; same dtype as `a`.
      fn: optional elementwise function of the float32 intermediate (e.g.
        `functools.partial(jax.nn.gelu, approximate=True)`; exact-erf gelu does not lower to
        Triton). It sees tiles, not the whole intermediate, so arrays it closes over must be
        scalars; they become kernel inputs and receive gradients. None: the identity.
      side: "left" or "right".
      config: a B2BConfig (used as given) or None (heuristic). The kernel runs when the output
        side a program holds whole (N for "left", M for "right") is <= 256; otherwise the op
        runs as two `jattn.matmul` calls with their own configs, and a config given is an error.
      implementation, precision: as in `jattn.matmul`.

    Returns:
      [..., M, N] of the input dtype. Differentiable in a, b, c and captured arrays (custom_vjp
      recomputing the intermediate; fn's derivative from `jax.vjp`).

    Example::

        x = jnp.ones((2, 64, 32), jnp.bfloat16)  # [..., M, K]
        w1, w2 = jnp.ones((32, 128), jnp.bfloat16), jnp.ones((128, 16), jnp.bfloat16)
        out = jattn.b2b_matmul(x, w1, w2, jax.nn.relu)  # an MLP: relu(x @ w1) @ w2
        print(out.shape, out.dtype)  # (2, 64, 16) bfloat16
    """
    if side not in _SIDES:
        raise ValueError(f"{_OP}: `side` must be 'left' or 'right', got {side!r}.")
    if fn is not None and not callable(fn):
        raise TypeError(f"{_OP}: `fn` must be callable or None, got {type(fn).__name__}.")
    if not (config is None or isinstance(config, B2BConfig)):
        raise TypeError(f"{_OP}: `config` must be a B2BConfig or None, got {config!r}.")
    a, b, c = (jnp.asarray(x) for x in (a, b, c))
    for name, x in (("b", b), ("c", c)):
        if x.ndim != 2:
            raise ValueError(f"{_OP}: `{name}` must be a 2-D matrix, got shape {x.shape}.")
    # left chains a @ b first, right b @ c: check the pair the intermediate comes from first.
    pairs = [(a, b, ("a", "b")), (b, c, ("b", "c"))]
    for x, y, names in pairs if side == "left" else pairs[::-1]:
        check_operands(_OP, x, y, b_max_ndim=None, names=names)
    implementation = backends.resolve(_OP, implementation, dtype=a.dtype)
    precision = canonical_precision(_OP, precision)
    if 0 in (*a.shape, *b.shape, *c.shape):
        implementation = backends.for_empty(_OP)

    *lead, width = a.shape
    m, n = math.prod(lead), c.shape[1]
    a = a.reshape(m, width)
    left = side == "left"
    k, inner = (width, b.shape[1]) if left else (b.shape[1], width)
    outer, held_size = (m, n) if left else (n, m)
    full = (m, inner) if left else (inner, n)
    if not implementation.module.holds(held_size):
        if config is not None:
            raise ValueError(
                f"{_OP}: config given, but the kernel holds the whole {'N' if left else 'M'}="
                f"{held_size} side of the output and supports at most {B2B_MAX_HELD}; pass "
                "config=None to run as two jattn.matmul calls.")
        if fn is not None:
            _trace_fn(fn, full)  # the same checks and errors as the kernel path
        two = functools.partial(matmul, implementation=implementation.name, precision=precision)
        first = two(a, b, epilogue=fn) if left else two(b, c, epilogue=fn)
        out = two(first, c) if left else two(a, first)
        return out.reshape(*lead, n)

    if not implementation.tunable:
        resolved, tile = None, None
    else:
        resolved = config or heuristic_b2b_config(outer, held_size, inner, k, a.dtype)
        tile = ((resolved.block_out, resolved.block_inner) if left
                else (resolved.block_inner, resolved.block_out))
    fn_tile = fn_full = None
    captures: tuple[Any, ...] = ()
    if fn is not None:
        traced, captures = _trace_fn(fn, full, *([tile] if tile else []))
        fn_full, fn_tile = traced[0], (traced[1] if tile else None)
    options = _Options(implementation, side, resolved, fn_tile, fn_full, precision)
    return jitted(_b2b, options)(a, b, c, captures).reshape(*lead, n)
