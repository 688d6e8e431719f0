"""`import jattn.torch` in a source checkout that is not installed (PYTHONPATH at its root).

Installed, `jattn.torch` is the repository's `interop/` folder under that name (pyproject's
package-dir). In a checkout put on the path instead, nothing maps the name, so this finder,
asked last, answers for `jattn.torch` with the `interop` package beside `jattn/` (which
registers the torch ops once, under whichever name is imported first).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import pathlib
import sys

_INTEROP = pathlib.Path(__file__).resolve().parents[2] / "interop" / "__init__.py"


class _Alias(importlib.abc.Loader):
    """Loads `jattn.torch` as the `interop` package itself."""

    def create_module(self, spec):
        return importlib.import_module("interop")

    def exec_module(self, module):
        pass  # `interop` ran on import


class _SourceCheckoutFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "jattn.torch" or not _INTEROP.exists():
            return None
        return importlib.util.spec_from_loader(fullname, _Alias())


def install() -> None:
    """Puts the finder last on sys.meta_path (once): an installed jattn.torch wins."""
    if not any(isinstance(f, _SourceCheckoutFinder) for f in sys.meta_path):
        sys.meta_path.append(_SourceCheckoutFinder())
