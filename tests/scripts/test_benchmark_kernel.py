"""scripts/benchmark_kernel.py in smoke mode (what it runs without a GPU): every method at every
context, timings recorded, and the methods agree on the attention they time."""
import importlib.util
import json
import pathlib
import sys

SCRIPT = pathlib.Path(__file__).parents[2] / "scripts" / "benchmark_kernel.py"


def test_smoke_run_writes_agreeing_rows(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("benchmark_kernel", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "kernel.json"
    monkeypatch.setattr(sys, "argv", ["benchmark_kernel.py", "--smoke", "--out", str(out)])
    script.main()
    result = json.loads(out.read_text())
    assert result["smoke"] and result["copy_tb_s"] > 0
    methods = ["paged-jax (interpret)", "jax pallas paged_attention (interpret)",
               "dense (contiguous K/V)", "paged-jax jnp reference"]
    assert [(r["method"], r["context"]) for r in result["rows"]] == [
        (m, c) for c in (64, 128) for m in methods]
    for row in result["rows"]:
        assert row["ms"] > 0 and row["tb_s"] > 0 and row["compile_s"] > 0
        assert row["max_err_vs_first"] <= 1e-5
    assert "jax pallas paged_attention (interpret)" in capsys.readouterr().out
