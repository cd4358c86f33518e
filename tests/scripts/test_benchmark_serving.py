"""benchmark_serving's pure parts: the arrival process, the length sampler and vLLM's summary of the
per-request records. The network part is checked end to end against paged_jax.serve."""
import numpy as np
import pytest

from scripts import benchmark_serving as bs
from scripts.benchmark_serving import Record


def test_arrivals_are_a_seeded_poisson_process():
    times = bs.arrival_times(np.random.default_rng(0), 200_000, 4.0)
    gaps = np.diff(times)
    assert times[0] == 0.0 and times.shape == (200_000,) and (gaps >= 0).all()
    # Exponential gaps: mean 1/R (standard error 0.25 / sqrt(2e5) = 0.0006) and a standard deviation equal to it.
    assert gaps.mean() == pytest.approx(0.25, rel=0.01) and gaps.std() == pytest.approx(0.25, rel=0.02)
    np.testing.assert_array_equal(bs.arrival_times(np.random.default_rng(0), 200_000, 4.0), times)
    assert not np.array_equal(bs.arrival_times(np.random.default_rng(1), 200_000, 4.0), times)


def test_infinite_rate_sends_everything_at_once_and_draws_nothing():
    rng = np.random.default_rng(0)
    before = rng.bit_generator.state
    np.testing.assert_array_equal(bs.arrival_times(rng, 5, float("inf")), np.zeros(5))
    assert rng.bit_generator.state == before  # the workload drawn after it is the same at every rate


def test_lengths_are_clipped_long_tailed_and_seeded():
    lengths = bs.sample_lengths(np.random.default_rng(0), 100_000, 160, 512)
    assert lengths.dtype == np.int64 and lengths.min() >= 4 and lengths.max() == 512
    assert abs(lengths.mean() - 160) < 1  # the clipped mean is the one asked for
    assert np.median(lengths) < 0.8 * lengths.mean()  # the long right tail: median below the mean
    np.testing.assert_array_equal(bs.sample_lengths(np.random.default_rng(0), 100_000, 160, 512), lengths)
    short = bs.sample_lengths(np.random.default_rng(0), 1000, 8, 16)
    assert short.min() == 4 and short.max() == 16
    assert not np.array_equal(bs.sample_lengths(np.random.default_rng(1), 1000, 8, 16), short)


RECORDS = [
    Record(prompt_len=10, max_tokens=5, output_tokens=5, ttft_s=0.1, e2e_s=0.5, itl_s=[0.1, 0.1, 0.1, 0.1]),
    Record(prompt_len=20, max_tokens=3, output_tokens=3, ttft_s=0.2, e2e_s=0.6, itl_s=[0.2, 0.2]),
    Record(prompt_len=30, max_tokens=4, output_tokens=2, ttft_s=0.3, e2e_s=0.9, itl_s=[0.6]),  # 2 of 4 tokens
    Record(prompt_len=40, max_tokens=8, error="APIConnectionError: refused"),
]


def test_summary_of_hand_made_records():
    s = bs.summarize(RECORDS, duration_s=2.0)
    counts = {k: s[k] for k in ("completed", "failed", "length_mismatches", "total_input_tokens",
                                "total_output_tokens")}
    assert counts == dict(completed=3, failed=1, length_mismatches=1, total_input_tokens=60, total_output_tokens=10)
    # np.percentile interpolates linearly: p99 of n sorted values sits at index 0.99 * (n - 1).
    expected = dict(duration=2.0, request_throughput=1.5, output_throughput=5.0, total_token_throughput=35.0,
                    mean_ttft_ms=200, median_ttft_ms=200, p99_ttft_ms=200 + 0.98 * 100,
                    # TPOT: 400 ms / 4, 400 ms / 2, 600 ms / 1
                    mean_tpot_ms=300, median_tpot_ms=200, p99_tpot_ms=200 + 0.98 * 400,
                    # ITL pools the seven gaps [100, 100, 100, 100, 200, 200, 600]
                    mean_itl_ms=200, median_itl_ms=100, p99_itl_ms=200 + 0.94 * 400,
                    mean_e2el_ms=2000 / 3, median_e2el_ms=600, p99_e2el_ms=600 + 0.98 * 300)
    assert {k: s[k] for k in expected} == pytest.approx(expected, rel=1e-12)


def test_summary_without_usable_latencies():
    records = [Record(prompt_len=4, max_tokens=1, output_tokens=1, ttft_s=0.05, e2e_s=0.05), RECORDS[-1]]
    s = bs.summarize(records, duration_s=0.5)
    assert s["completed"] == 1 and s["failed"] == 1 and s["length_mismatches"] == 0
    assert s["mean_ttft_ms"] == pytest.approx(50) and s["p99_ttft_ms"] == pytest.approx(50)
    # One output token has no time per output token after the first, and no gaps between chunks.
    assert [s[f"{x}_{m}_ms"] for m in ("tpot", "itl") for x in ("mean", "median", "p99")] == [None] * 6
    none = bs.summarize([RECORDS[-1]], duration_s=1.0)
    assert none["completed"] == 0 and none["request_throughput"] == 0 and none["mean_ttft_ms"] is None


def test_printed_table_is_vllms(capsys):
    bs.print_summary(bs.summarize(RECORDS, duration_s=2.0))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============" and lines[-1] == "=" * 50
    assert lines[1].split() == ["Successful", "requests:", "3"] and lines[1].index("3") == 41
    assert "Request throughput (req/s):".ljust(40) + " 1.50" in lines
    assert "P99 TTFT (ms):".ljust(40) + " 298.00" in lines and "Median ITL (ms):".ljust(40) + " 100.00" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines


@pytest.mark.parametrize("args", [["--request-rate", "0"], ["--num-prompts", "0"],
                                  ["--output-len-mean", "600", "--output-len-max", "512"],
                                  ["--input-len-mean", "2"]])
def test_bad_arguments_are_refused_before_any_request(args, capsys):
    with pytest.raises(SystemExit) as e:
        bs.main(args)
    assert e.value.code == 2 and "need --num-prompts >= 1" in capsys.readouterr().err
