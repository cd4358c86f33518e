"""scripts/generate.py end to end on the embedded model: as a user runs it (a subprocess, from
another directory), a second start loading its programs from the compilation cache, streaming
against batch output, and the one-line error for a bad --model."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from paged_jax import LLM, SamplingParams
from scripts import generate

SCRIPT = Path(generate.__file__)
STATS = re.compile(r"^requests (\d+), generated tokens (\d+), [\d.]+ tok/s \([\d.]+ s run \+ [\d.]+ s compile\), "
                   r"KV cache peak usage [\d.]+% of \d+ blocks, prefix-cache hit rate [\d.]+%, preemptions 0$",
                   re.MULTILINE)


def run_script(*args, cwd, cache_dir=None, **env):
    """The compilation cache goes to `cache_dir` (default: one in `cwd`), never the user's own."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PAGED_JAX_CACHE_DIR": str(cache_dir or cwd / "jax-cache"), **env}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


# jax logs each persistent-cache lookup: a miss with JAX_EXPLAIN_CACHE_MISSES, a hit with JAX_LOG_COMPILES.
CACHE_LOG = {"JAX_EXPLAIN_CACHE_MISSES": "1", "JAX_LOG_COMPILES": "1"}


def cache_files(path):
    return {p.relative_to(path) for p in path.rglob("*") if p.is_file()}


def cache_lookups(stderr):
    return stderr.count("PERSISTENT COMPILATION CACHE MISS"), stderr.count("Persistent compilation cache hit")


def test_default_run_prints_every_prompt_and_the_stats(tmp_path):
    """No --model: the embedded one, found from the script's location, not the working directory.
    A second start finds every program the first compiled in the cache ($PAGED_JAX_CACHE_DIR the
    first time, the same directory by --compilation-cache-dir the second) and writes nothing new."""
    cache = tmp_path / "cache"
    result = run_script("--max-tokens", "4", "--temperature", "0", cwd=tmp_path, cache_dir=cache, **CACHE_LOG)
    assert result.returncode == 0, result.stderr
    for i, prompt in enumerate(generate.PROMPTS):
        assert f"=== prompt {i + 1}/{len(generate.PROMPTS)} ===\n{prompt}" in result.stdout
    # Four prompts, four tokens each: the trained model ends none of them with EOS this early.
    assert STATS.findall(result.stdout) == [(str(len(generate.PROMPTS)), str(4 * len(generate.PROMPTS)))]
    written = cache_files(cache)
    misses, hits = cache_lookups(result.stderr)
    # Every program compiled was written, small ones too (jax's default skips those under 1 s).
    assert (misses, hits) == (len(written), 0) and misses >= 3  # prefill step, decode loop, pool ops

    again = run_script("--max-tokens", "4", "--temperature", "0", "--compilation-cache-dir", str(cache),
                       cwd=tmp_path, cache_dir=tmp_path / "unused", **CACHE_LOG)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split("\nrequests ")[0] == result.stdout.split("\nrequests ")[0]
    assert cache_lookups(again.stderr) == (0, misses)
    assert cache_files(cache) == written and not (tmp_path / "unused").exists()


def test_stream_prints_the_same_text_as_batch_output(capsys, monkeypatch, tmp_path):
    # Seeded sampling draws the same tokens in both modes (same requests in the same order), and n=2
    # makes each prompt's two samples differ, so a mixed-up sample index shows. float32 and the
    # engine's default sizes, no top-p filter: test_embedded_model's engine reuses these compilations.
    # In this process, without the compilation cache: it would hold every later test's programs too.
    args = ["--prompt", "def add(a, b):\\n", "--prompt", "import sys\\n", "--max-tokens", "12",
            "--temperature", "0.8", "--top-p", "1", "--seed", "1", "--n", "2", "--dtype", "float32",
            "--no-compilation-cache"]
    monkeypatch.setenv("PAGED_JAX_CACHE_DIR", str(tmp_path / "cache"))
    generate.main(args)
    batch = capsys.readouterr().out
    generate.main(args + ["--stream"])
    streamed = capsys.readouterr().out
    blocks = re.split(r"\n=== prompt \d/2, sample \d/2 ===\n", streamed[: STATS.search(streamed).start()])[1:]
    assert [b.splitlines()[0] for b in blocks] == ["def add(a, b):", "def add(a, b):", "import sys", "import sys"]
    assert blocks[0] != blocks[1] and blocks[2] != blocks[3]
    assert STATS.findall(streamed) == [("2", "48")]  # 2 prompts x 2 samples x 12 tokens
    # The stats differ in timing only; the completions must match character for character.
    assert streamed[: STATS.search(streamed).start()] == batch[: STATS.search(batch).start()]
    assert jax.config.jax_compilation_cache_dir is None and not (tmp_path / "cache").exists()


