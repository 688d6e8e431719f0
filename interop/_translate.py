"""A torch-written mod's graph -> a JAX function.

`_capture.py` has Dynamo trace the mod on 0-d index tensors, as torch FlexAttention
traces it: the mod sees scalars, so chained indexing (`bias[b][h][q_idx]`), 0-d tensor indices
and `new_*` constructors mean what they mean in torch. The graph is lowered to core ATen with
torch's own decompositions (`make_fx`), and each core op is interpreted with its jnp
counterpart. The JAX function then runs on broadcastable index arrays (a kernel tile):

- a value derived from the mod's arguments ("batched") is an array of the tile's broadcast
  shape standing for one scalar per position, so elementwise ops apply as they are;
- a value derived only from captured tensors and constants ("unbatched") is an array with
  torch's shape (a captured table, a sum over it);
- indexing an unbatched tensor with scalars is kept lazy until every dimension is indexed, so
  `bias[b][h][q_idx][kv_idx]` becomes the single point lookup the kernels turn into an indexed
  load (`jattn._src.pallas_triton.captured_loads`), never a slice of the table per position.

A mod that builds batched values that are not scalars per position (say a row of a table per
query, reduced afterwards) runs through `jax.vmap` of the scalar function instead: correct
everywhere, though such a graph may not lower into a Triton kernel.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

aten = torch.ops.aten
DECOMPOSITIONS = core_aten_decompositions()

# torch dtype -> the JAX dtype a mod computes in (int64 narrowed: indices are int32).
_DTYPES = {torch.float32: jnp.float32, torch.float16: jnp.float16,
           torch.bfloat16: jnp.bfloat16, torch.float64: jnp.float64, torch.int8: jnp.int8,
           torch.uint8: jnp.uint8, torch.int16: jnp.int16, torch.int32: jnp.int32,
           torch.int64: jnp.int32, torch.bool: jnp.bool_}


def jax_dtype(dtype: torch.dtype):
    """The JAX dtype of a mod's torch dtype; float64 where JAX runs in x64 mode (a float64
    call), else float32."""
    if dtype not in _DTYPES:
        raise NotImplementedError(f"a mod computes in {dtype}, which jattn does not support")
    if dtype == torch.float64 and not jax.config.jax_enable_x64:
        return jnp.float32
    return _DTYPES[dtype]


# ------------------------------------------------------------------------------------------------
# Core ATen ops -> jnp, at torch's semantics for one position
# ------------------------------------------------------------------------------------------------

def _alpha(fn):
    def apply(a, b, alpha=1):
        return fn(a, b if alpha == 1 else b * alpha)
    return apply


def _div(a, b, rounding_mode=None):
    if rounding_mode == "floor":
        return jnp.floor_divide(a, b)
    if rounding_mode == "trunc":
        if jnp.issubdtype(jnp.result_type(a, b), jnp.integer):
            return _truncating_div(a, b)
        return jnp.trunc(_true_divide(a, b))
    return _true_divide(a, b)


def _true_divide(a, b):
    """a / b correctly rounded, as torch's eager division is. XLA turns a division by a
    scalar into a multiplication by its reciprocal (and GPU division is approximate), one ulp
    off at exact quotients (21 / 7.0 = 3.0000002), which `ceil` turns into an integer off by
    one. One correction step, with the product q·b kept exact by Dekker's split (no fma),
    rounds it right."""
    q = jnp.true_divide(a, b)
    if q.dtype != jnp.float32:
        return q
    a, b = (jnp.asarray(x).astype(jnp.float32) for x in (a, b))
    p = q * b
    (qh, ql), (bh, bl) = _split(q), _split(b)
    error = ((qh * bh - p) + qh * bl + ql * bh) + ql * bl  # q·b = p + error exactly
    corrected = q + ((a - p) - error) / b
    return jnp.where(jnp.isfinite(corrected), corrected, q)


def _split(x):
    """(high, low) halves of float32 x with 12 significant bits in high: their products are
    exact in float32 (Veltkamp)."""
    c = x * np.float32(4097.0)
    high = c - (c - x)
    return high, x - high


def _truncating_div(a, b):
    a, b = jnp.asarray(a), jnp.asarray(b)
    dtype = jnp.result_type(a, b)
    return jax.lax.div(a.astype(dtype), b.astype(dtype))  # rounds toward zero, as C


def _clamp(x, min=None, max=None):  # noqa: A002  (aten's argument names)
    if min is not None:
        x = jnp.maximum(x, min)
    return x if max is None else jnp.minimum(x, max)


def _gelu(x, approximate="none"):
    return jax.nn.gelu(x, approximate=approximate == "tanh")


def _leaky_relu(x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * negative_slope)


def _elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    return jnp.where(x > 0, x * scale, jnp.expm1(x * input_scale) * (alpha * scale))


def _hardtanh(x, min_val=-1.0, max_val=1.0):
    return jnp.clip(x, min_val, max_val)


def _full(size, value, *, dtype=None, **_):
    return jnp.full(tuple(size), value, None if dtype is None else jax_dtype(dtype))


def _full_like(x, value, *, dtype=None, **_):
    return jnp.full(jnp.shape(x), value, jax_dtype(dtype) if dtype else jnp.result_type(x))


def _scalar_tensor(value, *, dtype=None, **_):
    return jnp.asarray(value, jax_dtype(dtype) if dtype else jnp.float32)


def _to_copy(x, *, dtype=None, **_):
    return x if dtype is None else jnp.asarray(x).astype(jax_dtype(dtype))


def _identity(x, *_, **__):
    return x


def _arange(start, end=None, step=1, *, dtype=None, **_):
    if end is None:
        start, end = 0, start
    return jnp.arange(start, end, step, None if dtype is None else jax_dtype(dtype))


def _reduction(fn):
    def apply(x, dim=None, keepdim=False, *, dtype=None, **_):
        axis = None if dim is None or dim == [] else tuple(dim) if isinstance(
            dim, (list, tuple)) else dim
        out = fn(x, axis=axis, keepdims=keepdim)
        return out if dtype is None else out.astype(jax_dtype(dtype))
    return apply


def _max_dim(fn, arg_fn):
    def apply(x, dim, keepdim=False):
        return fn(x, axis=dim, keepdims=keepdim), arg_fn(x, axis=dim, keepdims=keepdim)
    return apply


def _slice(x, dim=0, start=None, end=None, step=1):
    index = [slice(None)] * jnp.ndim(x)
    index[dim] = slice(start, None if end is None or end >= 2**62 else end, step)
    return x[tuple(index)]


def _pow(a, b):
    if isinstance(b, (int, float)) and not isinstance(b, bool) and b == 0.5:
        return jnp.sqrt(a)
    return jnp.power(a, b)


def _shift(fn):
    def apply(a, b):
        return fn(a, jnp.asarray(b, jnp.result_type(a)))
    return apply


# aten op -> its jnp twin on arrays that hold one value per position (broadcasting) or a whole
# unbatched tensor (torch's shapes). The decompositions reduce a mod to these.
OPS: dict = {
    # arithmetic
    aten.add.Tensor: _alpha(operator.add), aten.add.Scalar: _alpha(operator.add),
    aten.sub.Tensor: _alpha(operator.sub), aten.sub.Scalar: _alpha(operator.sub),
    aten.rsub.Scalar: lambda a, b, alpha=1: b - a * alpha,
    aten.rsub.Tensor: lambda a, b, alpha=1: b - a * alpha,
    aten.mul.Tensor: operator.mul, aten.mul.Scalar: operator.mul,
    aten.div.Tensor: _div, aten.div.Scalar: _div, aten.div.Tensor_mode: _div,
    aten.div.Scalar_mode: _div, aten.floor_divide.default: jnp.floor_divide,
    aten.floor_divide.Scalar: jnp.floor_divide, aten.remainder.Tensor: jnp.remainder,
    aten.remainder.Scalar: jnp.remainder, aten.fmod.Tensor: jnp.fmod,
    aten.fmod.Scalar: jnp.fmod, aten.pow.Tensor_Scalar: _pow, aten.pow.Tensor_Tensor: _pow,
    aten.pow.Scalar: _pow, aten.neg.default: jnp.negative, aten.abs.default: jnp.abs,
    aten.sign.default: jnp.sign, aten.sgn.default: jnp.sign,
    aten.reciprocal.default: jnp.reciprocal, aten.square.default: jnp.square,
    aten.minimum.default: jnp.minimum, aten.maximum.default: jnp.maximum,
    aten.fmin.default: jnp.fmin, aten.fmax.default: jnp.fmax,
    aten.clamp.default: _clamp, aten.clamp.Tensor: _clamp,
    aten.clamp_min.default: jnp.maximum, aten.clamp_max.default: jnp.minimum,
    aten.clamp_min.Tensor: jnp.maximum, aten.clamp_max.Tensor: jnp.minimum,
    aten.atan2.default: jnp.arctan2, aten.copysign.Tensor: jnp.copysign,
    aten.hypot.default: jnp.hypot,
    # transcendental and activation functions
    aten.exp.default: jnp.exp, aten.exp2.default: jnp.exp2, aten.expm1.default: jnp.expm1,
    aten.log.default: jnp.log, aten.log2.default: jnp.log2, aten.log10.default: jnp.log10,
    aten.log1p.default: jnp.log1p, aten.sqrt.default: jnp.sqrt,
    aten.rsqrt.default: jax.lax.rsqrt, aten.sin.default: jnp.sin, aten.cos.default: jnp.cos,
    aten.tan.default: jnp.tan, aten.asin.default: jnp.arcsin, aten.acos.default: jnp.arccos,
    aten.atan.default: jnp.arctan, aten.sinh.default: jnp.sinh, aten.cosh.default: jnp.cosh,
    aten.tanh.default: jnp.tanh, aten.asinh.default: jnp.arcsinh,
    aten.acosh.default: jnp.arccosh, aten.atanh.default: jnp.arctanh,
    aten.sigmoid.default: jax.nn.sigmoid, aten.erf.default: jax.scipy.special.erf,
    aten.erfc.default: jax.scipy.special.erfc, aten.erfinv.default: jax.scipy.special.erfinv,
    aten.gelu.default: _gelu, aten.relu.default: jax.nn.relu,
    aten.leaky_relu.default: _leaky_relu, aten.elu.default: _elu,
    aten.hardtanh.default: _hardtanh, aten.signbit.default: jnp.signbit,
    aten.i0.default: jax.scipy.special.i0,
    aten.floor.default: jnp.floor, aten.ceil.default: jnp.ceil, aten.trunc.default: jnp.trunc,
    aten.round.default: jnp.round, aten.frac.default: lambda x: x - jnp.trunc(x),
    aten.isnan.default: jnp.isnan, aten.isinf.default: jnp.isinf,
    # comparisons, logic, bits
    aten.eq.Tensor: operator.eq, aten.eq.Scalar: operator.eq,
    aten.ne.Tensor: operator.ne, aten.ne.Scalar: operator.ne,
    aten.ge.Tensor: operator.ge, aten.ge.Scalar: operator.ge,
    aten.gt.Tensor: operator.gt, aten.gt.Scalar: operator.gt,
    aten.le.Tensor: operator.le, aten.le.Scalar: operator.le,
    aten.lt.Tensor: operator.lt, aten.lt.Scalar: operator.lt,
    aten.logical_and.default: jnp.logical_and, aten.logical_or.default: jnp.logical_or,
    aten.logical_not.default: jnp.logical_not, aten.logical_xor.default: jnp.logical_xor,
    aten.bitwise_and.Tensor: jnp.bitwise_and, aten.bitwise_and.Scalar: jnp.bitwise_and,
    aten.bitwise_or.Tensor: jnp.bitwise_or, aten.bitwise_or.Scalar: jnp.bitwise_or,
    aten.bitwise_xor.Tensor: jnp.bitwise_xor, aten.bitwise_xor.Scalar: jnp.bitwise_xor,
    aten.bitwise_not.default: jnp.invert,
    aten.__lshift__.Scalar: _shift(jnp.left_shift), aten.__lshift__.Tensor: jnp.left_shift,
    aten.__rshift__.Scalar: _shift(jnp.right_shift), aten.__rshift__.Tensor: jnp.right_shift,
    aten.bitwise_left_shift.Tensor: jnp.left_shift,
    aten.bitwise_right_shift.Tensor: jnp.right_shift,
    aten.where.self: jnp.where, aten.where.ScalarSelf: jnp.where,
    aten.where.ScalarOther: jnp.where, aten.where.Scalar: jnp.where,
    # constructors and copies
    aten.full.default: _full, aten.full_like.default: _full_like,
    aten.scalar_tensor.default: _scalar_tensor, aten.arange.default: _arange,
    aten.arange.start: _arange, aten.arange.start_step: _arange,
    aten._to_copy.default: _to_copy, aten.clone.default: _identity,
    aten.alias.default: _identity, aten.lift_fresh_copy.default: _identity,
    aten.detach.default: _identity,
    # shapes (of unbatched tensors; a batched scalar has none)
    aten.view.default: lambda x, shape: jnp.reshape(x, shape),
    aten._unsafe_view.default: lambda x, shape: jnp.reshape(x, shape),
    aten.reshape.default: lambda x, shape: jnp.reshape(x, shape),
    aten.expand.default: lambda x, shape, **_: jnp.broadcast_to(
        x, tuple(d if s == -1 else s for s, d in zip(shape, (1,) * (len(shape) - jnp.ndim(
            x)) + tuple(jnp.shape(x))))),
    aten.unsqueeze.default: jnp.expand_dims, aten.squeeze.dim: jnp.squeeze,
    aten.squeeze.dims: lambda x, dims: jnp.squeeze(x, tuple(dims)),
    aten.squeeze.default: jnp.squeeze,
    aten.permute.default: jnp.transpose, aten.t.default: jnp.transpose,
    aten.transpose.int: jnp.swapaxes, aten.slice.Tensor: _slice,
    aten.cat.default: lambda xs, dim=0: jnp.concatenate(xs, dim),
    aten.flip.default: jnp.flip,
    # reductions and products (of unbatched tensors)
    aten.sum.dim_IntList: _reduction(jnp.sum), aten.sum.default: _reduction(jnp.sum),
    aten.prod.default: _reduction(jnp.prod), aten.prod.dim_int: _reduction(jnp.prod),
    aten.mean.dim: _reduction(jnp.mean), aten.mean.default: _reduction(jnp.mean),
    aten.amax.default: _reduction(jnp.max), aten.amin.default: _reduction(jnp.min),
    aten.max.default: _reduction(jnp.max), aten.min.default: _reduction(jnp.min),
    aten.max.dim: _max_dim(jnp.max, jnp.argmax), aten.min.dim: _max_dim(jnp.min, jnp.argmin),
    aten.argmax.default: lambda x, dim=None, keepdim=False: jnp.argmax(x, dim, keepdims=keepdim),
    aten.argmin.default: lambda x, dim=None, keepdim=False: jnp.argmin(x, dim, keepdims=keepdim),
    aten.any.default: _reduction(jnp.any), aten.any.dim: _reduction(jnp.any),
    aten.any.dims: _reduction(jnp.any), aten.all.default: _reduction(jnp.all),
    aten.all.dim: _reduction(jnp.all), aten.cumsum.default: lambda x, dim, **_: jnp.cumsum(
        x, dim), aten.dot.default: jnp.dot, aten.mm.default: jnp.matmul,
    aten.bmm.default: jnp.matmul, aten.mv.default: jnp.matmul,
}


# ------------------------------------------------------------------------------------------------
# The interpreter
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Batched:
    """One scalar per position of the tile: an array of (a shape broadcastable to) the tile."""
    array: object


@dataclasses.dataclass(frozen=True)
class _PartialIndex:
    """table[i0, i1, ...] over leading dims with scalar indices (some batched), the rest of the
    table's dims not yet indexed: kept until a later index fills them."""
    table: object
    indices: tuple


