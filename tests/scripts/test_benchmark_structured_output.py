"""scripts/benchmark_structured_output.py --engine on the embedded model at a tiny size: both sides
run every request to max_tokens (the script asserts it), and it prints a ratio and TTFTs; and
--speculation: the same tokens with and without n-gram speculation, every forced draft accepted."""
import re
import sys

from scripts import benchmark_structured_output as bench


def test_engine_section_runs_equal_work_and_prints_ratios(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmark_structured_output.py", "--model", "models/embedded", "--engine",
                                      "--concurrency", "2", "--max-tokens", "8", "--repeats", "2",
                                      "--repeats-engine", "1", "--rows", "4"])
    bench.main()
    out = capsys.readouterr().out
    assert re.search(r"^\s+2\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+$", out, re.M), out
    assert re.search(r"time to first token: new schema [0-9.]+ ms, cached schema [0-9.]+ ms", out), out
    assert re.search(r"grammar compiles: \d+, [0-9.]+ ms each", out), out


def test_speculation_section_gives_the_same_tokens_and_counts_the_drafts(monkeypatch, capsys, untimed_speculation):
    monkeypatch.setattr(sys, "argv", ["benchmark_structured_output.py", "--model", "models/embedded",
                                      "--speculation", "--concurrency", "2", "--repeats-engine", "1"])
    bench.main()  # asserts the greedy tokens are equal
    row = re.search(r"^\s+2\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+(\d+)/(\d+)\s*$", capsys.readouterr().out, re.M)
    assert row and int(row[1]) == int(row[2]) > 0, row
