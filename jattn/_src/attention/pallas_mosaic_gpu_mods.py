"""User mods in the Mosaic GPU kernels: captured arrays read by scalar and vector loads, and tanh
kept accurate under the kernels' approximate math.

The kernels evaluate mods (and the backward, score_mod's gradient) on register tiles in the
wgmma layout: [64 queries, 128 keys] in the forward and dQ, [64 keys, 64 queries] in dK/dV.
Mosaic GPU cannot gather into that layout, so a mod is evaluated with three kinds of values kept
symbolic until an operation needs a tile:
- q_idx and kv_idx, as the tile's first row or column plus an iota along it, with the bounds
  their values take over the call (`_Positions`);
- scalars standing for arrays of one value (`_Uniform`): broadcasts of b, h and constants, and
  elements read from captured arrays; integer ones with the range and a divisor of their
  values where the mod states them (`_Bounded`: `lax.clamp` with constant bounds, then sums,
  differences and constant multiples);
- captured arrays left in global memory (`_InMemory`).
Two kinds of reads then stay cheap: an element picked by scalars (`slopes[h]`, `bias[b, h]`, a
one-element array used whole) is a scalar load, and a run along the last dimension picked by
q_idx or kv_idx (`doc_ids[q_idx]`, `doc_ids[b, kv_idx]`) is a vector load along the tile's
queries or keys, broadcast over the tile. q_idx and kv_idx stay positions when shifted by
bounded scalars (`doc_ids[q_idx + offset]`, the offset one value per call or per tile) and
when a per-tile choice picks between shifts (`jnp.where(q_idx < half, q_idx + a, q_idx + b)`
with `half` a multiple of the tile), as a context-parallel ring's global positions are. Any
other read (`bias[q_idx - kv_idx]`, a row used whole) raises `Unreadable` naming it.
`unreadable` evaluates the mods the same way with loads left abstract, so that the registry
sends such calls to pallas_triton with that reason.

The kernel compiles with approximate math, for the softmax's exp2 (one MUFU op). A mod's exp,
exp2 and log stay within a few float32 ulps that way, but tanh.approx is off by up to 2**-11
(0.015 on a softcap of 30), so tanh is computed as 1 - 2 / (2**(2x·log2 e) + 1) instead: one
approximate exp2 and a division, within ~5e-7 of it. On the H100 a softcap runs far faster
this way than with precise math throughout, and no other accurate form tried is faster
(benchmarks/HISTORY.md, "Mods on the Mosaic forward").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jattn._src.attention.common import Mods
from jattn._src.constants import LOG2_E
from jattn._src.compat import jaxpr_and_consts
from jattn._src.jaxpr_eval import Deferred
from jattn._src.mesh_axes import aligned
from jattn._src.user_functions import TracedFunction

# Equations holding a jaxpr that jaxpr_eval inlines when a symbolic value reaches them.
_NESTED = ("pjit", "jit", "custom_jvp_call")

# Primitives applied element by element (with 0-d operands broadcast): on arrays of one value
# they apply to the values.
_ELEMENTWISE = frozenset({
    "abs", "add", "and", "atan2", "ceil", "clamp", "convert_element_type", "cos", "div", "eq",
    "erf", "exp", "exp2", "expm1", "floor", "ge", "gt", "integer_pow", "is_finite", "le", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "not", "or", "pow", "rem",
    "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "sign", "sin", "sqrt", "square", "sub", "tan", "tanh", "xor"})

_COMPARISONS = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge}

# A vector load's start is a multiple of this many elements (the widest load is 16 bytes).
_ALIGNMENT = 8


class Unreadable(NotImplementedError):
    """A mod reads a captured array in a way the Mosaic GPU forward cannot; the message says
    how (`a captured int32[64] array through a gather with an index per score`)."""


class _Kernel:
    """Loads and iotas inside the kernel body."""

    def __init__(self):
        self._tiles: dict[int, tuple[Any, Any]] = {}

    def positions(self, positions: _Positions) -> Any:
        # Each use of q_idx or kv_idx as a tile shares one iota (kept alive beside its key).
        if id(positions) not in self._tiles:
            self._tiles[id(positions)] = (positions, positions.start + self.iota(
                positions.tile, positions.axis))
        return self._tiles[id(positions)][1]

    def iota(self, tile, axis):
        from jax.experimental.pallas import mosaic_gpu as plgpu
        return plgpu.broadcasted_iota(jnp.int32, tile, axis, layout=plgpu.Layout.WGMMA)

    def element(self, ref, flat, dtype):
        return ref[flat]

    def run(self, ref, start, tile, axis, dtype):
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu

        from jattn._src.attention.pallas_mosaic_gpu_tiles import load_vector
        # The tile's rows vary along axis 0: their values sit in the layout of a row reduction.
        vector = load_vector(ref.at[pl.ds(pl.multiple_of(start, _ALIGNMENT), tile[axis])],
                             plgpu.Layout.WGMMA.reduce(1 - axis))
        return lax.broadcast_in_dim(vector, tile, [axis])


class _Abstract(_Kernel):
    """Loads and iotas as `unreadable` sees them (under jax.eval_shape): zeros."""

    def iota(self, tile, axis):
        return lax.broadcasted_iota(jnp.int32, tile, axis)

    def element(self, ref, flat, dtype):
        return jnp.zeros((), dtype)

    def run(self, ref, start, tile, axis, dtype):
        return jnp.zeros(tile, dtype)


@dataclasses.dataclass(frozen=True)
class _InMemory(Deferred):
    """A captured array in global memory, flattened (`ref`), with its shape and dtype (bool
    arrays are stored as int32)."""
    ref: Any
    shape: tuple[int, ...]
    dtype: Any
    env: _Kernel

    def describe(self) -> str:
        return f"a captured {jax.core.ShapedArray(self.shape, self.dtype).str_short()} array"

    def _flat(self, index: Sequence[Any]) -> Any:
        flat = 0
        for i, size in zip(index, self.shape):
            flat = flat * size + jnp.clip(i, 0, size - 1)
        return flat

    def _typed(self, value: Any) -> Any:
        return value != 0 if self.dtype == jnp.bool_ else value

    def element(self, index: Sequence[Any]) -> Any:
        """The element at scalar indices, clamped into the array as a traced lookup's are."""
        return self._typed(self.env.element(self.ref, self._flat(index), self.dtype))

    def run(self, leading: Sequence[Any], positions: _Positions) -> Any:
        """A tile of the elements at `leading` scalar indices and `positions` along the last
        dimension (which `positions` stays inside), constant across the other tile axis."""
        start = self._flat([*leading, 0]) + positions.start
        return self._typed(self.env.run(self.ref, start, positions.tile, positions.axis,
                                        self.dtype))


