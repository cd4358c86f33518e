"""Where the persistent compilation cache goes (its use by a second start: tests/scripts/test_generate.py)."""
from pathlib import Path

from paged_jax.compilation_cache import default_cache_dir


def test_cache_dir_from_the_environment_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("PAGED_JAX_CACHE_DIR", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "paged-jax" / "jax"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty means unset (the XDG base-directory spec)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "paged-jax" / "jax"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "paged-jax" / "jax"
    assert default_cache_dir("models") == tmp_path / "xdg" / "paged-jax" / "models"
    monkeypatch.setenv("PAGED_JAX_CACHE_DIR", "~/mine")
    assert default_cache_dir() == Path(tmp_path / "home" / "mine")
    assert default_cache_dir("models") == Path(tmp_path / "home" / "mine" / "models")
