"""Choice of implementation: argument, environment variable, platform default, clear errors."""

import pytest

from jattn._src import platform


def test_argument_wins_over_environment(monkeypatch):
    monkeypatch.setenv("JATTN_IMPLEMENTATION", "interpret")
    assert platform.resolve_implementation("xla") == "xla"
    assert platform.resolve_implementation(None) == "interpret"


def test_platform_default(monkeypatch):
    monkeypatch.delenv("JATTN_IMPLEMENTATION", raising=False)
    expected = "pallas_triton" if platform.has_cuda() else "xla"
    assert platform.resolve_implementation(None) == expected


def test_unknown_names_raise(monkeypatch):
    with pytest.raises(ValueError, match="implementation='triton' is not an implementation"):
        platform.resolve_implementation("triton")
    monkeypatch.setenv("JATTN_IMPLEMENTATION", "cuda")
    with pytest.raises(ValueError, match="JATTN_IMPLEMENTATION='cuda' is not an implementation"):
        platform.resolve_implementation(None)


@pytest.mark.skipif(platform.has_cuda(), reason="checks the error seen without a GPU")
def test_pallas_triton_without_gpu_raises():
    with pytest.raises(ValueError, match="needs a CUDA GPU.*Use implementation='xla'"):
        platform.resolve_implementation("pallas_triton")