class _NeedsVmap(Exception):
    """The graph has a batched value that is not a scalar per position."""


def _array(value):
    if isinstance(value, _Batched):
        return value.array
    if isinstance(value, _PartialIndex):
        if any(isinstance(i, _Batched) for i in value.indices):
            raise _NeedsVmap
        return value.table[tuple(value.indices)]
    return value


def _is_scalar(value) -> bool:
    return isinstance(value, _Batched) or (not isinstance(value, _PartialIndex)
                                          and jnp.ndim(value) == 0)


def _index(x, indices):
    """aten.index.Tensor on an unbatched table (or a partial lookup of one) with scalar indices:
    a point lookup once every dimension is indexed."""
    if isinstance(x, _PartialIndex):
        table, done = x.table, list(x.indices)
    elif isinstance(x, _Batched):
        raise _NeedsVmap
    else:
        table, done = x, []
    if not all(i is None or _is_scalar(i) for i in indices):
        raise _NeedsVmap
    remaining = jnp.ndim(table) - len(done)
    if len(indices) > remaining:
        raise IndexError(f"too many indices for a tensor of {remaining} dimensions")
    if None in indices:  # a slice before an index: gather the other dims now, unbatched only
        return _index_with_slices(table, done, indices)
    done += list(indices)
    if len(done) < jnp.ndim(table):
        return _PartialIndex(table, tuple(done))
    arrays = [_array(i) for i in done]
    lookup = table[tuple(arrays)]
    return _Batched(lookup) if any(isinstance(i, _Batched) for i in done) else lookup