@dataclasses.dataclass(frozen=True)
class _Positions(Deferred):
    """q_idx (axis 0) or kv_idx (axis 1) of a tile: `start` plus the row or column. Its values
    lie in [lo, hi) over the call and every tile's `start` is a multiple of `alignment`;
    `shape` is the tile's, with ones appended where the mod made it an index vector."""
    axis: int
    start: Any
    lo: int
    hi: int
    tile: tuple[int, int]
    shape: tuple[int, ...]
    alignment: int

    def shifted(self, by: _Bounded) -> _Positions:
        return dataclasses.replace(self, start=self.start + by.value, lo=self.lo + by.lo,
                                   hi=self.hi + by.hi - 1,
                                   alignment=math.gcd(self.alignment, by.multiple))

    def tile_uniform(self, divisor: int) -> bool:
        """Whether positions compared with, or divided by, multiples of `divisor` give one
        value across each tile: the tiles start at multiples of their extent, which divides
        `divisor`."""
        extent = self.tile[self.axis]
        return self.alignment % extent == 0 and divisor % extent == 0

    def with_shape(self, shape: Sequence[int]) -> _Positions | None:
        shape = tuple(shape)
        extra = shape[len(self.tile):]
        if shape[:len(self.tile)] != self.tile or any(d != 1 for d in extra):
            return None
        return dataclasses.replace(self, shape=shape)


