"""Out-of-range reads of arrays in a mod, found at trace time from the call's shapes.

JAX clamps an index past an array's end (`ids[q_idx]` with fewer ids than queries reads the
last id for every later query), so a mod reading an array that does not cover the call gives a
silently wrong result. The call bounds the mod's arguments (b < B, h < H, q_idx < L,
kv_idx < S), so the indices it computes from them have known ranges: `check_reads` evaluates
the mod's jaxpr on ranges instead of values (`jaxpr_eval` with a rewrite) and raises a
`ValueError` naming the mod, the array and the fix where a plain index (`x[i]`, which promises
to stay in bounds) can leave its array.

An index range is only reported when its offending end is certainly reached at some position
of the call: ranges of affine expressions of the arguments (`kv_idx - q_idx + 8`), of
min/max/clip/abs, floor division and remainder by constants, and of jnp's own wrapping of
negative indices are exact; anything else (values read from arrays, products of arguments)
widens to a bound that is never reported. Such reads keep JAX's clamping, as do explicit
modes (`x.at[i].get(mode="clip")`, `jnp.take`'s "fill"). A reported read may still be
discarded (by a jnp.where, say): the error says to state that with an explicit mode.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jattn._src.compat import jaxpr_and_consts, with_consts
from jattn._src.jaxpr_eval import Deferred, evaluate
from jattn._src.mod_errors import name_of
from jattn._src.programs import ProgramCache

# The arguments' names, in the order a mod takes them after `score`.
ARGUMENTS = ("b", "h", "q_idx", "kv_idx")
_INF = math.inf


# ------------------------------------------------------------------------------------------------
# Abstract values
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Int:
    """An integer that takes values in [lo, hi] over the call; lo_reached / hi_reached: that
    end is certainly taken at some position. form: the value as an affine expression of the
    arguments, ((name, coefficient), ...) and a constant, where known (then both ends are
    reached). uses: the arguments it depends on ("?" for anything else)."""
    lo: float
    hi: float
    lo_reached: bool
    hi_reached: bool
    form: tuple | None
    uses: frozenset

    @property
    def constant(self) -> int | None:
        return int(self.lo) if self.form is not None and not self.form[0] else None


@dataclasses.dataclass(frozen=True)
class _Bool:
    """A bool: `value` where decided over the whole call, else None; `cond`: (form, op) when it
    is `form op 0` for an affine form."""
    value: bool | None
    cond: tuple | None = None


_UNKNOWN = None  # an element nothing is known of (floats included)
_UNDECIDED = _Bool(None)


def _unknown_int(uses=frozenset({"?"})) -> _Int:
    return _Int(-_INF, _INF, False, False, None, uses)


@dataclasses.dataclass(frozen=True)
class _Value(Deferred):
    """An array the analysis follows: its elements (one for every position, or one per entry
    of its last axis: index vectors) and its shape and dtype."""
    elements: tuple
    shape: tuple
    dtype: Any

    def element(self, i: int):
        return self.elements[0] if len(self.elements) == 1 else self.elements[i]


@dataclasses.dataclass(frozen=True)
class _Array(Deferred):
    """An array the mod reads: a captured one (by position in the jaxpr's constants)."""
    index: int
    shape: tuple
    dtype: Any


def _form_range(form, ranges) -> tuple[int, int]:
    terms, constant = form
    lo = hi = constant
    for name, coefficient in terms:
        a, b = (coefficient * end for end in ranges[name])
        lo, hi = lo + min(a, b), hi + max(a, b)
    return lo, hi


def _unit(form) -> bool:
    """Every coefficient ±1: the form takes every integer between its ends."""
    return form is not None and all(abs(c) == 1 for _, c in form[0])


class _Analysis:
    """The rewrite: elementwise rules on elements, structure on `_Value`s, checks at gathers."""

    def __init__(self, ranges: dict[str, tuple[int, int]]):
        self.ranges = ranges
        self.violation: tuple | None = None

    # ---- elements ----------------------------------------------------------------------------

    def from_form(self, terms: dict, constant: int) -> _Int:
        form = (tuple(sorted((n, c) for n, c in terms.items() if c)), constant)
        lo, hi = _form_range(form, self.ranges)
        return _Int(lo, hi, True, True, form, frozenset(n for n, _ in form[0]))

    def constant(self, value) -> _Int:
        return self.from_form({}, int(value))

    def argument(self, name: str) -> _Int:
        if not math.isfinite(self.ranges[name][0]):  # values not known: nothing reached
            return _unknown_int(frozenset({name}))
        return self.from_form({name: 1}, 0)

    def add(self, a: _Int, b: _Int, sign: int = 1) -> _Int:
        if sign < 0:
            b = self.negate(b)
        if a.form is not None and b.form is not None:
            terms = dict(a.form[0])
            for name, c in b.form[0]:
                terms[name] = terms.get(name, 0) + c
            return self.from_form(terms, a.form[1] + b.form[1])
        apart = not (a.uses & b.uses)
        return _Int(a.lo + b.lo, a.hi + b.hi, apart and a.lo_reached and b.lo_reached,
                    apart and a.hi_reached and b.hi_reached, None, a.uses | b.uses)

    def negate(self, a: _Int) -> _Int:
        if a.form is not None:
            return self.from_form({n: -c for n, c in a.form[0]}, -a.form[1])
        return _Int(-a.hi, -a.lo, a.hi_reached, a.lo_reached, None, a.uses)

    def multiply(self, a: _Int, b: _Int) -> _Int:
        if a.constant is None and b.constant is not None:
            a, b = b, a
        if a.constant is not None:
            c = a.constant
            if b.form is not None:
                return self.from_form({n: c * k for n, k in b.form[0]}, c * b.form[1])
            if c == 0:
                return self.constant(0)
            ends = (c * b.lo, c * b.hi, b.lo_reached, b.hi_reached)
            lo, hi, lo_r, hi_r = ends if c > 0 else (ends[1], ends[0], ends[3], ends[2])
            return _Int(lo, hi, lo_r, hi_r, None, b.uses)
        if not all(map(math.isfinite, (a.lo, a.hi, b.lo, b.hi))):
            return _unknown_int(a.uses | b.uses)
        apart = not (a.uses & b.uses)
        corners = [(x * y, apart and rx and ry) for x, rx in ((a.lo, a.lo_reached),
                                                             (a.hi, a.hi_reached))
                   for y, ry in ((b.lo, b.lo_reached), (b.hi, b.hi_reached))]
        lo, hi = min(c for c, _ in corners), max(c for c, _ in corners)
        return _Int(lo, hi, any(r for c, r in corners if c == lo),
                    any(r for c, r in corners if c == hi), None, a.uses | b.uses)

    def maximum(self, a: _Int, b: _Int) -> _Int:
        # The larger top is reached whatever the other is; the bottom needs both bottoms at
        # once, which independent (or constant) operands give.
        top = a if (a.hi, a.hi_reached) >= (b.hi, b.hi_reached) else b
        together = not (a.uses & b.uses)
        return _Int(max(a.lo, b.lo), top.hi, together and a.lo_reached and b.lo_reached,
                    top.hi_reached, None, a.uses | b.uses)

    def minimum(self, a: _Int, b: _Int) -> _Int:
        return self.negate(self.maximum(self.negate(a), self.negate(b)))

    def absolute(self, a: _Int) -> _Int:
        if a.lo >= 0:
            return a
        if a.hi <= 0:
            return self.negate(a)
        top = (-a.lo, a.lo_reached) if -a.lo >= a.hi else (a.hi, a.hi_reached)
        return _Int(0, top[0], _unit(a.form), top[1], None, a.uses)

    def divide(self, a: _Int, b: _Int, rounding: Callable[[float], float]) -> _Int:
        """a / c rounded by `rounding` for a constant c > 0 (monotonic: ends kept)."""
        c = b.constant
        if c is None or c <= 0 or not all(map(math.isfinite, (a.lo, a.hi))):
            return _unknown_int(a.uses | b.uses)
        return _Int(rounding(a.lo / c), rounding(a.hi / c), a.lo_reached, a.hi_reached, None,
                    a.uses)

    def modulo(self, a: _Int, b: _Int) -> _Int:
        """a mod c for a constant c > 0 with a >= 0 (where C's rem and Python's % agree)."""
        c = b.constant
        if c is None or c <= 0 or a.lo < 0 or not math.isfinite(a.hi):
            return _unknown_int(a.uses | b.uses)
        a_lo, a_hi = int(a.lo), int(a.hi)
        if a_lo // c == a_hi // c:  # one period: monotonic
            return _Int(a_lo % c, a_hi % c, a.lo_reached, a.hi_reached, None, a.uses)
        return _Int(0, c - 1, _unit(a.form), _unit(a.form), None, a.uses)

    def compare(self, name: str, a: _Int, b: _Int) -> _Bool:
        d = self.add(a, b, -1)
        outcomes = {"lt": (d.hi < 0, d.lo >= 0), "le": (d.hi <= 0, d.lo > 0),
                    "gt": (d.lo > 0, d.hi <= 0), "ge": (d.lo >= 0, d.hi < 0),
                    "eq": (d.lo == d.hi == 0, d.lo > 0 or d.hi < 0),
                    "ne": (d.lo > 0 or d.hi < 0, d.lo == d.hi == 0)}
        always, never = outcomes[name]
        if always or never:
            return _Bool(bool(always))
        return _Bool(None, None if d.form is None else (d.form, name))

    def select(self, pred: _Bool, cases: Sequence) -> Any:
        if pred.value is not None:
            return cases[int(pred.value)]
        if not all(isinstance(c, _Int) for c in cases):
            return _UNDECIDED if all(isinstance(c, _Bool) for c in cases) else _UNKNOWN
        parts = [self._where(pred, case, taken=bool(i)) for i, case in enumerate(cases)]
        lo = min(p[0] for p in parts)
        hi = max(p[1] for p in parts)
        return _Int(lo, hi, any(p[2] for p in parts if p[0] == lo),
                    any(p[3] for p in parts if p[1] == hi), None,
                    frozenset().union(*(c.uses for c in cases)))

    def _where(self, pred: _Bool, case: _Int, taken: bool) -> tuple:
        """(lo, hi, lo reached, hi reached) of `case` where `pred` is `taken`."""
        if pred.cond is not None and _unit(pred.cond[0]) and case.form is not None and (
                case.form[0] == pred.cond[0][0]):
            form, name = pred.cond
            lo, hi = _form_range(form, self.ranges)
            region = {"lt": (lo, -1), "le": (lo, 0), "gt": (1, hi), "ge": (0, hi),
                      "eq": (0, 0), "ne": (lo, hi)}
            negated = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}
            r_lo, r_hi = region[name if taken else negated[name]]
            r_lo, r_hi = max(r_lo, lo), min(r_hi, hi)
            shift = case.form[1] - form[1]
            exact = (name if taken else negated[name]) != "ne"
            return r_lo + shift, r_hi + shift, exact, exact
        # Elsewhere the case's own range bounds it; its ends are reached where pred is
        # `taken` only if the case does not depend on what pred does.
        apart = pred.cond is not None and not (case.uses & {n for n, _ in pred.cond[0][0]})
        return case.lo, case.hi, apart and case.lo_reached, apart and case.hi_reached

    # ---- the rewrite -----------------------------------------------------------------------

    def element_of(self, x: Any, i: int) -> Any:
        if isinstance(x, _Value):
            return x.element(i)
        if isinstance(x, _Array):
            return _UNKNOWN
        values = np.asarray(x)
        if values.dtype == np.bool_:
            return _Bool(bool(values.all())) if values.all() == values.any() else _UNDECIDED
        if not np.issubdtype(values.dtype, np.integer):
            return _UNKNOWN
        if values.size == 1:
            return self.constant(values.reshape(()))
        # a constant array's values are all used (each position reads them)
        return _Int(int(values.min()), int(values.max()), True, True, None, frozenset())

    def __call__(self, primitive, operands, params, out_avals):
        name = primitive.name
        if not any(isinstance(x, Deferred) for x in operands):
            return None
        if name in ("pjit", "jit"):
            return self._named_call(params, operands, out_avals)
        if name == "custom_jvp_call":
            return None  # inlined by evaluate
        if name == "gather":
            self._check_gather(operands[0], operands[1], params)
        if name in _ELEMENTWISE and len(out_avals) == 1:
            return [self._elementwise(name, operands, params, out_avals[0])]
        if name == "concatenate" and params["dimension"] == len(out_avals[0].shape) - 1:
            return [self._concatenated(operands, out_avals[0])]
        if name in _STRUCTURAL and isinstance(operands[0], _Value):
            return [self._structural(name, operands[0], params, out_avals[0])]
        return [_Value((_UNKNOWN,), tuple(a.shape), a.dtype) for a in out_avals]

    def _named_call(self, params, operands, out_avals):
        """jnp's floor_divide and remainder as one op each (their jaxprs branch on signs);
        other jitted functions inlined."""
        rule = {"floor_divide": lambda a, b: self.divide(a, b, math.floor),
                "remainder": self.modulo}.get(params.get("name"))
        if rule is None or len(operands) != 2 or len(out_avals) != 1:
            return None
        return [self._map(lambda a, b: rule(a, b) if isinstance(a, _Int) and isinstance(
            b, _Int) else _UNKNOWN, operands, out_avals[0])]

    def _map(self, fn, operands, aval) -> _Value:
        """fn on the operands' elements: per entry of the last axis where an operand varies
        along it (an index vector, a constant array), else once for every position."""
        shape = tuple(aval.shape)

        def varies(x) -> bool:
            last = x.shape[-1:] if isinstance(x, Deferred) else np.shape(x)[-1:]
            distinct = not isinstance(x, Deferred) or (isinstance(x, _Value)
                                                      and len(x.elements) > 1)
            return bool(shape) and distinct and last == shape[-1:] and shape[-1] > 1

        per_entry = any(varies(x) for x in operands)
        length = shape[-1] if per_entry else 1
        elements = tuple(fn(*(self.component(x, i) if varies(x) else self.element_of(x, 0)
                              for x in operands)) for i in range(length))
        return _Value(elements, shape, aval.dtype)

    def _elementwise(self, name, operands, params, aval) -> _Value:
        def rule(*xs):
            if name == "select_n":
                return self.select(xs[0], xs[1:]) if isinstance(xs[0], _Bool) else _UNKNOWN
            if name == "convert_element_type":
                return _converted(xs[0], aval.dtype, self)
            if name in ("and", "or", "not") and all(isinstance(x, _Bool) for x in xs):
                return _logic(name, xs)
            if not all(isinstance(x, _Int) for x in xs):
                return _UNKNOWN
            return _INT_RULES[name](self, *xs)
        return self._map(rule, operands, aval)

    def _concatenated(self, operands, aval) -> _Value:
        """Index vectors: one element per entry of the last axis."""
        elements = []
        for part in operands:
            part_shape = part.shape if isinstance(part, Deferred) else np.shape(part)
            elements += [self.component(part, i) for i in range(part_shape[-1])]
        return _Value(tuple(elements), tuple(aval.shape), aval.dtype)

    def _structural(self, name, x: _Value, params, aval) -> _Value:
        shape = tuple(aval.shape)
        if len(x.elements) == 1:
            return _Value(x.elements, shape, aval.dtype)
        keeps_last = {
            "broadcast_in_dim": lambda: tuple(params["broadcast_dimensions"])[-1:] == (
                len(shape) - 1,),
            "reshape": lambda: params.get("dimensions") is None,
            "squeeze": lambda: len(x.shape) - 1 not in params["dimensions"],
        }[name]()
        if keeps_last and shape[-1:] == x.shape[-1:]:
            return _Value(x.elements, shape, aval.dtype)
        return _Value((_hull(x.elements),), shape, aval.dtype)

    def component(self, x: Any, i: int) -> Any:
        """Entry i of x's last axis, over all its other positions."""
        if isinstance(x, Deferred):
            return self.element_of(x, i)
        values = np.asarray(x)
        return self.element_of(values[..., i] if values.ndim else values, 0)

    def _check_gather(self, table, indices, params) -> None:
        if params["mode"] != lax.GatherScatterMode.PROMISE_IN_BOUNDS or self.violation:
            return
        shape = table.shape if isinstance(table, Deferred) else np.shape(table)
        numbers = params["dimension_numbers"]
        for i, axis in enumerate(numbers.start_index_map):
            index = self.component(indices, i)
            last = shape[axis] - params["slice_sizes"][axis]
            if isinstance(index, _Int) and ((index.lo < 0 and index.lo_reached) or (
                    index.hi > last and index.hi_reached)):
                self.violation = (table, shape, axis, index, last)
                return


