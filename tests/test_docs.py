"""Every Python block of the README and the docs runs, as written and on its own (a fresh
interpreter each)."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, match in enumerate(_BLOCK.finditer(page.read_text()), 1):
            yield pytest.param(match.group(1), id=f"{page.name}:{number}")


@pytest.mark.parametrize("code", list(_blocks()))
def test_block_runs(code):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