def _index_with_slices(table, done, indices):
    if any(isinstance(i, _Batched) for i in (*done, *indices)):
        raise _NeedsVmap
    full = [*done, *indices]
    return table[tuple(slice(None) if i is None else i for i in full)]


def _select(x, dim, index):
    if isinstance(x, _Batched):
        raise _NeedsVmap
    if dim < 0:
        dim += jnp.ndim(x.table) - len(x.indices) if isinstance(x, _PartialIndex) else jnp.ndim(x)
    if dim == 0:
        return _index(x, [jnp.int32(index)])
    return jnp.take(_array(x), index, axis=dim)


_STRUCTURAL = {aten.index.Tensor: _index, aten.select.int: _select}

# Reductions, which torch applies to one element when a mod reduces one of its 0-d values
# (`score.sum()`, `(q_idx >= kv_idx).any()`): the element in the result's dtype, its index 0,
# or both. Never a reduction over the tile that stands for the scalars.
_ONE_ELEMENT_VALUE = frozenset({
    aten.sum.dim_IntList, aten.sum.default, aten.prod.default, aten.prod.dim_int,
    aten.mean.dim, aten.mean.default, aten.amax.default, aten.amin.default, aten.max.default,
    aten.min.default, aten.any.default, aten.any.dim, aten.any.dims, aten.all.default,
    aten.all.dim, aten.cumsum.default})