@dataclasses.dataclass(frozen=True)
class _Uniform(Deferred):
    """A scalar standing for an array of `shape` holding it everywhere."""
    value: Any
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Bounded(_Uniform):
    """An integer _Uniform whose value lies in [lo, hi) and is a multiple of `multiple`
    (0: the value is 0)."""
    lo: int = 0
    hi: int = 1
    multiple: int = 0

    @classmethod
    def of(cls, x: Any, shape: Sequence[int] = ()) -> _Bounded | None:
        """x as a _Bounded where its bounds are known (a constant integer), else None."""
        if isinstance(x, _Bounded):
            return x
        constant = _static(x)
        if not isinstance(constant, (int, np.integer)) or isinstance(constant, bool):
            return None
        constant = int(constant)
        return cls(constant, tuple(getattr(x, "shape", shape)), constant, constant + 1,
                   abs(constant))

    def negated(self) -> _Bounded:
        return _Bounded(-self.value, self.shape, 1 - self.hi, 1 - self.lo, self.multiple)


@dataclasses.dataclass(frozen=True)
class _Index(Deferred):
    """Index vectors along a last axis (a concatenation): one scalar or one q_idx / kv_idx per
    component."""
    parts: tuple[Any, ...]
    shape: tuple[int, ...]


def _uniform(value: Any, shape: Sequence[int]) -> Any:
    return value if tuple(shape) == () else _Uniform(value, tuple(shape))


def _scalar(x: Any) -> Any:
    """A scalar operand's value: a uniform's, a one-element captured array's element."""
    if isinstance(x, _InMemory):
        return x.element([0] * len(x.shape))
    return x.value if isinstance(x, _Uniform) else x


def _is_scalar(x: Any) -> bool:
    if isinstance(x, _InMemory):
        return math.prod(x.shape) == 1
    return isinstance(x, _Uniform) or (not isinstance(x, Deferred) and jnp.ndim(x) == 0)


def _static(x: Any) -> Any:
    """x's value where known while tracing (a literal, a comparison decided by bounds)."""
    x = x.value if isinstance(x, _Uniform) else x
    if isinstance(x, (bool, int, float, np.generic)) or (isinstance(x, np.ndarray)
                                                        and x.ndim == 0):
        return x.item() if hasattr(x, "item") else x
    return None


def _tanh(x: Any) -> Any:
    # 2**(2x·log2 e) overflows to inf for large x, giving 1; underflows to 0, giving -1.
    return 1.0 - 2.0 / (jnp.exp2(x * (2.0 * LOG2_E)) + 1.0)


def _bind(primitive, operands, params) -> Any:
    """The op on concrete operands, cast to vary alike over mesh axes (inside shard_map,
    jaxpr_eval leaves operands that were symbolic to the rewrite)."""
    if primitive.name == "tanh":
        return _tanh(operands[0])
    return primitive.bind(*aligned(*operands), **params)


def _array(env: _Kernel, x: Any, used_in: str) -> Any:
    """A symbolic value as an array of its shape; `used_in` names the operation that needs
    it (for what cannot be one)."""
    if isinstance(x, _Uniform):
        return jnp.broadcast_to(x.value, x.shape)
    if isinstance(x, _InMemory):
        if math.prod(x.shape) != 1:
            raise Unreadable(f"{x.describe()} whole (in `{used_in}`)")
        return jnp.broadcast_to(_scalar(x), x.shape)
    if isinstance(x, _Positions):
        if x.shape != x.tile:
            raise Unreadable(f"q_idx or kv_idx as an index vector {x.shape} (in `{used_in}`)")
        return env.positions(x)
    if isinstance(x, _Index):
        raise Unreadable(f"an index vector {x.shape} built from q_idx or kv_idx (in "
                         f"`{used_in}`)")
    return x


