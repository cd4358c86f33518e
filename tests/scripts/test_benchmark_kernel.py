"""scripts/benchmark_kernel.py in smoke mode (what it runs without a GPU): every method at every
context, timings recorded, and the methods agree on the attention they time. jax's own kernel is
compared where this jax ships it (0.12 deprecates it, 0.12.1 removed it), and the benchmark says
which. The Mosaic GPU kernel runs in its interpreter where this jax has it (0.12), on bf16 inputs."""
import importlib.util
import json
import pathlib
import sys
import warnings

import jax
import pytest

from pallas_kernels import mosaic
from scripts import jax_paged_kernel

SCRIPT = pathlib.Path(__file__).parents[2] / "scripts" / "benchmark_kernel.py"


@pytest.mark.triton
def test_smoke_run_writes_agreeing_rows(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("benchmark_kernel", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "kernel.json"
    monkeypatch.setattr(sys, "argv", ["benchmark_kernel.py", "--smoke", "--out", str(out)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the script hears jax's, none leaks
        assert script.main() == 0  # no method failed
    result = json.loads(out.read_text())
    assert result["smoke"] and result["copy_tb_s"] > 0
    assert result["tiles"] == dict(block_n=64, num_warps=8, num_stages=2)  # f32, hd64: DECODE_TILES
    shipped = importlib.util.find_spec(jax_paged_kernel.MODULE) is not None
    if not shipped:  # jax 0.12.1 removed it
        assert result["jax_kernel"] == (f"gone from jax {jax.__version__} (No module named "
                                        f"'{jax_paged_kernel.MODULE}')")
    elif jax.__version_info__ >= (0, 12):
        assert result["jax_kernel"] == (f"deprecated in jax {jax.__version__}: jax.experimental."
                                        "pallas.ops.gpu.paged_attention is deprecated.")
    else:
        assert result["jax_kernel"] == f"in jax {jax.__version__}"
    mosaic_rows = ["paged-jax mosaic gpu (interpret)"] if mosaic.AVAILABLE else []
    jax_rows = ["jax pallas paged_attention (interpret)"] if shipped else []
    assert result["mosaic"] == ("runs" if mosaic.AVAILABLE else mosaic.UNAVAILABLE)
    methods = ["paged-jax (interpret)", *mosaic_rows, *jax_rows, "dense (contiguous K/V)", "paged-jax jnp reference"]
    assert [(r["method"], r["context"]) for r in result["rows"]] == [
        (m, c) for c in (64, 128) for m in methods]
    for row in result["rows"]:
        assert row["ms"] > 0 and row["tb_s"] > 0 and row["compile_s"] > 0
        bf16 = row["method"] in mosaic_rows  # against the f32 kernel: bf16 rounding
        assert row["max_err_vs_first"] <= (3e-2 if bf16 else 1e-5)
    printed = capsys.readouterr().out
    assert ("x our triton" in printed) == mosaic.AVAILABLE
    assert ("jax pallas paged_attention (interpret)" in printed) == shipped
    assert f"jax's own paged_attention: {result['jax_kernel']}" in printed
