"""Every public function and class has a docstring ending in an `Example::` block, and every
such example runs as written, given only the prelude its docstring assumes:

    import jax, jax.numpy as jnp, numpy as np, jattn
    import torch; import jattn.torch as jt      (the torch bridge; `interop` in a checkout)

Public: the names in `__all__` of jattn, jattn.masks, jattn.mods and the torch bridge (less
torch's own helpers and types, which the bridge re-exports: torch documents them).
"""

import importlib
import importlib.util
import inspect
import re
import textwrap

import pytest

import jattn
import jattn.masks
import jattn.mods

_HAS_TORCH = importlib.util.find_spec("torch") is not None

_EXAMPLE = re.compile(r"^Example::[ \t]*$", re.MULTILINE)


def _public_objects():
    """(id, object, needs torch) for every public object; the bridge's only where torch is."""
    entries = [(f"jattn.{name}", getattr(jattn, name), False) for name in jattn.__all__
               if not inspect.ismodule(getattr(jattn, name))]
    entries += [(f"jattn.masks.{name}", getattr(jattn.masks, name), False)
                for name in jattn.masks.__all__]
    entries += [(f"jattn.mods.{name}", getattr(jattn.mods, name), False)
                for name in jattn.mods.__all__]
    if _HAS_TORCH:
        bridge = importlib.import_module("interop")
        entries += [(f"jattn.torch.{name}", getattr(bridge, name), True)
                    for name in bridge.__all__
                    if not getattr(getattr(bridge, name), "__module__", "").startswith("torch")]
    return entries


_OBJECTS = _public_objects()


def example_of(doc: str) -> str | None:
    """The code of the docstring's `Example::` block: the indented lines after it, up to the
    first non-indented one, dedented; None without such a block."""
    match = _EXAMPLE.search(doc or "")
    if match is None:
        return None
    lines = []
    for line in doc[match.end():].splitlines()[1:]:
        if line.strip() and not line[:1].isspace():
            break
        lines.append(line)
    code = textwrap.dedent("\n".join(lines)).strip("\n")
    return code or None


def _namespace(torch_bridge: bool) -> dict:
    namespace: dict = {"__name__": "__docstring_example__"}
    exec("import jax, jax.numpy as jnp, numpy as np, jattn", namespace)
    if torch_bridge:
        exec("import torch; import interop as jt", namespace)
    return namespace


def test_the_public_objects_are_found():
    names = {name for name, _, _ in _OBJECTS}
    assert {"jattn.flex_attention", "jattn.BlockMask", "jattn.masks.causal_mask",
            "jattn.mods.alibi"} <= names
    if _HAS_TORCH:
        assert "jattn.torch.flex_attention" in names


@pytest.mark.parametrize("module", [jattn.masks, jattn.mods], ids=lambda m: m.__name__)
def test_module_docstring_lists_every_name(module):
    missing = [name for name in module.__all__
               if not re.search(rf"\b{name}\b", module.__doc__ or "")]
    assert not missing, f"{module.__name__}'s docstring does not list {missing}"


@pytest.mark.parametrize("name, obj, torch_bridge",
                         [pytest.param(*entry, id=entry[0]) for entry in _OBJECTS])
def test_docstring_example_runs(name, obj, torch_bridge):
    doc = inspect.getdoc(obj)
    assert doc, f"{name} has no docstring"
    code = example_of(doc)
    assert code, f"{name}'s docstring has no `Example::` block"
    exec(compile(code, f"<{name} example>", "exec"), _namespace(torch_bridge))


@pytest.mark.parametrize("module", [jattn.masks, jattn.mods], ids=lambda m: m.__name__)
def test_module_docstring_example_runs(module):
    code = example_of(module.__doc__)
    assert code, f"{module.__name__}'s docstring has no `Example::` block"
    exec(compile(code, f"<{module.__name__} example>", "exec"), _namespace(False))