_ONE_ELEMENT_INDEX = frozenset({aten.argmax.default, aten.argmin.default})
_ONE_ELEMENT_PAIR = frozenset({aten.max.dim, aten.min.dim})


def _reduces_one_element(node) -> bool:
    if node.target not in _ONE_ELEMENT_VALUE | _ONE_ELEMENT_INDEX | _ONE_ELEMENT_PAIR:
        return False
    source = node.args[0]
    return isinstance(source, torch.fx.Node) and _own_shape(source) == ()


def _one_element_reduction(node, value):
    """`node`, a reduction of one element (`_reduces_one_element`), of `value`."""
    def map_array(fn):
        if isinstance(value, _Batched):
            return _Batched(fn(value.array))
        return fn(value)

    def index(x):
        return jnp.zeros(jnp.shape(x), jnp.int32)

    if node.target in _ONE_ELEMENT_INDEX:
        return map_array(index)
    if node.target in _ONE_ELEMENT_PAIR:
        return map_array(lambda x: x), map_array(index)
    return map_array(lambda x: _as_traced_dtype(x, node, x))


def _run_graph(nodes, constants, args, capture_arrays, arg_slots, capture_slots, *,
               scalar_semantics: bool):
    """Interprets the core-ATen graph. arg_slots[i]: the placeholder index of mod argument i
    (or None: unused); capture_slots[j]: that of captured tensor j. With scalar_semantics
    every value is a plain array at torch's shapes (run under vmap); otherwise batched values
    are `_Batched`."""
    placeholders = [n for n in nodes if n.op == "placeholder"]
    env = {}
    for slot, value in zip(arg_slots, args):
        if slot is not None:
            env[placeholders[slot]] = value if scalar_semantics else _Batched(value)
    for slot, value in zip(capture_slots, capture_arrays):
        env[placeholders[slot]] = value

    def load(a):
        if isinstance(a, torch.fx.Node):
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(load(x) for x in a)
        return a

    for node in nodes:
        if node.op == "get_attr":
            env[node] = constants[node.target]
        elif node.op == "call_function":
            args_, kwargs = load(node.args), {k: load(v) for k, v in node.kwargs.items()}
            if node.target is operator.getitem:
                env[node] = args_[0][args_[1]]
                continue
            if _reduces_one_element(node):
                env[node] = _one_element_reduction(node, args_[0])
                continue
            if not scalar_semantics and node.target in _STRUCTURAL:
                env[node] = _STRUCTURAL[node.target](*args_, **kwargs)
                continue
            if scalar_semantics and node.target is aten.index.Tensor:
                table, indices = args_[0], args_[1]
                env[node] = table[tuple(slice(None) if i is None else i for i in indices)]
                continue
            if scalar_semantics and node.target is aten.select.int:
                env[node] = jnp.take(args_[0], args_[2], axis=args_[1])
                continue
            batched = any(isinstance(v, (_Batched, _PartialIndex))
                          for v in jax.tree_util.tree_leaves(
                              (args_, kwargs), is_leaf=lambda v: isinstance(
                                  v, (_Batched, _PartialIndex))))
            if batched and _own_shape(node) != ():
                raise _NeedsVmap
            plain = jax.tree_util.tree_map(_array, (args_, kwargs), is_leaf=lambda v: isinstance(
                v, (_Batched, _PartialIndex)))
            out = OPS[node.target](*_in_result_dtype(node, plain[0]), **plain[1])
            out = _as_traced_dtype(out, node, plain)
            env[node] = _Batched(out) if batched else out
        elif node.op == "output":
            (result,) = node.args[0] if isinstance(node.args[0], (list, tuple)) else (
                node.args[0],)
            return _array(env[result]) if isinstance(result, torch.fx.Node) else result
    raise ValueError("the mod's graph has no output")