def _gather(table: _InMemory, indices: Any, params) -> Any:
    """table[indices] (a lookup per index vector) as a scalar or vector load."""
    how = f"{table.describe()} through a gather"
    numbers, rank = params["dimension_numbers"], len(table.shape)
    if (tuple(numbers.offset_dims) or tuple(numbers.collapsed_slice_dims) != tuple(range(rank))
            or tuple(numbers.start_index_map) != tuple(range(rank))
            or tuple(numbers.operand_batching_dims)
            or any(size != 1 for size in params["slice_sizes"])):
        raise Unreadable(f"{how} of slices")
    if params["mode"] not in (lax.GatherScatterMode.CLIP,
                              lax.GatherScatterMode.PROMISE_IN_BOUNDS):
        raise Unreadable(f"{how} that fills out-of-bounds reads (jnp.take's default mode; "
                         "index the array instead)")
    if isinstance(indices, _Index):
        parts = list(indices.parts)
    elif isinstance(indices, _Uniform):
        parts = [indices] * indices.shape[-1]
    elif isinstance(indices, _Positions) and indices.shape[-1:] == (1,):
        parts = [indices]
    else:
        raise Unreadable(f"{how} with an index per score")
    if len(parts) != rank:
        raise Unreadable(f"{how} of slices")
    out_shape = tuple(indices.shape[:-1])
    along = [i for i, part in enumerate(parts) if isinstance(part, _Positions)]
    if not along:
        return _uniform(table.element([_scalar(part) for part in parts]), out_shape)
    positions = parts[-1]
    if along != [rank - 1] or out_shape != positions.tile:
        raise Unreadable(f"{how} with an index per score (q_idx or kv_idx may index its last "
                         "dimension only, with scalars before it)")
    if positions.lo < 0 or positions.hi > table.shape[-1]:
        raise Unreadable(f"{how} at positions {positions.lo} to {positions.hi - 1}, beyond its "
                         f"last dimension of {table.shape[-1]}")
    if positions.alignment % _ALIGNMENT or (rank > 1 and table.shape[-1] % _ALIGNMENT):
        raise Unreadable(f"{how} at an offset or a row length that is not a multiple of "
                         f"{_ALIGNMENT}")
    return table.run([_scalar(part) for part in parts[:-1]], positions)


def _on_positions(name: str, operands: Sequence[Any], params) -> Any:
    """An elementwise op kept symbolic on q_idx / kv_idx: shifts by bounded scalars,
    comparisons that their bounds or the tiles decide, divisions the tiles decide, and
    selections by a decided or per-tile predicate; None otherwise."""
    if name == "select_n":
        return _selected(*operands)
    if name == "convert_element_type":
        keep = jnp.dtype(params["new_dtype"]) == jnp.int32
        return operands[0] if keep and isinstance(operands[0], _Positions) else None
    if len(operands) != 2:
        return None
    first, second = operands
    if isinstance(first, _Positions):
        positions, other, positions_first = first, second, True
    elif isinstance(second, _Positions):
        positions, other, positions_first = second, first, False
    else:
        return None
    shift = _Bounded.of(other)
    if shift is None:
        return None
    if name == "add" or (name == "sub" and positions_first):
        return positions.shifted(shift if name == "add" else shift.negated())
    constant = _static(other)
    if not isinstance(constant, int):
        return None
    if name in _COMPARISONS:
        compare = _COMPARISONS[name]

        def compared(x):
            return compare(x, constant) if positions_first else compare(constant, x)

        ends = [compared(x) for x in (positions.lo, positions.hi - 1)]
        # A comparison with a constant is monotonic in the position: equal ends decide it.
        if ends[0] == ends[1]:
            return _Uniform(np.bool_(ends[0]), positions.shape)
        # `position < t` (or its negation) is one value across a tile when t is a multiple
        # of the tile's extent: then the tile's first position decides it.
        strict = (name in ("lt", "ge")) == positions_first
        if positions.tile_uniform(constant if strict else constant + 1):
            return _Uniform(compared(positions.start), positions.shape)
        return None
    if (name == "div" and positions_first and constant > 0 and positions.lo >= 0
            and positions.tile_uniform(constant)):
        return _Bounded(lax.div(positions.start, jnp.int32(constant)), positions.shape,
                        positions.lo // constant, (positions.hi - 1) // constant + 1, 1)
    return None


def _selected(predicate: Any, *cases: Any) -> Any:
    """select_n on q_idx / kv_idx: the case a decided predicate picks, or positions whose
    start a per-tile predicate picks among the cases' starts; None otherwise."""
    decided = _static(predicate) if isinstance(predicate, _Uniform) else None
    if decided is not None:
        return cases[int(decided)]
    if not isinstance(predicate, _Uniform) or not all(isinstance(c, _Positions) for c in cases):
        return None
    first = cases[0]
    if any((c.axis, c.tile, c.shape) != (first.axis, first.tile, first.shape) for c in cases):
        return None
    return dataclasses.replace(
        first, start=lax.select_n(predicate.value, *(c.start for c in cases)),
        lo=min(c.lo for c in cases), hi=max(c.hi for c in cases),
        alignment=functools.reduce(math.gcd, (c.alignment for c in cases)))


def _bounded(name: str, operands: Sequence[Any], params, shape) -> _Bounded | None:
    """An integer op on scalars whose result's bounds follow from its operands': a clamp
    between constants, sums and differences of bounded scalars, constant multiples."""
    if name == "clamp":
        low, high = (_static(x) for x in (operands[0], operands[2]))
        if not all(isinstance(x, int) for x in (low, high)):
            return None
        return _Bounded(_bind(lax.clamp_p, [_scalar(x) for x in operands], params), shape,
                        low, high + 1, 1)
    if name == "convert_element_type":
        kept = jnp.dtype(params["new_dtype"]) == jnp.int32
        return operands[0] if kept and isinstance(operands[0], _Bounded) else None
    if name not in ("add", "sub", "mul") or not any(isinstance(x, _Bounded) for x in operands):
        return None
    a, b = (_Bounded.of(x) for x in operands)
    if a is None or b is None:
        return None
    value = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}[name](
        *aligned(a.value, b.value))
    if name == "sub":
        b = b.negated()
    if name in ("add", "sub"):
        return _Bounded(value, shape, a.lo + b.lo, a.hi + b.hi - 1,
                        math.gcd(a.multiple, b.multiple))
    constant, other = (a, b) if a.hi - a.lo == 1 else (b, a)
    if constant.hi - constant.lo != 1:
        return None  # (a product of two ranges: bounds not tracked)
    ends = sorted(constant.lo * x for x in (other.lo, other.hi - 1))
    return _Bounded(value, shape, ends[0], ends[1] + 1, other.multiple * abs(constant.lo))