def _hull(elements) -> Any:
    if not all(isinstance(e, _Int) for e in elements):
        return _UNKNOWN
    return _Int(min(e.lo for e in elements), max(e.hi for e in elements), False, False, None,
                frozenset().union(*(e.uses for e in elements)))


def _converted(x, dtype, analysis: _Analysis) -> Any:
    if jnp.issubdtype(dtype, jnp.integer):
        if isinstance(x, _Bool):
            if x.value is None:
                return _Int(0, 1, False, False, None, frozenset({"?"}))
            return analysis.constant(x.value)
        limits = jnp.iinfo(dtype)
        if isinstance(x, _Int) and limits.min <= x.lo and x.hi <= limits.max:
            return x
        return _UNKNOWN  # a float, or a narrowing that wraps
    if dtype == jnp.bool_ and isinstance(x, _Int):
        return analysis.compare("ne", x, analysis.constant(0))
    return x if dtype == jnp.bool_ and isinstance(x, _Bool) else _UNKNOWN


def _logic(name, xs) -> _Bool:
    values = [x.value for x in xs]
    if name == "not":
        return _UNDECIDED if values[0] is None else _Bool(not values[0])
    absorbing = name == "or"  # True absorbs an `or`, False an `and`
    if absorbing in values:
        return _Bool(absorbing)
    return _UNDECIDED if None in values else _Bool(not absorbing)


