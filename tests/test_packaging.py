"""The built wheel: jattn and its torch bridge as `jattn.torch`, no other top-level name."""

import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--quiet",
                    "-w", str(out)], check=True, timeout=600)
    (built,) = out.glob("jattn-*.whl")
    return built


def test_the_wheel_holds_jattn_and_the_bridge_under_its_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"jattn"}
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "jattn").rglob("*.py")}
    bridge = {"jattn/torch/" + p.relative_to(ROOT / "interop").as_posix()
              for p in (ROOT / "interop").rglob("*.py")}
    assert sources | bridge <= set(names)


def test_the_installed_bridge_imports_as_jattn_torch(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    code = ("import jattn.torch as jt, torch; "
            "print(jt.__file__); print(jt.matmul(torch.ones(2, 3), torch.ones(3, 4)).sum().item())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site"),
                                               "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    file, total = result.stdout.split()
    assert file.startswith(str(tmp_path / "site")) and float(total) == 24.0


def test_both_names_of_a_source_checkout_share_one_bridge():
    code = ("import sys; import interop.torch, jattn.torch as jt; "
            "print(jt is sys.modules['interop'], "
            "sys.modules['jattn.torch._ops'] is sys.modules['interop._ops'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "True"]
