"""The benchmark scripts and the pool picture in smoke mode (a 0.5M-parameter model, a few requests),
called in one process so that runs with the same engine shapes share compiled programs. The numbers
checked are counts and ratios of counts (sequences, tokens, slots), never timings."""
import json
import struct

import numpy as np
import pytest

from models.llama import preset
from scripts import baselines, benchlib, benchmark_latency, benchmark_throughput, plot_block_pool

TINY = ["--hidden-size", "128", "--num-layers", "2", "--vocab-size", "256"]
SMALL = TINY + ["--input-len", "12", "--output-len", "12", "--max-model-len", "128", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "16", "--torch-threads", "1"]


def throughput(tmp_path, *args):
    out = tmp_path / "result.json"
    benchmark_throughput.main([*SMALL, *args, "--json", str(out)])
    return json.loads(out.read_text())


def test_engines_agree_token_for_token_and_report_throughput(tmp_path, capsys):
    result = throughput(tmp_path, "--num-requests", "6")
    names = ["paged-jax (block_size 16)", "contiguous (block_size 128)", "jax dense KV, static batch 4"]
    names += ["HF generate (torch), static batch 4"] if baselines.hf_available() else []
    assert [r["name"] for r in result["rows"]] == names
    assert result["num_requests"] == 6 and 4 <= result["mean_input_len"] <= 63
    for row in result["rows"]:
        # Greedy decoding on the same weights through both engine layouts, the dense-cache loop and
        # Hugging Face's own Llama: the same tokens, so every row did the same work.
        assert row["same_tokens"] == 1.0, row["name"]
        assert 0 < row["output_tok_s"] < row["total_tok_s"] and row["requests_s"] > 0 and row["compile_s"] >= 0
    assert result["rows"][-1]["ratio"] == 1.0
    assert "output tok/s" in capsys.readouterr().out


def test_same_memory_paged_runs_more_sequences_than_contiguous(tmp_path):
    """128 KV slots: one contiguous 128-token reservation, or 8 blocks of 16 shared out on demand."""
    result = throughput(tmp_path, "--section", "memory", "--num-requests", "8", "--kv-budget-seqs", "1")
    paged, contiguous = result["rows"]
    assert contiguous["max_running"] == 1  # the budget binds, not max_num_seqs (8)
    assert paged["max_running"] >= 3 * contiguous["max_running"]
    assert paged["mean_running"] >= 2 * contiguous["mean_running"]
    assert 0 < contiguous["utilisation"] < 0.5 < paged["utilisation"] <= 1.0
    assert paged["same_tokens"] == contiguous["same_tokens"] == 1.0  # preemption and recompute included


def test_preemption_by_swap_recomputes_nothing_and_the_host_tier_serves_evicted_prefixes(tmp_path):
    """6 requests of 32 + 12 prompt tokens (one of 3 shared 32-token prefixes first) and 12 output
    tokens in 128 KV slots (8 blocks): every mode preempts; swap moves blocks to host memory and
    back and computes no token twice; the host tier serves prefix blocks the device evicted."""
    result = throughput(tmp_path, "--section", "preemption", "--num-requests", "6", "--kv-budget-seqs", "1",
                        "--prefix-groups", "3", "--prefix-len", "32")
    recompute, swap, tier = result["rows"]
    assert [r["name"] for r in result["rows"]] == ["recompute, 128 KV slots", "swap, 128 KV slots",
                                                   "swap + host tier, 128 KV slots"]
    assert recompute["num_preemptions"] > 0 and swap["num_preemptions"] > 0
    assert recompute["swap_mib"] == 0.0 and swap["recomputed"] == swap["swap_fallbacks"] == 0 < swap["swap_mib"]
    assert swap["host_hits"] == swap["tier_mib"] == 0 and tier["host_hits"] > 0 and tier["tier_mib"] > 0
    assert tier["host_hits"] % 16 == 0  # whole blocks
    assert swap["same_tokens"] == tier["same_tokens"] == 1.0


def test_prefix_caching_computes_the_shared_prompt_once(tmp_path):
    result = throughput(tmp_path, "--section", "prefix", "--num-requests", "6", "--prefix-len", "32",
                        "--prefix-output-len", "4")
    off, on = result["rows"]
    assert off["prefill_tokens"] == result["num_prompt_tokens"] and off["hit_rate"] == 0.0
    # The first request's prefix fills two 16-token steps, so no other request is admitted before its
    # two blocks are in the cache; each of the other five then computes only its own suffix.
    assert on["prefill_tokens"] == result["num_prompt_tokens"] - 5 * 32
    assert on["same_tokens"] == 1.0 and on["ttft_mean_s"] > 0 and off["ttft_p50_s"] > 0