_INT_RULES: dict[str, Callable[..., Any]] = {
    "add": _Analysis.add, "sub": lambda s, a, b: s.add(a, b, -1), "mul": _Analysis.multiply,
    "neg": _Analysis.negate, "max": _Analysis.maximum, "min": _Analysis.minimum,
    "abs": _Analysis.absolute, "div": lambda s, a, b: s.divide(a, b, math.trunc),
    "rem": _Analysis.modulo,
    "clamp": lambda s, lo, x, hi: s.minimum(s.maximum(x, lo), hi),
    **{op: (lambda op: lambda s, a, b: s.compare(op, a, b))(op)
       for op in ("lt", "le", "gt", "ge", "eq", "ne")},
}
_ELEMENTWISE = frozenset({*_INT_RULES, "select_n", "convert_element_type", "and", "or", "not"})
_STRUCTURAL = frozenset({"broadcast_in_dim", "reshape", "squeeze"})


# ------------------------------------------------------------------------------------------------
# The check
# ------------------------------------------------------------------------------------------------

def _names(fn: Any, depth: int = 3) -> dict[int, tuple[str, Any]]:
    """id(array) -> (its variable name, the function holding it) for arrays a function reads
    from closures, globals, default arguments and partial arguments (nested functions such as
    and_masks' parts included)."""
    found: dict[int, tuple[str, Any]] = {}
    if depth == 0:
        return found
    named = getattr(fn, "captured_arrays", None)  # a torch mod's translation names its own
    if named is not None:
        return {id(array): (name, None) for name, array in named}
    if dataclasses.is_dataclass(fn) and not isinstance(fn, type):  # a library mod's fields
        for field in dataclasses.fields(fn):
            _note(found, field.name, getattr(fn, field.name), fn, depth)
        return found
    if isinstance(fn, functools.partial):
        for i, value in enumerate(fn.args):
            _note(found, f"argument {i}", value, fn.func, depth)
        for key, value in fn.keywords.items():
            _note(found, key, value, fn.func, depth)
        fn = fn.func
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    if code is None:
        return found
    cells = zip(code.co_freevars, fn.__closure__ or ())
    for name, cell in cells:
        try:
            _note(found, name, cell.cell_contents, fn, depth)
        except ValueError:  # an empty cell
            continue
    namespace = getattr(fn, "__globals__", {})
    for name in code.co_names:
        if name in namespace:
            _note(found, name, namespace[name], fn, depth)
    return found