def _own_shape(node) -> tuple:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


# Arithmetic that torch computes in its result's dtype, its operands (a Python float
# included) converted first: `(q_idx + kv_idx) * 0.3` is float32(i) * float32(0.3), where JAX
# with float64 enabled would round the float64 product.
_IN_RESULT_DTYPE = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar,
    aten.rsub.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar})


def _holds_float64(inputs) -> bool:
    return any(getattr(x, "dtype", None) == jnp.float64 for x in jax.tree_util.tree_leaves(inputs))


def _in_result_dtype(node, args: tuple) -> tuple:
    """args of an `_IN_RESULT_DTYPE` node whose result is float32 or float64, converted to
    that dtype (half-precision results compute in float32 in torch: left to JAX); other
    nodes' args as they are."""
    val = node.meta.get("val")
    if node.target not in _IN_RESULT_DTYPE or not isinstance(val, torch.Tensor) or (
            val.dtype not in (torch.float32, torch.float64)):
        return args
    dtype = jax_dtype(val.dtype)
    if dtype != jnp.float64 and _holds_float64(args):
        return args  # a float64 value in a node traced as float32: `_as_traced_dtype`
    return tuple(
        np.asarray(a, dtype)[()] if isinstance(a, (int, float)) and not isinstance(a, bool)
        else jnp.asarray(a).astype(dtype) if getattr(a, "dtype", dtype) != dtype else a
        for a in args)