def _elementwise(primitive, operands, params) -> Any:
    """An elementwise op on symbolic operands kept symbolic where it can be; None otherwise."""
    for x in operands:
        if isinstance(x, _InMemory) and math.prod(x.shape) != 1:
            raise Unreadable(f"{x.describe()} whole (in `{primitive.name}`)")
    if any(isinstance(x, (_Positions, _Index)) for x in operands):
        return _on_positions(primitive.name, operands, params)
    if not all(_is_scalar(x) for x in operands):
        return None
    shape = max((x.shape for x in operands if isinstance(x, Deferred)), key=len)
    bounded = _bounded(primitive.name, operands, params, shape)
    if bounded is not None:
        return bounded
    try:
        out = _bind(primitive, [_scalar(x) for x in operands], params)
    except (TypeError, ValueError):
        return None
    return _uniform(out, shape)


def _reshaped(x: Any, shape: Sequence[int]) -> Any:
    if isinstance(x, _Bounded):
        return dataclasses.replace(x, shape=tuple(shape))
    if isinstance(x, _Uniform):
        return _uniform(x.value, shape)
    if isinstance(x, _InMemory) and math.prod(x.shape) == 1:
        return _uniform(_scalar(x), shape)
    if isinstance(x, _Positions):
        return x.with_shape(shape)
    return None


def _structural(name: str, operands: Sequence[Any], params) -> Any:
    """Broadcasts, reshapes and concatenations of symbolic values kept symbolic; lookups into
    captured arrays as loads; None for anything else."""
    x = operands[0]
    if name == "broadcast_in_dim":
        if isinstance(x, _Positions) and tuple(params["broadcast_dimensions"]) != tuple(
                range(len(x.shape))):
            return None
        return _reshaped(x, params["shape"])
    if name == "reshape" and params.get("dimensions") is None:
        return _reshaped(x, params["new_sizes"])
    if name == "squeeze":
        return _reshaped(x, [d for i, d in enumerate(x.shape) if i not in params["dimensions"]])
    if name == "concatenate" and params["dimension"] == len(x.shape) - 1:
        parts: list[Any] = []
        for part in operands:
            if isinstance(part, _Uniform):
                parts += [part] * part.shape[-1]
            elif isinstance(part, _Positions) and part.shape[-1:] == (1,):
                parts.append(part)
            else:
                return None
        return _Index(tuple(parts), (*x.shape[:-1], len(parts)))
    if name == "dynamic_slice" and isinstance(x, _InMemory):
        if any(size != 1 for size in params["slice_sizes"]):
            raise Unreadable(f"{x.describe()} a slice at a time")
        return _uniform(x.element([_scalar(i) for i in operands[1:]]), params["slice_sizes"])
    if name == "gather" and isinstance(x, _InMemory):
        return _gather(x, operands[1], params)
    return None


