"""Mods as constants that torch.compile can hand to a function it runs at trace time.

Inside a compiled region the ops' key is found by `_ops._key_while_tracing`, which Dynamo runs
at trace time on Python constants. A mod defined outside the region is one; so are its bound
method's or partial's parts (`parts`). A function that closes over tensors is not when it is
made inside the region (transformers builds its score_mod and mask_mod over a padding mask,
a head mask and a softcap in the model's forward): its tensors are values of the trace.
Such a function travels as a description, its code and the values it closes over, each tensor
as its shape, dtype, device and requires_grad; at trace time `rebuild` makes the function
again, over stand-in tensors of those specs, which translates as the mod does (a translation
depends on what its tensors are, never on their values). The tensors themselves reach the op
through the translation's `fetch`, read from the mod in the trace: graph values, not
constants.
"""

from __future__ import annotations

import functools
import sys
import types

import torch

from jattn._src import bridge

# Dynamo reads the closure of a function made inside the region only with this (installed at
# import); where it cannot be installed, such a mod with tensors fails to trace.
_CLOSURES_READABLE = bridge.compat.torch_read_closures_while_tracing()
_guard_scalar = bridge.compat.torch_guard_scalar()


def parts(mod) -> tuple:
    """A mod as parts Dynamo can hand to a trace-time function (it converts functions, objects
    and tensors, not bound methods or partials): ("method", function, self),
    ("partial", function, n_args, *args, *keyword names, *keyword values) or ("plain", mod),
    as (kind, their descriptions, *the leaves the descriptions name): see below."""
    if isinstance(mod, types.MethodType):
        kind, items = "method", (mod.__func__, mod.__self__)
    elif isinstance(mod, functools.partial):
        names = tuple(mod.keywords)
        kind, items = "partial", (mod.func, len(mod.args), *mod.args, *names,
                                  *(mod.keywords[n] for n in names))
    else:
        kind, items = "plain", (mod,)
    leaves = []
    layout = tuple(_describe(item, leaves) for item in items)
    return (kind, layout, *leaves)


def rebuild(mod_parts: tuple):
    """The mod of `parts`, its described functions made again over stand-in tensors."""
    kind, layout, *leaves = mod_parts
    fn, *rest = (_value(description, leaves) for description in layout)
    if kind == "method":
        return types.MethodType(fn, rest[0])
    if kind == "partial":
        n_args, rest = rest[0], rest[1:]
        args, keywords = rest[:n_args], rest[n_args:]
        half = len(keywords) // 2
        return functools.partial(fn, *args, **dict(zip(keywords[:half], keywords[half:])))
    return fn


# ------------------------------------------------------------------------------------------------
# Functions that close over tensors, described by constants
# ------------------------------------------------------------------------------------------------
# A description is a tuple tagged by its first item: ("leaf", i) for a value that holds no
# tensor, ("tensor", shape, dtype, device, requires_grad), ("tuple" | "list", descriptions)
# and ("function", code, module name, name, defaults, cell descriptions) for a function made in
# the trace that holds a tensor. Leaves travel as arguments of their own: Dynamo converts an
# object (a module a mod closes over) to a constant only there, not inside a tuple.


def _described(value) -> bool:
    """Whether value travels as a description, not a leaf: a tensor, or a tuple, list or
    function made in the trace holding one (in its closure, at any depth: `and_masks` closes
    over the mods it combines), or such a function closing over a number (a float argument
    of the compiled function is symbolic from its second value on). A function made outside
    the region is a constant whatever it holds."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_described(v) for v in value)
    if made_in_trace(value):  # (a number in its cells may be symbolic: no constant either)
        return any(_described(cell.cell_contents) or isinstance(
            cell.cell_contents, (int, float)) for cell in value.__closure__ or ())
    return False


def made_in_trace(value) -> bool:
    """Whether value is a function made in the trace (no constant: its code and cells are
    described by `parts` instead)."""
    return (isinstance(value, types.FunctionType) and _CLOSURES_READABLE
            and bridge.compat.torch_made_while_tracing(value))


def _describe(value, leaves: list) -> tuple:
    """The description of value (tagged tuples, as above), its leaves appended to `leaves`; a
    tensor's shape and a scalar are specialised where the trace has them symbolic (a float
    argument of the compiled function), Dynamo then guarding on their values."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(specialised(n) for n in value.shape), value.dtype,
                value.device, value.requires_grad)
    if not _described(value):
        leaves.append(specialised(value))
        return ("leaf", len(leaves) - 1)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_describe(v, leaves) for v in value))
    return ("function", value.__code__, value.__module__, value.__name__,
            _describe(value.__defaults__, leaves),
            tuple(_describe(cell.cell_contents, leaves) for cell in value.__closure__))


def specialised(value):
    """value, a symbolic scalar of the trace as its value (Dynamo guarding on it)."""
    return _guard_scalar(value) if isinstance(value, (int, float)) else value


def _value(description: tuple, leaves: list):
    """The value a description stands for."""
    kind, *rest = description
    if kind == "leaf":
        return leaves[rest[0]]
    if kind == "tensor":
        shape, dtype, device, requires_grad = rest
        return torch.zeros(shape, dtype=dtype, device=device, requires_grad=requires_grad)
    if kind in ("tuple", "list"):
        return {"tuple": tuple, "list": list}[kind](_value(d, leaves) for d in rest[0])
    code, module, name, defaults, cells = rest
    return types.FunctionType(code, _module_globals(module, name), name,
                              _value(defaults, leaves),
                              tuple(types.CellType(_value(d, leaves)) for d in cells))


def _module_globals(module: str, name: str) -> dict:
    """The globals of a function made in module `module` (its `__module__`: Dynamo reads the
    module of a function it made, not its globals)."""
    found = sys.modules.get(module)
    if found is None:
        raise TypeError(f"mod {name} closes over tensors and was made inside torch.compile in "
                        f"module {module!r}, which is not imported as such; define it in an "
                        "imported module or outside the compiled function.")
    return vars(found)