def _as_traced_dtype(out, node, inputs):
    """torch's result dtype for the node (its type promotion, not JAX's). Mods are traced on a
    float32 score, as torch calls them for every input dtype but float64 (a float64 call's on
    a float64 one): where a float64 value makes the node float64 here, a float32 traced
    result stays float64, as torch's would be; float32 asked for by name (`.float()`) or made
    from integers (`(q_idx - kv_idx) / 7`, torch's default dtype) stays float32."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and not isinstance(out, tuple):
        out = jnp.asarray(out)
        if (val.dtype == torch.float32 and out.dtype == jnp.float64
                and "dtype" not in node.kwargs and _holds_float64(inputs)):
            return out
        return out.astype(jax_dtype(val.dtype))
    return out


# ------------------------------------------------------------------------------------------------
# Public entry points
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class TranslatedMod:
    """A torch mod as a JAX function `fn(capture_arrays, *args)` on broadcastable index arrays
    (and the score). n_captures: how many captured tensors it reads, in the order the capture
    of the mod hands them over."""

    fn: Callable
    n_captures: int
    name: str = "mod"
    capture_names: tuple[str, ...] = ()

    def guard_record(self) -> TranslatedMod:
        """What it computes, for jattn's call plans: itself (a translation never changes)."""
        return self

    def bind(self, arrays: Sequence[jax.Array]) -> Callable:
        """The JAX mod reading `arrays` (JAX views of the captured tensors) as captured arrays,
        named as the torch mod, with `captured_arrays`: (name, array) pairs (for errors)."""
        def bound(*args):
            return self.fn(arrays, *args)
        bound.__name__ = bound.__qualname__ = self.name
        bound.captured_arrays = tuple(zip(self.capture_names, arrays))
        return bound


