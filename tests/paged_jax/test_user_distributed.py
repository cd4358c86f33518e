"""A JAX program's own multi-host setup: two processes that call `jax.distributed.initialize`
themselves, then `LLM(path, tensor_parallel_size=2)` on a Hugging Face directory, an Orbax directory
and a GGUF file of one random tiny model (every device a loader picks must be this process's own).
The same job opens the server's step channel past strangers (user_distributed_worker.py)."""
import json
import sys

from models.checkpoint import save_orbax
from paged_jax import LLM
from tests.models.gguf_testing import save_hf_dir, write_gguf
from tests.models.model_testing import random_model, tiny_config
from tests.paged_jax import user_distributed_worker as worker
from tests.paged_jax.test_distributed import run_job
from tests.ports import free_port


def test_two_processes_initialized_by_the_user_load_every_format_and_refuse_strangers(tmp_path):
    model = random_model(tiny_config())
    gguf_file = tmp_path / "tiny.gguf"
    hf_dir = save_hf_dir(tmp_path / "hf", model.config, write_gguf(gguf_file, model))
    orbax_dir = save_orbax(model, tmp_path / "orbax")
    paths = [str(hf_dir), str(orbax_dir), str(gguf_file)]
    reference = LLM(str(hf_dir), num_blocks=16, max_num_seqs=2, num_decode_steps=2, log_stats=False)
    want = [o.outputs[0].token_ids for o in reference.generate(worker.PROMPTS, worker.GREEDY)]
    port = str(free_port())
    records = [tmp_path / f"records-{i}.jsonl" for i in range(2)]
    results = run_job([[sys.executable, "-m", "tests.paged_jax.user_distributed_worker", port, str(i),
                        str(records[i]), *paths] for i in range(2)], "the user-initialized job")
    assert [status for status, _, _ in results] == [0, 0], [err[-3000:] for _, _, err in results]
    got = [[json.loads(line) for line in path.read_text().splitlines()] for path in records]
    for process in got:
        assert [r["path"] for r in process[:3]] == paths
        assert all(r["tokens"] == want for r in process[:3]), process
    assert got[0][3] == {"seated": [1]}
    follower = got[1][3]
    assert follower["listening"] == "127.0.0.1"
    assert [e.split(" (")[0] for e in follower["refused"]] == [
        "process 0 refused process 1 on its step channel", "process 0 refused process 2 on its step channel"]
    assert follower["steps"] == [[["abort", "nothing"]], None]
    refusals = [line for line in results[0][2].splitlines() if "refused a connection" in line]
    assert [line.rsplit(": ", 1)[1] for line in refusals] == [
        "it did not prove the job's secret", "it did not prove the job's secret",
        "process id 2 is out of range [1, 2)", "timed out"]
