"""Clear errors for the commonest mistakes in user functions (mods): a wrong parameter list, and
Python control flow on arguments that are traced arrays."""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Callable, Hashable, Iterator

import jax

from jattn._src.programs import ProgramCache

# How jattn calls each kind of mod.
SCORE_PARAMETERS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_PARAMETERS = ("b", "h", "q_idx", "kv_idx")


def name_of(fn: Callable) -> str:
    """A user function's name for messages (a library mod's `mod_name`: jattn.mods.alibi)."""
    return getattr(fn, "__name__", None) or getattr(fn, "mod_name", None) or type(fn).__name__


def check_parameters(fn: str, role: str, mod: Callable, parameters: tuple[str, ...]) -> None:
    """A clear error when `mod` cannot be called with `parameters` (a raw Python TypeError
    from deep inside the tracing otherwise). A signature that took them once is not read
    again (reading one costs ~30 us; mods are made fresh every call)."""
    key = _signature_key(mod)
    if key is not None and _ACCEPTED.get((key, parameters)):
        return
    try:
        signature = inspect.signature(mod)
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call decide
        return
    try:
        signature.bind(*parameters)
    except TypeError:
        raise TypeError(f"{fn}: `{role}` is called as {role}({', '.join(parameters)}), but "
                        f"{name_of(mod)}{signature} cannot take these {len(parameters)} "
                        "arguments; add the missing parameters (unused ones can be `*_`)."
                        ) from None
    if key is not None:
        _ACCEPTED.put((key, parameters), True)


# (signature key, parameters) of signatures that took them.
_ACCEPTED: ProgramCache[bool] = ProgramCache("mod_errors.accepted_signatures", maxsize=1024)


def _signature_key(mod: Callable) -> Hashable | None:
    """What `mod`'s signature follows from, where that is its code alone: a plain function's
    code and defaults' count, or for an object its class's `__call__`'s (library mods); None
    for anything else (partials, wrapped functions, builtins), whose signature is read."""
    if not isinstance(mod, types.FunctionType):
        call = getattr(type(mod), "__call__", None)
        if not isinstance(call, types.FunctionType) or "__signature__" in vars(type(mod)):
            return None
        return (type(mod), _signature_key(call))
    if hasattr(mod, "__wrapped__") or hasattr(mod, "__signature__"):
        return None
    return (mod.__code__, len(mod.__defaults__ or ()), tuple(mod.__kwdefaults__ or ()))


@contextlib.contextmanager
def traced_values_explained(fn: str, role: str, mod: Callable) -> Iterator[None]:
    """Turns JAX's error for Python control flow on traced arguments into one naming the fix."""
    try:
        yield
    except (jax.errors.ConcretizationTypeError, ValueError) as error:
        # bool() of a traced scalar is a ConcretizationTypeError, of a traced array a ValueError
        if isinstance(error, ValueError) and "truth value of an array" not in str(error):
            raise
        raise TypeError(
            f"{fn}: `{role}` {name_of(mod)} uses a Python `if`, `and`, `or`, `not`, bool() or "
            "int() on its arguments, which are traced arrays, not values: write "
            "jnp.where(condition, x, y) and &, |, ~ instead (torch.where in a torch mod)."
        ) from error
