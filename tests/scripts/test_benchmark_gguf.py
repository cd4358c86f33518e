"""scripts/benchmark_gguf.py in smoke mode on the real SmolLM2 file: per batch size, the engine's
row, the engine with int8 weights, and transformers' on the same dequantized weights (a tied model,
through baselines.hf_llama), with the same greedy tokens (int8: a perplexity within 5% of f32's).
Counts and ratios are checked, never timings."""
import json

from scripts import baselines, benchmark_gguf


def test_engine_and_transformers_side_by_side(smollm2_gguf, tmp_path, capsys, optimized_compiles):
    out = tmp_path / "result.json"
    benchmark_gguf.main(["--model", str(smollm2_gguf), "--batch-sizes", "1", "2", "--output-len", "6",
                         "--threads", "1", "--no-llama-cpp", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    with_hf = baselines.hf_available()
    # The engine as LLM(gguf) sizes it by default on CPU, whatever the batch.
    names = (["paged-jax (327 blocks, 16 seqs)", "paged-jax (327 blocks, 16 seqs, int8 weights)"]
             + ["HF generate (torch), static batch {}"] * with_hf)
    assert [(r["batch"], r["name"]) for r in rows] == [(b, n.format(b)) for b in (1, 2) for n in names]
    for row in rows:
        assert row["output_tok_s"] > 0, row
        if "int8" not in row["name"]:
            assert row["same_tokens"] == 1.0 and row["common_prefix"] == 6, row
    assert [r["ratio"] for r in rows if r["name"].startswith("HF")] == [1.0, 1.0] * with_hf
    # int8 weights score the fixed text about as well as the dequantized f32 ones.
    f32, int8 = (r["perplexity"] for r in rows[:2])
    assert 2 < f32 < 30 and abs(int8 / f32 - 1) < 0.05, (f32, int8)
    assert "output tok/s" in capsys.readouterr().out
