"""What a torch-written mod reads, found and guarded by Dynamo, as torch.compile does.

A mod is called through a small compiled "trampoline" (`torch.compile(fullgraph=True)` with a
backend of ours), on 0-d index tensors as torch FlexAttention calls it. Dynamo traces the mod
and everything it reads (closure cells, globals, default arguments, a bound `self`, a
`functools.partial`'s arguments, an nn.Module's parameters and buffers, nested mods such as
`and_masks`), lifts the tensors it reads to graph inputs and guards on every Python value the
trace depends on. Our backend translates each graph to JAX once (`_translate.py`) and
returns a function that, on every later call, receives the tensors the mod reads *now* and
hands them to the op. So:

- a new tensor of the same shape and dtype (a fresh closure each step, a rebound global) is
  passed to the kernel as an argument: no re-translation, no recompile;
- a changed Python scalar, flag or object fails a guard: Dynamo re-traces and we translate
  again (scalars are specialised, as Dynamo specialises them; pass a 0-d tensor for a value
  that changes every step);
- in-place edits of captured tensors are seen because the kernel reads the tensor itself.

Trampolines are made per mod code object (or class, for callable objects), so each has its
own Dynamo cache and recompile limit; one whose cache is full is replaced by a fresh one (a
mod whose state changes every step, transformers' padding mask growing during generation).
A trace that makes a translation made before (a state seen again) gets that translation back,
with the ops' compiled programs for it.
Dynamo's call path costs tens of microseconds, so the guards it installed on what the mod reads
are also replayed in Python (`_FastGuard`): a call whose mod passes them skips the trampoline.
A translation with a guard of a kind the replay does not check always goes through Dynamo.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import re
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch

from jattn._src import bridge
from . import _translate

_GetItemToIndex = bridge.compat.torch_getitem_to_index()

ARITY = {"score": 5, "mask": 4}
_SIGNATURES = {"score": "(score, b, h, q_idx, kv_idx)", "mask": "(b, h, q_idx, kv_idx)"}


@dataclasses.dataclass(frozen=True, eq=False)
class Translation:
    """One translation of a mod: `mod` (a TranslatedMod) and the key the ops know it by.
    For a mod used inside a user's torch.compile, as Python that Dynamo traces there:
    fetch(mod) returns the tensors the mod reads (in `mod`'s capture order), read_state(mod)
    the other values the translation depends on (scalars, the functions and objects the mod
    reaches, types, lengths: for Dynamo to guard on, so that a changed one re-traces). Both
    None for JAX mods. guards: the kinds of the guards Dynamo installed on what the mod reads,
    read_guarded(mod) the values they guard (None where some guard is of a kind `_FastGuard`
    does not check: such a mod always goes through Dynamo)."""

    key: str
    mod: _translate.TranslatedMod
    fetch: Callable | None
    read_state: Callable | None
    guards: tuple[str, ...] | None = None
    read_guarded: Callable | None = None

    @property
    def is_torch(self) -> bool:
        return self.fetch is not None


# Every live translation by key: the ops receive keys (strings are what a torch op and a
# compiled graph can carry). Bounded: the oldest are dropped past the limit. `lookup` reads
# them as attributes of `_BY_KEY`: Dynamo reads an attribute when a trace first reaches it,
# whereas it takes a dict's contents once, so a compiled function whose first flex call
# translates a mod would not find the key its second call's translation made.
_TRANSLATIONS: OrderedDict[str, Translation] = OrderedDict()
_BY_KEY = types.SimpleNamespace()
_MAX_TRANSLATIONS = 4096
_KEYS = itertools.count()
_LOCK = threading.RLock()


def _register(mod: _translate.TranslatedMod, fetch=None, read_state=None, guards=None,
              read_guarded=None) -> Translation:
    return _live(Translation(f"m{next(_KEYS)}", mod, fetch, read_state, guards, read_guarded))


def _live(translation: Translation) -> Translation:
    """`translation`, registered (again, if the bounded registry dropped a cached translation
    that is in use again)."""
    if translation.key not in _TRANSLATIONS:
        with _LOCK:
            _TRANSLATIONS[translation.key] = translation
            setattr(_BY_KEY, translation.key, translation)
            while len(_TRANSLATIONS) > _MAX_TRANSLATIONS:
                delattr(_BY_KEY, _TRANSLATIONS.popitem(last=False)[0])
    return translation


def lookup(key: str) -> Translation:
    translation = getattr(_BY_KEY, key, None)
    if translation is None:
        raise RuntimeError(f"jattn: mod translation {key!r} was evicted from the bounded "
                           "cache; call the op again eagerly (or recompile) to re-translate.")
    return translation


# ------------------------------------------------------------------------------------------------
# Example arguments: 0-d, as torch FlexAttention calls a mod
# ------------------------------------------------------------------------------------------------

def _example_args(role: str) -> tuple[torch.Tensor, ...]:
    index = [torch.zeros((), dtype=torch.int32) for _ in range(4)]
    if role == "mask":
        return tuple(index)
    return (torch.zeros((), dtype=torch.float64 if role == "score64" else torch.float32), *index)


# A mod's role: its kind, and for score_mods the score's dtype, float32 (torch's for every
# input dtype but float64) or float64 ("score64": `x.to(score.dtype)` is float64 there).
ROLES = ("score", "score64", "mask")
_EXAMPLES = {role: _example_args(role) for role in ROLES}


def _mod_name(mod) -> str:
    name = getattr(mod, "__qualname__", None) or getattr(mod, "__name__", None)
    if name is None and isinstance(mod, functools.partial):
        return f"partial({_mod_name(mod.func)})"
    return name or type(mod).__name__


# ------------------------------------------------------------------------------------------------
# The trampolines and their backend
# ------------------------------------------------------------------------------------------------

_SLOT = threading.local()  # the last trampoline call's (translation, tensors), per thread


def _trampoline_body(mod, *args):
    with _GetItemToIndex():  # tensor indices -> aten.index, as torch traces mods
        out = mod(*args)
    # A mod returning an argument (transformers' score_mod without softcap or bias) makes a
    # graph all the same, so that what it read (`softcap is None`) is guarded.
    return out.clone() if any(out is arg for arg in args) else out


def _arg_index(source) -> int | None:
    """i for the source `L['args'][i]` (a mod argument), else None (a captured tensor)."""
    base = getattr(source, "base", None)
    if (type(source).__name__ == "GetItemSource" and base is not None
            and getattr(base, "local_name", None) == "args"):
        return source.index
    return None


# A global of the trampoline: `G['name']` where a source starts (not the item `G['scale']` of
# `G['__import___main__'].CONFIG['scale']`).
_GLOBAL = re.compile(r"(?<![\w\])])G\['([^']+)'\]")


def _reader(source_names: list[str], namespace: dict) -> Callable:
    """read(mod) -> the values at these Dynamo sources (rooted at L['mod'] and the
    trampoline's globals G), as plain attribute and item access that Dynamo can trace."""
    bound = {}

    def global_ref(match):
        name = f"_g{len(bound)}"
        bound[name] = namespace[match.group(1)]
        return name

    items = [_GLOBAL.sub(global_ref, name).replace("L['mod']", "mod") for name in source_names]
    source = f"lambda {', '.join([*bound, ''])}: lambda mod: ({''.join(i + ', ' for i in items)})"
    return eval(source, {})(**bound)  # noqa: S307  (Dynamo's own source expressions)


# Guards on torch's internals, the trampoline's arguments and global state are not about what a
# mod reads.
_INTERNAL = re.compile(r"__import__\('torch'\)|G\['__import_torch(_dot_|')|G\['__builtins|"
                       r"L\['args'\]|G\['_GetItemToIndex'\]")
# Guards on whether a key or attribute is present (`"shift" in cfg`, `hasattr(self, "bias")`):
# the keyword of the guard's argument and the test, as the guard's source.
_MEMBERSHIP = {
    "DICT_CONTAINS": ("key", "({arg!r} in {name})"),
    "DICT_NOT_CONTAINS": ("key", "({arg!r} in {name})"),
    "HASATTR": ("attr", "hasattr({name}, {arg!r})"),
    "NOT_PRESENT_IN_GENERIC_DICT": ("attr", "({arg!r} in {name}.__dict__)"),
}


# What a translation depends on besides the tensors it reads, as expressions of a guard's
# source whose values are constants for Dynamo to guard on in a user's trace: a scalar's value,
# a function's code (a closure cell holding another mod: `fn` in transformers'
# add_offsets_to_mask_function), an object's identity, a type, a length.
_STATE_OF_GUARD = {
    "CONSTANT_MATCH": "{}", "EQUALS_MATCH": "{}", "CLOSURE_MATCH": "{}",
    "FUNCTION_MATCH": "{}", "ID_MATCH": "{}", "BUILTIN_MATCH": "{}", "MODULE_MATCH": "{}",
    "CLASS_MATCH": "{}", "TYPE_MATCH": "type({})", "SEQUENCE_LENGTH": "len({})",
    "LENGTH_CHECK": "len({})", "DICT_KEYS_MATCH": "tuple({}.keys())",
    "DICT_KEYS": "tuple({}.keys())", **dict.fromkeys(_MEMBERSHIP, "{}")}


def _state_sources(guards: list[tuple[str, str]]) -> list[str]:
    """The expressions of `_STATE_OF_GUARD` for a trace's guards (tensors are fetched)."""
    return [_STATE_OF_GUARD[kind].format(source) for kind, source in guards
            if kind in _STATE_OF_GUARD]


def _user_guards() -> list[tuple[str, str]]:
    """(kind, source) of each guard the trace being compiled installs on what the mod reads.
    A DUPLICATE_INPUT guard (one object reached through two sources: transformers' mask
    reaches `torch` through its module and ours) has `(a) is (b)` as its source."""
    context = bridge.compat.torch_tracing_context()
    found = set()
    for guard in getattr(getattr(context, "guards_context", None), "dynamo_guards", ()):
        kind, name = guard.create_fn_name(), guard.name
        keywords = getattr(guard.create_fn, "keywords", {})  # (the guard's partial)
        keyword, test = _MEMBERSHIP.get(kind, (None, None))
        argument = keywords.get(keyword)
        if isinstance(argument, (str, int)) and name:
            name = test.format(name=name, arg=argument)
        if kind == "DUPLICATE_INPUT":
            other = keywords.get("source_b")
            if other is not None:
                other = other.name if isinstance(other.name, str) else other.name()
                name = None if _INTERNAL.search(other) else f"({name}) is ({other})"
        if name and not _INTERNAL.search(name):
            found.add((kind, name))
    return sorted(found)


def _readable(source: str, freevars: tuple[str, ...]) -> str:
    """A Dynamo source (`L['mod'].__closure__[0].cell_contents`, `G['bias']`) as the name the
    mod's code uses (`bias`), for errors."""
    def cell(match):
        i = int(match.group(1))
        return freevars[i] if i < len(freevars) else match.group(0)

    source = re.sub(r"L\['mod'\]\.__closure__\[(\d+)\]\.cell_contents", cell, source)
    source = _GLOBAL.sub(r"\1", source).replace("L['mod'].__self__", "self")
    source = re.sub(r"\._(?:parameters|buffers|modules)\['([^']+)'\]", r".\1", source)
    source = re.sub(r"^__import_\w+?\.", "", source)  # a global read through its module
    return source.replace("L['mod']", "mod")


def _content(kind: str, name: str, core: torch.fx.GraphModule, example_inputs,
             arg_slots: list, guards: list) -> tuple:
    """What a translation is made of: its graph's code and constants, the shapes and dtypes
    of what it reads, the guards on what it depends on. A trace that makes the same content
    again (a shape seen before, after Dynamo's cache for the mod was full) gets the same
    translation, so the ops' compiled programs for it are found again."""
    constants = tuple(_translate.constant_array(getattr(core, n.target)).tobytes()
                      for n in core.graph.nodes if n.op == "get_attr")
    specs = tuple((tuple(x.shape), x.dtype) for x in example_inputs)
    return kind, name, core.code, constants, specs, tuple(arg_slots), tuple(guards)


# Translations by content, the most recent kept (bounded as _TRANSLATIONS is).
_BY_CONTENT: OrderedDict[tuple, Translation] = OrderedDict()


def _backend(kind: str, name: str, namespace: dict, freevars: tuple[str, ...],
             trampoline_compiles: list[int]):
    def compile_graph(graph_module: torch.fx.GraphModule, example_inputs):
        placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
        arg_slots: list[int | None] = [None] * ARITY[kind]
        capture_slots, sources = [], []
        for slot, node in enumerate(placeholders):
            source = node.meta["grapharg"].source
            arg = _arg_index(source)
            if arg is None:
                capture_slots.append(slot)
                sources.append(source.name if isinstance(source.name, str) else source.name())
            else:
                arg_slots[arg] = slot
        output = next(n for n in graph_module.graph.nodes if n.op == "output")
        if len(output.args[0]) != 1:
            raise TypeError(f"{kind}_mod {name} must return one tensor.")
        result = output.args[0][0]
        shape = getattr(result.meta.get("example_value"), "shape", ()) if isinstance(
            result, torch.fx.Node) else ()
        if tuple(shape) != ():
            raise TypeError(
                f"{kind}_mod {name} must return a 0-d tensor, one value for each (b, h, "
                f"q_idx, kv_idx) it is called with (torch calls a mod on 0-d tensors), but it "
                f"returns shape {list(shape)}; return a single value (torch.where, not "
                "torch.stack, to choose between values).")
        core = _translate.lower_to_core_aten(graph_module, example_inputs)
        missing = _translate.untranslatable_ops(core)
        if missing:
            raise NotImplementedError(
                f"{kind}_mod {name} uses {', '.join(missing)}, which jattn cannot translate "
                "to JAX. Mods may use arithmetic, comparisons, logic and bit ops, torch.where, "
                "elementwise math and activations, indexing of captured tensors, reductions "
                "over captured tensors and new_*/*_like constructors.")
        for slot in capture_slots:
            _translate.jax_dtype(example_inputs[slot].dtype)  # raises for one jattn lacks
        guards = _user_guards()
        content = _content(kind, name, core, example_inputs, arg_slots, guards)
        translation = _BY_CONTENT.get(content)
        if translation is None:
            checkable = all(guard in _GUARD_CHECKS for guard, _ in guards)
            capture_names = tuple(_readable(source, freevars) for source in sources)
            translation = _register(
                _translate.translate(core, arg_slots, capture_slots, name, capture_names),
                _reader(sources, namespace),
                _reader(_state_sources(guards), namespace),
                tuple(guard for guard, _ in guards) if checkable else None,
                _reader([source for _, source in guards], namespace) if checkable else None)
            with _LOCK:
                _BY_CONTENT[content] = translation
                while len(_BY_CONTENT) > _MAX_TRANSLATIONS:
                    _BY_CONTENT.popitem(last=False)
        translation = _live(translation)
        trampoline_compiles[0] += 1

        def run(*inputs):
            _SLOT.value = translation, tuple(inputs[slot] for slot in capture_slots)
            return [None]
        return run
    return compile_graph


class _Trampoline:
    """A compiled trampoline for one mod code object: its own Dynamo cache."""

    def __init__(self, kind: str, mod):
        body = _trampoline_body.__code__.replace(co_name=f"jattn_{kind}_mod")
        function = types.FunctionType(body, _trampoline_body.__globals__, body.co_name)
        identity = _code_identity(mod)
        freevars = identity.co_freevars if isinstance(identity, types.CodeType) else ()
        self.compiles = [0]  # traces so far (Dynamo's cache entries)
        backend = _backend(kind, _mod_name(mod), function.__globals__, freevars,
                           self.compiles)
        self.compiled = torch.compile(function, backend=backend, fullgraph=True, dynamic=False)

    @property
    def full(self) -> bool:
        """Whether Dynamo's cache for it holds its recompile limit: a call that misses it
        would print Dynamo's warning (naming this trampoline, not the user's mod) and fail."""
        return self.compiles[0] >= torch._dynamo.config.recompile_limit


def _code_identity(mod):
    """What shares a trampoline: a function's code, a bound method's or partial's underlying
    code, a callable object's class."""
    while True:
        if isinstance(mod, functools.partial):
            mod = mod.func
        elif isinstance(mod, types.MethodType):
            mod = mod.__func__
        elif isinstance(mod, types.FunctionType):
            return mod.__code__
        else:
            return type(mod)


# Per role: a function used in two roles gets two translations, and the wrong role's call its
# own clear error.
_TRAMPOLINES = {role: weakref.WeakKeyDictionary() for role in ROLES}
_JAX_MODS = {role: weakref.WeakKeyDictionary() for role in ROLES}  # code -> True


def _is_recompile_limit(error: BaseException) -> bool:
    names = {type(e).__name__ for e in _chain(error)}
    return any("RecompileLimit" in n or "CacheLimit" in n for n in names)


def _chain(error: BaseException):
    seen = []
    while error is not None and error not in seen:
        seen.append(error)
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return seen


# ------------------------------------------------------------------------------------------------
# Dynamo's guards, replayed in Python
# ------------------------------------------------------------------------------------------------

def _same_constant(value, expected) -> bool:
    return type(value) is type(expected) and (value == expected or (
        value != value and expected != expected))  # NaN


def _tensor_signature(value):
    if not isinstance(value, torch.Tensor):
        return None
    return value.shape, value.dtype, value.device


def _identity_of(value):
    """What an identity guard compares: a weak reference where the object takes one (the
    guard must not keep a mod's objects alive), else the object (builtins, immortal)."""
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda value=value: value


def _code_or_identity(value):
    return value.__code__ if isinstance(value, types.FunctionType) else _identity_of(value)


def _is_same_code(value, expected) -> bool:
    if isinstance(value, types.FunctionType):
        return value.__code__ is expected
    return not isinstance(expected, types.CodeType) and value is expected()


# guard kind -> (what to record of the guarded value, whether a value matches the record):
# the guards Dynamo installs on the values a mod reads, as Dynamo checks them.
_GUARD_CHECKS = {
    "CONSTANT_MATCH": (lambda v: v, _same_constant),
    "EQUALS_MATCH": (lambda v: v, _same_constant),
    "TYPE_MATCH": (type, lambda v, e: type(v) is e),
    "SEQUENCE_LENGTH": (len, lambda v, e: len(v) == e),
    "LENGTH_CHECK": (len, lambda v, e: len(v) == e),
    "DICT_KEYS_MATCH": (lambda v: list(v.keys()), lambda v, e: list(v.keys()) == e),
    "DICT_KEYS": (lambda v: list(v.keys()), lambda v, e: list(v.keys()) == e),
    "TENSOR_MATCH": (_tensor_signature, lambda v, e: _tensor_signature(v) == e),
    "CLOSURE_MATCH": (_code_or_identity, _is_same_code),
    "FUNCTION_MATCH": (_code_or_identity, _is_same_code),
    "ID_MATCH": (_identity_of, lambda v, e: v is e()),
    "BUILTIN_MATCH": (_identity_of, lambda v, e: v is e()),
    "MODULE_MATCH": (_identity_of, lambda v, e: v is e()),
    "CLASS_MATCH": (_identity_of, lambda v, e: v is e()),
    "DUPLICATE_INPUT": (lambda v: v, lambda v, e: v is e),  # `(a) is (b)`: True
    **dict.fromkeys(_MEMBERSHIP, (lambda v: v, _same_constant)),  # `"k" in d`: a bool
}


class _FastGuard:
    """One translation's Dynamo guards on the values its mod reads, checked in Python (a few
    microseconds against Dynamo's call path): a mod that passes them is one Dynamo would pass
    to the same translation, and fetch(mod) gives the tensors Dynamo would hand over."""

    def __init__(self, translation: Translation, mod, tensors):
        values = translation.read_guarded(mod)
        self.checks = [_GUARD_CHECKS[kind][1] for kind in translation.guards]
        self.expected = [_GUARD_CHECKS[kind][0](v) for kind, v in zip(translation.guards, values)]
        self.translation = translation
        if not all(check(v, e) for check, v, e in zip(self.checks, values, self.expected)) or (
                len(fetched := translation.fetch(mod)) != len(tensors)
                or any(a is not b for a, b in zip(fetched, tensors))):
            raise ValueError("the replayed guards do not reproduce Dynamo's capture")

    def __call__(self, mod):
        """The tensors mod reads now if every guard passes, else None."""
        try:
            values = self.translation.read_guarded(mod)
        except Exception:  # noqa: BLE001  (a value gone or changed type: a guard fails)
            return None
        for check, value, expected in zip(self.checks, values, self.expected):
            if not check(value, expected):
                return None
        return self.translation.fetch(mod)


_FAST_GUARDS = {role: weakref.WeakKeyDictionary() for role in ROLES}  # identity -> list
_MAX_FAST_GUARDS = 64  # per code object: the translations of its latest states


def _remember(role: str, identity, mod, translation: Translation, tensors) -> None:
    if translation.guards is None:
        return
    try:
        guard = _FastGuard(translation, mod, tensors)
    except Exception:  # noqa: BLE001  (a source we cannot read: Dynamo checks this one)
        return
    with _LOCK:
        guards = [g for g in _FAST_GUARDS[role].get(identity, ())
                  if g.translation is not translation]
        _FAST_GUARDS[role][identity] = [guard, *guards][:_MAX_FAST_GUARDS]


# ------------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------------

def capture(mod, kind: str, float64: bool = False
            ) -> tuple[Translation, tuple[torch.Tensor, ...]]:
    """The mod's translation and the tensors it reads now (its captured tensors, in the
    translation's order). Raises a clear error for a mod that cannot be translated.
    float64: a score_mod of a float64 call (traced on a float64 score, as torch calls it)."""
    role = "score64" if float64 and kind == "score" else kind
    translation, tensors = _capture(mod, kind, role)
    return _live(translation), tensors


def _capture(mod, kind: str, role: str) -> tuple[Translation, tuple[torch.Tensor, ...]]:
    if not callable(mod):
        raise TypeError(f"{kind}_mod must be callable {_SIGNATURES[kind]}, got "
                        f"{type(mod).__name__}.")
    identity = _code_identity(mod)
    for guard in _FAST_GUARDS[role].get(identity, ()):
        tensors = guard(mod)
        if tensors is not None:
            return guard.translation, tensors
    if _JAX_MODS[role].get(identity):
        return _jax_translation(mod), ()
    with _LOCK:
        trampoline = _TRAMPOLINES[role].get(identity)
        if trampoline is None or trampoline.full:
            trampoline = _TRAMPOLINES[role][identity] = _Trampoline(kind, mod)
    result = _call(trampoline, mod, kind, role, identity)
    if result is None:
        return _jax_translation(mod), ()
    translation, tensors = result
    _remember(role, identity, mod, translation, tensors)
    return translation, tensors


def _call(trampoline: _Trampoline, mod, kind: str, role: str, identity,
          retried: bool = False):
    """(translation, tensors) from one trampoline call; None for a JAX mod. A trampoline past
    Dynamo's recompile limit is replaced once (a mod that fails on the fresh one too gets its
    own error)."""
    _SLOT.value = None
    try:
        out = trampoline.compiled(mod, *_EXAMPLES[role])
    except Exception as error:  # noqa: BLE001  (Dynamo's errors: sorted out below)
        if _is_recompile_limit(error) and not retried:
            with _LOCK:
                fresh = _TRAMPOLINES[role][identity] = _Trampoline(kind, mod)
            return _call(fresh, mod, kind, role, identity, retried=True)
        if _is_jax_mod(mod, kind):
            _JAX_MODS[role][identity] = True
            return None
        raise _mod_error(mod, kind, error) from None
    result, _SLOT.value = getattr(_SLOT, "value", None), None  # holds no tensor past the call
    if result is not None:
        return result
    raise TypeError(f"{kind}_mod {_mod_name(mod)} returned {type(out).__name__} without "
                    "computing on its arguments; it must return a tensor computed from them.")


def _mod_error(mod, kind: str, error: BaseException) -> Exception:
    """Our own errors raised while translating, unwrapped; Dynamo's turned into a message that
    names the mod and the fix."""
    for inner in _chain(error):
        if isinstance(inner, (NotImplementedError, TypeError)) and str(inner).startswith(
                f"{kind}_mod "):
            return type(inner)(str(inner))
    name = _mod_name(mod)
    try:
        inspect.signature(mod).bind(*_EXAMPLES[kind])
    except TypeError:
        return TypeError(f"{kind}_mod {name} must take {ARITY[kind]} arguments "
                         f"{_SIGNATURES[kind]}; its signature is {_signature(mod)}.")
    except ValueError:
        pass
    text = " ".join(str(e) for e in _chain(error))
    if re.search(r"data.dependent|generic_jump|Data-dependent|__bool__", text):
        return ValueError(
            f"{kind}_mod {name} branches in Python on a tensor value (an `if`, `and`, `or` or "
            "`not` on the score or the indices); that cannot be traced. Use torch.where(cond, "
            "a, b) for values and &, |, ~ for masks.")
    cause = _chain(error)[-1]  # the innermost: what went wrong in the mod itself
    lines = str(cause).strip().splitlines()
    return TypeError(f"{kind}_mod {name} could not be traced on 0-d torch tensors (as torch "
                     f"calls a mod): {type(cause).__name__}: {lines[0] if lines else ''}")


def _signature(mod) -> str:
    try:
        return str(inspect.signature(mod))
    except (TypeError, ValueError):
        return "unknown"


def _is_jax_mod(mod, kind: str) -> bool:
    """Whether `mod` is a JAX function (such as `jattn.mods.softcap(20.0)`): it runs on JAX
    arrays and returns one."""
    shapes = [jax.ShapeDtypeStruct((2, 2), jnp.float32)] if kind == "score" else []
    shapes += [jax.ShapeDtypeStruct((), jnp.int32)] * 2 + [
        jax.ShapeDtypeStruct((2, 1), jnp.int32), jax.ShapeDtypeStruct((1, 2), jnp.int32)]
    try:
        out = jax.eval_shape(mod, *shapes)
    except Exception:  # noqa: BLE001  (anything failing on JAX arrays is not a JAX mod)
        return False
    return isinstance(out, jax.ShapeDtypeStruct)


def _clear() -> None:
    """Forgets every translation, trampoline and replayed guard (jattn.clear_caches)."""
    with _LOCK:
        for cache in (_TRANSLATIONS, _BY_KEY.__dict__, _BY_CONTENT, _JAX_TRANSLATIONS,
                      *_TRAMPOLINES.values(), *_JAX_MODS.values(), *_FAST_GUARDS.values()):
            cache.clear()


_JAX_TRANSLATIONS: OrderedDict[int, tuple] = OrderedDict()  # id(mod) -> (mod, translation)
_MAX_JAX_MODS = 256


def _jax_translation(mod) -> Translation:
    """A JAX mod as a translation without captures (arrays it closes over stay JAX
    constants), one per mod object (the most recent ones kept)."""
    with _LOCK:
        known = _JAX_TRANSLATIONS.get(id(mod))
        if known is not None and known[0] is mod:
            _JAX_TRANSLATIONS.move_to_end(id(mod))
            return known[1]
        translation = _register(_translate.TranslatedMod(lambda captures, *args: mod(*args), 0,
                                                          _mod_name(mod)))
        _JAX_TRANSLATIONS[id(mod)] = mod, translation
        while len(_JAX_TRANSLATIONS) > _MAX_JAX_MODS:
            _JAX_TRANSLATIONS.popitem(last=False)
        return translation


bridge.register_cache("torch.translations", _clear)