def _note(found, name, value, owner, depth) -> None:
    if isinstance(value, (jax.Array, np.ndarray)):
        found.setdefault(id(value), (name, owner))
    elif callable(value) and not isinstance(value, type):
        for key, entry in _names(value, depth - 1).items():
            found.setdefault(key, entry)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _note(found, name, item, owner, depth)


def _describe_array(table, shape, consts, names) -> str:
    dtype = table.dtype if isinstance(table, Deferred) else np.asarray(table).dtype
    typed = f"{jnp.dtype(dtype).name}{list(shape)}"
    if isinstance(table, _Array):
        name, owner = names.get(id(consts[table.index]), (None, None))
        if name is not None:
            helper = _helper_name(owner)
            return f"`{name}`{f' of {helper}' if helper else ''}, {_article(typed)} array,"
        return f"a captured {typed} array"
    return f"{_article(typed)} array the mod builds"


def _article(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def _helper_name(owner) -> str | None:
    """`jattn.masks.document_mask` for the mods jattn's library returns."""
    return getattr(owner, "mod_name", None)


def _describe_index(index: _Int) -> str:
    if index.form is None:
        return "its index"
    terms, constant = index.form
    text = ""
    for name, c in terms:
        sign = "-" if c < 0 else "+"
        magnitude = "" if abs(c) == 1 else f"{abs(c)} * "
        text += f" {sign} {magnitude}{name}" if text else f"{'-' if c < 0 else ''}{magnitude}{name}"
    if constant or not text:
        text += f" {'-' if constant < 0 else '+'} {abs(constant)}" if text else str(constant)
    return f"the index {text}"


# Keys of the (mod, call sizes) found to read in bounds: a later call skips the analysis.
_CHECKED: ProgramCache[bool] = ProgramCache("index_bounds.checked")


def check_mods(fn: str, mods: Sequence[tuple[str, Callable | None, Any]],
               sizes: dict[str, Any]) -> None:
    """`check_reads` of each (role, mod, key) in `mods` (mod None: absent); key: what the
    mod computes (a TracedFunction key, or a guards record of the call's mods), so that a call
    repeating it at the same sizes skips the analysis, or None to analyse every time."""
    for role, mod, key in mods:
        if mod is None:
            continue
        cache_key = None if key is None else (role, key, tuple(sizes.items()))
        if cache_key is not None and _CHECKED.get(cache_key):
            continue
        check_reads(fn, role, mod, sizes)
        if cache_key is not None:
            _CHECKED.put(cache_key, True)


def check_reads(fn: str, role: str, mod: Callable, sizes: dict[str, Any]) -> None:
    """Raises ValueError where `mod` (a score_mod or mask_mod of the call `fn`) reads an array
    past its ends at some position of the call. sizes: how many values each argument takes
    (b, h, q_idx, kv_idx), or the (first, last) values it takes, or None where that is not
    known (the argument's reads are then never reported)."""
    ranges = {name: (0, value - 1) if isinstance(value, int) else
              tuple(value) if isinstance(value, tuple) else
              (-_INF, _INF)  # None, or a symbolic size (jax.export): not known
              for name, value in sizes.items()}
    index = jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.int32)
    signature = [index] * 4
    if role == "score_mod":
        signature = [jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32), *signature]
    try:
        closed = jax.make_jaxpr(lambda *args: mod(*args))(*signature)  # (no cached trace)
    except Exception:  # noqa: BLE001  (a mod that fails here fails with its own error later)
        return
    analysis = _Analysis(ranges)
    jaxpr, consts = jaxpr_and_consts(closed)
    arrays = [_Array(i, tuple(var.aval.shape), var.aval.dtype)
              for i, var in enumerate(jaxpr.constvars)]
    args = [_Value((analysis.argument(name),), (1, 1, 1, 1), jnp.int32) for name in ARGUMENTS]
    if role == "score_mod":
        args = [_Value((_UNKNOWN,), (1, 1, 1, 1), jnp.float32), *args]
    # Constants made from literals are computed now, even under an outer trace.
    with jax.ensure_compile_time_eval():
        try:
            evaluate(with_consts(closed, arrays), *args, rewrite=analysis)
        except Exception:  # noqa: BLE001  (an analysis it cannot follow: no finding)
            return
    if analysis.violation is None:
        return
    table, shape, axis, index, last = analysis.violation
    what = _describe_array(table, shape, consts, _names(mod))
    where = ", ".join(f"{n} {lo}..{hi}" for n, (lo, hi) in ranges.items()
                      if math.isfinite(lo))
    bad = int(index.lo) if index.lo < 0 and index.lo_reached else int(index.hi)
    raise ValueError(
        f"{fn}: {role} {name_of(mod)} reads {what} along axis {axis} at {_describe_index(index)}"
        f", which reaches {bad} in this call ({where}); that axis holds indices 0..{last}. "
        f"JAX clamps such a read to the nearest entry: a silently wrong value wherever it is "
        f"used. Pass an array covering the call, or clamp the index yourself "
        f"(jnp.clip(index, 0, {last})); where the value is not used (a jnp.where discards "
        "it), say so with `.at[index].get(mode='clip')`.")