def test_latency_reports_percentiles_and_compiles_only_in_the_first_run(tmp_path, capsys):
    out = tmp_path / "latency.json"
    benchmark_latency.main([*TINY, "--batch-size", "2", "--num-requests", "4", "--input-len", "8", "--output-len",
                            "20", "--num-iters-warmup", "1", "--num-iters", "3", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["rows"]] == ["end-to-end latency (s)", "time to first token (ms)",
                                                   "decode per token (ms)"]
    assert [len(v) for v in result["raw"].values()] == [3, 12, 12]
    for row in result["rows"]:
        assert 0 < row["p10"] <= row["p50"] <= row["p90"] <= row["p99"]
    assert result["compile_s"] > 0 and result["timed_runs_compile_s"] == 0.0
    # The same runs again with async scheduling: every call but a run's first is dispatched before the
    # one before is processed, decode calls with requests waiting too (the call after the first two
    # rows' last admits the other two).
    overlapped = result["overlapped"]
    assert result["serial"]["overlapped_calls"] == 0 and overlapped["overlapped_calls"] == overlapped["calls"] - 3
    assert result["tok_s"]["end_to_end"] == pytest.approx(4 * 20 / result["rows"][0]["p50"])
    for engine in ("serial", "overlapped"):  # the device's busy time is timed within the runs' wall time,
        host = result[engine]  # its last end seen by a thread that may wake a little late (0.3 ms seen)
        assert 0 < host["device_busy_seconds"] <= host["wall_seconds"] + 5e-3
        assert host["exposed_ms_per_call"] == pytest.approx(
            1e3 * (host["wall_seconds"] - host["device_busy_seconds"]) / host["calls"])
    assert result["serial"]["wall_seconds"] == pytest.approx(sum(result["raw"]["end-to-end latency (s)"]))
    printed = capsys.readouterr().out
    assert "decode per token (ms)" in printed and "end-to-end: " in printed


def test_latency_with_a_draft_model_plans_its_verifications_ahead(tmp_path):
    """--speculative-config with the target as its own draft (every draft accepted), k = 3, 16
    tokens: after the prefill, verifications give each row 4 tokens a call; in the overlapped engine
    all four are planned while the call before runs (the last with 2 drafts, its room), none in the
    serial engine. --speculate-by-acceptance: verified whatever this machine's timings say."""
    out = tmp_path / "latency.json"
    config = '{"method": "draft_model", "model": "target", "num_speculative_tokens": 3}'
    benchmark_latency.main([*TINY, "--batch-size", "2", "--input-len", "8", "--output-len", "16", "--num-iters-warmup",
                            "1", "--num-iters", "1", "--speculative-config", config, "--speculate-by-acceptance",
                            "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["serial"]["overlapped_verifications"] == 0 and result["serial"]["calls"] == 5
    overlapped = result["overlapped"]
    assert overlapped["calls"] == 5 and overlapped["overlapped_calls"] == overlapped["overlapped_verifications"] == 4


def test_latency_host_core_must_be_one_of_several_cores_it_may_run_on():
    with pytest.raises(SystemExit, match="--host-core 4096: this process may run on cores"):
        benchmark_latency.pin_host(4096)


@pytest.fixture(scope="module")
def pool_moments():
    model = benchlib.random_weights(preset("tiny"))
    return {bs: plot_block_pool.simulate(model, bs, [1, 3, 5, 7]) for bs in (4, plot_block_pool.MAX_MODEL_LEN)}


def test_picture_workload_shares_blocks_and_contiguous_waits(pool_moments):
    paged, contiguous = pool_moments[4], pool_moments[plot_block_pool.MAX_MODEL_LEN]
    # Step 1: E's two samples share their full prompt block; contiguous has room for three of five.
    assert sorted(np.flatnonzero(paged[0]["ref"] == 2).tolist()) == [paged[0]["owner_blocks"]["E1"][0]]
    assert contiguous[0]["running"] == ["A", "B", "C"] and contiguous[0]["waiting"] == ["E"]
    # D found C's two prefix blocks in the cache: they hold its prefix at step 5, still cached after
    # C finished (its blocks went back to the pool as soon as it did).
    shared = paged[1]["owner_blocks"]["C"][:2]
    assert paged[2]["owner_blocks"]["D"][:2] == shared and all(paged[2]["cached"][b] for b in shared)
    # Step 7: paged is done, its freed full blocks keep their prefix-cache entries; contiguous still runs.
    assert paged[3]["ref"].sum() == 0 and paged[3]["cached"].sum() > 0
    assert contiguous[3]["running"] == ["A", "D", "E1", "E2"]
    for block_size, shots in pool_moments.items():
        for shot in shots:
            assert 0 <= shot["held"].sum() <= (shot["ref"][1:] > 0).sum() * block_size


def test_picture_is_a_small_png(tmp_path, pool_moments):  # after the fixture: its programs are compiled
    out = tmp_path / "pool.png"
    plot_block_pool.main(["--out", str(out), "--dpi", "50"])
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 0 < len(data) < 200_000
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (500, 440)  # figsize (10, 2 * 4 moments + 0.8) inches at 50 dpi


def test_spec_decode_section_compares_each_workload_and_batch_with_and_without(tmp_path, monkeypatch):
    """The section on stories260K (no chat template: the prompts as text), one prompt per workload,
    8 tokens: a row per workload, batch and engine; greedy speculation gives the plain tokens."""
    from scripts import spec_decode_section

    monkeypatch.setattr(spec_decode_section, "WORKLOADS", {"repeat/edit": ["Once upon a time, once upon a"],
                                                           "free": ["Lily wanted to"]})
    monkeypatch.setattr(spec_decode_section, "REPEATS", 1)
    out = tmp_path / "spec.json"
    benchmark_throughput.main(["--section", "spec-decode", "--kv-model", "tests/data/stories260K",
                               "--output-len", "8", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == [f"{w}, batch {b}, {e}" for w in ("repeat/edit", "free") for b in (1, 8)
                                         for e in ("off", "ngram")]
    assert all(r["same_tokens"] == 1.0 and r["output_tokens"] == 8 for r in rows)
    assert all(r["ratio"] == 1.0 and r["verifications"] == 0 for r in rows[::2])


def test_lora_section_runs_each_way_against_the_engine_without_lora(tmp_path, monkeypatch):
    """The section on stories260K, 8 prompts of 8 tokens: the rows without an adapter give the base
    engine's tokens; the slots load each adapter once (one slot: one after another)."""
    from scripts import lora_section

    monkeypatch.setattr(lora_section, "WORKLOADS", {"free": ["Lily wanted to", "Once upon a time"] * 4})
    monkeypatch.setattr(lora_section, "REPEATS", 1)
    out = tmp_path / "lora.json"
    benchmark_throughput.main(["--section", "lora", "--kv-model", "tests/data/stories260K", "--output-len", "8",
                               "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["no LoRA", "LoRA on, no adapter", "LoRA on, 1 adapter",
                                         "LoRA on, 4 adapters x 2", "1 slot, 4 adapters x 2"]
    assert [r["loads"] for r in rows] == [0, 0, 1, 3, 4]
    assert [r["same_tokens"] for r in rows[:2]] == [1.0, 1.0] and rows[0]["ratio"] == 1.0
    assert all(r["output_tokens"] == 64 for r in rows)


def test_proposals_benchmark_checks_both_ways_propose_the_same(capsys):
    """Each call's drafts from the batched lookup equal the per-row search's (the script raises
    otherwise); the rows that quote their own start (every other one) propose."""
    from scripts import benchmark_proposals

    table = benchmark_proposals.main(["--batch-sizes", "1", "5", "--lengths", "16", "40", "--calls", "4"])
    assert [(r["batch"], r["length"], r["matched"]) for r in table] == [(1, 16, 1), (1, 40, 1), (5, 16, 3), (5, 40, 3)]
    assert all(r["per_row"] > 0 and r["batched"] > 0 for r in table)
    assert "x faster" in capsys.readouterr().out


def test_gpu_spec_check_runs_on_a_small_config(tmp_path, capsys):
    """gpu_check.sh's step 5 on a 2-layer config here: both batches, the same greedy tokens with
    speculation, and the costs the engine timed."""
    from scripts import gpu_spec_check

    config = tmp_path / "config.json"
    config.write_text(json.dumps(preset("tiny", vocab_size=1024, max_position_embeddings=2048).to_hf_config()))
    gpu_spec_check.main(["--config", str(config), "--max-tokens", "64"])
    out = capsys.readouterr().out
    assert out.count("same tokens True") == 4 and "batch 8 ngram" in out
    assert "timed step (rows 1)" in out