def _rewrite(env: _Kernel, primitive, operands, params, out_avals) -> list[Any] | None:
    """jaxpr_eval's rewrite for mods in the kernel (see the module docstring)."""
    name = primitive.name
    if name in _NESTED:
        return None
    renamed = name == "add_any"  # a gradient's sum of cotangents: Mosaic GPU lowers add
    if renamed:
        primitive, name = lax.add_p, "add"
    if not any(isinstance(x, Deferred) for x in operands):
        if name == "broadcast_in_dim" and jnp.ndim(operands[0]) == 0:
            return [_uniform(operands[0], params["shape"])]
        return [_bind(primitive, operands, params)] if name == "tanh" or renamed else None
    out = (_elementwise(primitive, operands, params) if name in _ELEMENTWISE
           else _structural(name, operands, params))
    if out is not None:
        return [out]
    out = _bind(primitive, [_array(env, x, name) for x in operands], params)
    return out if primitive.multiple_results else [out]


def _evaluate(fn: TracedFunction, env: _Kernel, refs: Sequence[Any], avals: Sequence[Any],
              leading: Sequence[Any], starts: Sequence[Any], seq_lengths: Sequence[int],
              tile: tuple[int, int], transposed: bool = False,
              trailing: Sequence[Any] = ()) -> list[Any]:
    captures = [None if aval is None else
                _InMemory(ref, tuple(aval.shape), aval.dtype, env)
                for ref, aval in zip(refs, avals)]
    axes = (1, 0) if transposed else (0, 1)
    positions = [_Positions(axis, start, 0, length, tile, tile, tile[axis])
                 for axis, start, length in zip(axes, starts, seq_lengths)]
    outputs = fn(captures, *leading, *positions, *trailing,
                 rewrite=functools.partial(_rewrite, env))
    return [_array(env, out, "the mod's result") for out in outputs]


def call_in_kernel(fn: TracedFunction, refs: Sequence[Any], avals: Sequence[Any],
                   leading: Sequence[Any], starts: Sequence[Any], seq_lengths: Sequence[int],
                   tile: tuple[int, int], *, transposed: bool = False,
                   trailing: Sequence[Any] = ()) -> list[Any]:
    """A traced mod's outputs in the kernel body, on a `tile` whose first query and key are
    the positions `starts` (int32 scalars) of sequences of `seq_lengths` (L, S): queries along
    axis 0 and keys along axis 1, or the other way round when `transposed`.

    refs: the call's captured arrays in global memory, flattened (capture-list order), with
    `avals` their shapes and dtypes; leading: the mod's arguments before q_idx and kv_idx
    ((score, b, h) or (b, h)), trailing: those after them (a score_mod vjp's cotangent).
    Raises Unreadable for a read it cannot make.
    """
    return _evaluate(fn, _Kernel(), refs, avals, leading, starts, seq_lengths, tile,
                     transposed, trailing)


def unreadable(mods: Mods, seq_lengths: Sequence[int], tile: tuple[int, int]) -> str | None:
    """The first captured-array read of `mods` (traced at the kernel's `tile`) that the kernel
    cannot make, described (`mask_mod reads a captured f32[16,1024] array through a gather
    with an index per score`); None when it can make them all."""
    index = jax.ShapeDtypeStruct((), jnp.int32)
    score = jax.ShapeDtypeStruct(tile, jnp.float32)
    for name, fn, leading, trailing in (
            ("score_mod", mods.score, [score, index, index], []),
            ("score_mod's gradient", mods.score_vjp, [score, index, index], [score]),
            ("mask_mod", mods.mask, [index, index], [])):
        if fn is None:
            continue
        consts = jaxpr_and_consts(fn.closed_jaxpr)[0].constvars
        avals: list[Any] = [None] * (max(fn.capture_slots, default=-1) + 1)
        for slot, var in zip(fn.capture_slots, consts):
            avals[slot] = var.aval

        def abstract(leading, starts, trailing, fn=fn, avals=avals):
            return _evaluate(fn, _Abstract(), [None] * len(avals), avals, leading, starts,
                             seq_lengths, tile, trailing=trailing)

        try:
            jax.eval_shape(abstract, leading, [index, index], trailing)
        except Unreadable as error:
            return f"{name} reads {error}"
    return None