def lower_to_core_aten(graph_module: torch.fx.GraphModule, example_inputs):
    """The graph of `graph_module` (Dynamo's, torch-level) in core ATen ops."""
    with torch.no_grad():
        return make_fx(graph_module, decomposition_table=DECOMPOSITIONS)(*example_inputs)


def untranslatable_ops(core: torch.fx.GraphModule) -> list[str]:
    return sorted({str(n.target) for n in core.graph.nodes if n.op == "call_function"
                   and n.target not in OPS and n.target not in _STRUCTURAL
                   and n.target is not operator.getitem})


def translate(core: torch.fx.GraphModule, arg_slots: Sequence[int | None],
              capture_slots: Sequence[int], name: str,
              capture_names: Sequence[str]) -> TranslatedMod:
    """The JAX function of a core-ATen mod graph (checked by `untranslatable_ops` first).

    arg_slots[i]: the placeholder index of the mod's argument i, None where the mod does not
    read it; capture_slots: the placeholder indices of its captured tensors, in order, and
    capture_names their names in the mod's code; name: the mod's.
    """
    nodes = list(core.graph.nodes)
    constants = {n.target: jnp.asarray(constant_array(getattr(core, n.target)))
                 for n in nodes if n.op == "get_attr"}
    arg_slots, capture_slots = tuple(arg_slots), tuple(capture_slots)

    def broadcast(capture_arrays, *args):
        return _run_graph(nodes, constants, args, capture_arrays, arg_slots, capture_slots,
                          scalar_semantics=False)

    def scalar(capture_arrays, *args):
        return _run_graph(nodes, constants, args, capture_arrays, arg_slots, capture_slots,
                          scalar_semantics=True)

    def fn(capture_arrays, *args):
        try:
            out = broadcast(capture_arrays, *args)
        except _NeedsVmap:
            out = broadcast_vmap(lambda *a: scalar(capture_arrays, *a), args)
        shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in args))
        return jnp.broadcast_to(out, shape)

    return TranslatedMod(fn, len(capture_slots), name, tuple(capture_names))


def constant_array(tensor: torch.Tensor) -> np.ndarray:
    """A graph's constant tensor as a NumPy array of its JAX dtype."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.float().numpy().astype(jnp.bfloat16)
    return tensor.numpy().astype(np.dtype(jax_dtype(tensor.dtype)))


def broadcast_vmap(fn: Callable, args: Sequence) -> jax.Array:
    """fn (on scalars) applied at every position of the arguments' broadcast shape, mapping
    each argument only over the dims along which it varies."""
    shapes = [jnp.shape(a) for a in args]
    rank = max((len(s) for s in shapes), default=0)
    args = [jnp.reshape(a, (1,) * (rank - jnp.ndim(a)) + tuple(jnp.shape(a))) for a in args]

    def over(dim, args):
        if dim == rank:
            return fn(*args)
        varies = [a.shape[0] > 1 for a in args]
        squeezed = [a if v else a[0] for a, v in zip(args, varies)]
        if not any(varies):
            return over(dim + 1, squeezed)[None]
        inner = lambda *a: over(dim + 1, a)  # noqa: E731
        return jax.vmap(inner, in_axes=[0 if v else None for v in varies])(*squeezed)

    return over(0, args)