def test_prompts_file_and_escapes(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("x = 1\\ny = \n\nfor i in range(3):\\n\\t\n")
    assert generate.read_prompts(generate.argparse.Namespace(prompt=["a\\tb"], prompts_file=str(prompts))) == [
        "a\tb", "x = 1\ny = ", "for i in range(3):\n\t"]


def test_missing_model_is_one_line_and_exit_2(tmp_path):
    model = tmp_path / "nowhere"
    result = run_script("--model", str(model), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    expected = (f"generate.py: error: cannot load --model {model}: FileNotFoundError: {model / 'config.json'}: "
                f"no config.json, so {model} is not a model directory")
    assert result.stderr.splitlines() == [expected]


def test_model_without_weights_is_one_line_and_exit_2(tmp_path, capsys):
    model = tmp_path / "model"  # a config and a tokenizer, no state/
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_bytes((generate.DEFAULT_MODEL / name).read_bytes())
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--model", str(model), "--no-compilation-cache"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    expected = (f"generate.py: error: cannot load --model {model}: CheckpointError: {model}: neither an HF "
                "checkpoint (model.safetensors or model.safetensors.index.json) nor an Orbax one (state/)")
    assert captured.err.splitlines() == [expected]


def test_tokenizer_flag_gives_a_model_the_tokenizer_it_lacks(tmp_path, capsys):
    """--tokenizer PATH (vLLM's flag, as for a GGUF with its base model's tokenizer): a copy of the
    embedded model without tokenizer.json prints what the model itself prints; a path without a
    tokenizer is one line and exit 2."""
    model = tmp_path / "model"
    shutil.copytree(generate.DEFAULT_MODEL, model)
    (model / "tokenizer.json").unlink()
    args = ["--prompt", "def add(a, b):", "--max-tokens", "8", "--temperature", "0", "--no-compilation-cache"]
    generate.main(args)
    expected = capsys.readouterr().out.split("\n\nrequests")[0]
    generate.main(["--model", str(model), "--tokenizer", str(generate.DEFAULT_MODEL), *args])
    assert capsys.readouterr().out.split("\n\nrequests")[0] == expected
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--model", str(model), "--tokenizer", str(tmp_path), *args])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"generate.py: error: cannot load --tokenizer {tmp_path}: ValueError: tokenizer={str(tmp_path)!r} has no "
        "tokenizer: give a directory with tokenizer.json or a GGUF file with tokenizer.ggml.* metadata"]


def test_chat_sends_each_prompt_through_the_chat_template(tmp_path, capsys):
    model = tmp_path / "chat-model"
    shutil.copytree(generate.DEFAULT_MODEL, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    generate.main(["--model", str(model), "--chat", "--prompt", "def add(a, b):", "--max-tokens", "10",
                   "--temperature", "0", "--no-compilation-cache"])
    printed = capsys.readouterr().out
    llm = LLM(str(model), log_stats=False)
    ids = llm.get_tokenizer().encode("<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant\n",
                                     add_special_tokens=False)
    want = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0].text
    assert printed.startswith("\n=== prompt 1/1 ===\ndef add(a, b):" + want + "\n")
    with pytest.raises(SystemExit) as exit_info:  # the embedded model itself has no template
        generate.main(["--chat", "--prompt", "hi", "--no-compilation-cache"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "generate.py: error: --chat: the model has no chat template (no chat_template.jinja and none in "
        "tokenizer_config.json)"]


def test_a_gguf_file_brings_its_tokenizer_and_chat_template(smollm2_gguf, capsys):
    """--model FILE.gguf --chat on the real SmolLM2 file: its greedy answer, whole (it stops at <|im_end|>)."""
    generate.main(["--model", str(smollm2_gguf), "--chat", "--prompt", "What is the capital of France?",
                   "--max-tokens", "32", "--temperature", "0", "--no-compilation-cache"])
    printed = capsys.readouterr().out
    assert printed.startswith("\n=== prompt 1/1 ===\nWhat is the capital of France?The capital of France is Paris.\n")
    assert STATS.findall(printed) == [("1", "8")]


def test_speculative_decoding_gives_the_same_text_and_reports_acceptance(capsys, untimed_speculation):
    """--speculative-config (vLLM's JSON) on the embedded model: the greedy text of the plain run,
    and the summary line counts the verifications with their acceptance."""
    args = ["--prompt", "Once upon a time, there was a little girl. Once upon a time", "--max-tokens", "40",
            "--temperature", "0", "--no-compilation-cache"]
    generate.main(args)
    plain = capsys.readouterr().out
    generate.main(args + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                                   '"prompt_lookup_min": 2, "prompt_lookup_max": 3}'])
    spec = capsys.readouterr().out
    assert spec.split("\nrequests ")[0] == plain.split("\nrequests ")[0]
    found = re.search(r", speculation: (\d+) verifications, acceptance rate ([\d.]+)%, mean accepted length "
                      r"([\d.]+)$", spec, re.MULTILINE)
    assert found and int(found[1]) > 0 and 0 < float(found[2]) <= 100 and float(found[3]) > 1
    assert "speculation" not in plain


def test_lora_path_runs_every_prompt_with_the_adapter(tmp_path, capsys):
    """--lora-path on the embedded model: the greedy text of LLM.generate with that adapter (not the
    base model's); a rank above --max-lora-rank is one line and exit 2."""
    from models.checkpoint import read_config
    from paged_jax import LLM, LoRARequest, SamplingParams
    from tests.models.model_testing import save_peft_adapter

    model = generate.DEFAULT_MODEL
    save_peft_adapter(tmp_path / "adapter", read_config(model), rank=8, alpha=16, seed=1)
    args = ["--prompt", "def add(a, b):\\n", "--max-tokens", "12", "--temperature", "0", "--no-compilation-cache"]
    generate.main(args + ["--lora-path", str(tmp_path / "adapter"), "--max-lora-rank", "8"])
    text = capsys.readouterr().out.split("\nrequests ")[0]
    llm = LLM(str(model), log_stats=False, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=12)
    adapter = llm.generate(["def add(a, b):\n"], params, lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")))
    base = llm.generate(["def add(a, b):\n"], params)
    assert adapter[0].outputs[0].text != base[0].outputs[0].text
    assert text.endswith("def add(a, b):\n" + adapter[0].outputs[0].text + "\n")  # print's newline
    with pytest.raises(SystemExit) as exit_info:
        generate.main(args + ["--lora-path", str(tmp_path / "adapter"), "--max-lora-rank", "4"])
    assert exit_info.value.code == 2
    assert "has rank 8, more than max_lora_rank=4" in capsys.readouterr().err
