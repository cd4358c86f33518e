"""The OpenAI server across processes: two `python -m paged_jax.serve` processes of one CPU device
each on 127.0.0.1 (gloo collectives, free ports, a hard time limit), tensor_parallel_size 2, the
embedded model. Process 0 serves HTTP, process 1 follows its steps; the completions must be one
process's (tests/paged_jax/distributed_worker.py's engine), which they are only if process 1 ran
every step on the same batch: each step's matmuls add both processes' halves. Without processes:
what AsyncLLM sends a follower, and a command's round trip through the channel's JSON."""
import asyncio
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from paged_jax import LoRARequest, SamplingParams  # noqa: E402
from paged_jax.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from paged_jax.sampling_params import RequestOutputKind  # noqa: E402
from paged_jax.entrypoints import step_broadcast  # noqa: E402
from paged_jax.entrypoints.async_llm import AsyncLLM  # noqa: E402
from paged_jax.entrypoints.openai import cli  # noqa: E402
from paged_jax.worker import distributed  # noqa: E402
from tests.paged_jax import distributed_worker as worker  # noqa: E402
from tests.ports import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
JOB_LIMIT_S = 240  # start, compile and serve on a loaded 2-core machine; a hang fails here
ENGINE_FLAGS = ["--num-blocks", "32", "--max-num-seqs", "4", "--num-decode-steps", "4"]  # worker.build_llm's
GREEDY = dict(temperature=0.0, max_tokens=worker.MAX_TOKENS)
SAMPLED = dict(temperature=0.8, top_k=20, seed=7, max_tokens=worker.MAX_TOKENS)
PROMPTS = [*worker.PROMPTS, "class Stack:\n"]


class Job:
    """Both processes of one server job, each writing stdout and stderr to its own log."""

    def __init__(self, tmp: Path, extra_flags=((), ())):
        self.url = f"http://127.0.0.1:{free_port()}"
        coordinator = f"127.0.0.1:{free_port()}"
        env = {k: v for k, v in os.environ.items() if k != "PAGED_JAX_API_KEY"}
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=1"  # the suite's, and 1
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip(), PYTHONPATH=str(ROOT))
        self.logs = [open(tmp / f"process-{i}.log", "w+") for i in range(2)]
        self.deadline = time.monotonic() + JOB_LIMIT_S
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "paged_jax.serve", "--port", self.url.rpartition(":")[2], "--coordinator",
             coordinator, "--num-processes", "2", "--process-id", str(i), "--tensor-parallel-size", "2",
             "--distributed-timeout", "30", "--warmup-prompt-len", "0", "--no-compilation-cache",
             "--uvicorn-log-level", "warning", *ENGINE_FLAGS, *extra_flags[i]],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT) for i, log in enumerate(self.logs)]

    def output(self, i: int) -> str:
        self.logs[i].seek(0)
        return self.logs[i].read()

    def outputs(self) -> str:
        return "".join(f"--- process {i} ---\n{self.output(i)[-3000:]}\n" for i in range(2))

    def wait_healthy(self) -> None:
        while time.monotonic() < self.deadline:
            assert all(p.poll() is None for p in self.procs), self.outputs()
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=2).status == 200:
                    return
            except OSError:
                time.sleep(0.5)
        pytest.fail(f"process 0 was not healthy within {JOB_LIMIT_S} s\n{self.outputs()}")

    def complete(self, prompt: str, fields: dict) -> dict:
        body = {"prompt": prompt, "logprobs": 0, "return_tokens_as_token_ids": True, **fields}
        request = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=max(self.deadline - time.monotonic(), 1)) as r:
            choice = json.loads(r.read())["choices"][0]
        return {"text": choice["text"], "token_ids": [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]}

    def wait_exits(self) -> list[int]:
        try:
            return [p.wait(timeout=max(self.deadline - time.monotonic(), 1)) for p in self.procs]
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not exit within {JOB_LIMIT_S} s (a hang)\n{self.outputs()}")

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        for log in self.logs:
            log.close()


@pytest.fixture
def job(tmp_path):
    job = Job(tmp_path)
    try:
        yield job
    finally:
        job.close()


def test_two_processes_serve_one_processs_completions_and_stop_together_on_sigterm(job):
    job.wait_healthy()
    first = job.complete(PROMPTS[0], GREEDY)  # alone, then three at once: several in one step
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        together = list(pool.map(job.complete, PROMPTS, [GREEDY, GREEDY, SAMPLED]))
    reference = worker.build_llm(1)
    want = [reference.generate([p], SamplingParams(**f))[0].outputs[0]
            for p, f in zip([PROMPTS[0], *PROMPTS], [GREEDY, GREEDY, GREEDY, SAMPLED])]
    assert [first, *together] == [{"text": w.text, "token_ids": w.token_ids} for w in want]
    job.procs[0].send_signal(signal.SIGTERM)
    assert job.wait_exits() == [0, 0], job.outputs()
    lead = re.search(r"process 0 stopped its followers after (.*)\n", job.output(0))
    follow = re.search(r"process 1 stopped with process 0 after (.*)\n", job.output(1))
    assert lead and follow, job.outputs()
    # The follower ran every step process 0 ran, on the same requests, and generated the same tokens.
    prompt_tokens = sum(len(reference.get_tokenizer().encode(p)) for p in [PROMPTS[0], *PROMPTS])
    assert lead[1] == follow[1]
    assert re.fullmatch(rf"\d+ steps, {prompt_tokens} prompt tokens, {4 * worker.MAX_TOKENS} generated tokens",
                        lead[1]), lead[1]
    assert "process 1 of 2 follows process 0's steps" in job.output(1)


def test_two_speculating_processes_make_the_same_calls(tmp_path):
    """n-gram speculation in a two-process server: each process's speculator decides by the rows'
    acceptance, not by costs timed on its own clock, so both run the same calls (a difference would
    leave a collective waiting) and answer a single process's greedy tokens, some verified."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    job = Job(tmp_path, extra_flags=(("--speculative-config", spec),) * 2)
    try:
        job.wait_healthy()
        fields = dict(temperature=0.0, max_tokens=24)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(job.complete, PROMPTS, [fields] * len(PROMPTS)))
        with urllib.request.urlopen(job.url + "/metrics", timeout=10) as r:
            drafts = re.search(r"^vllm:spec_decode_num_drafts_total\{.*\} (\S+)$", r.read().decode(), re.MULTILINE)
        want = worker.build_llm(1).generate(PROMPTS, SamplingParams(**fields))
        assert answers == [{"text": w.outputs[0].text, "token_ids": w.outputs[0].token_ids} for w in want]
        assert drafts and float(drafts[1]) > 0
        job.procs[0].send_signal(signal.SIGTERM)
        assert job.wait_exits() == [0, 0], job.outputs()
        lead = re.search(r"process 0 stopped its followers after (.*)\n", job.output(0))
        follow = re.search(r"process 1 stopped with process 0 after (.*)\n", job.output(1))
        assert lead and follow and lead[1] == follow[1], job.outputs()
    finally:
        job.close()


def test_a_follower_whose_process_0_is_killed_stops_with_one_line(job):
    job.wait_healthy()
    job.procs[0].kill()
    assert job.wait_exits() == [-signal.SIGKILL, distributed.EXIT_PEER_LOST], job.outputs()
    # The step channel or the liveness channel, whichever notices first, names process 0, once.
    assert job.output(1).count("paged-jax: error:") == 1, job.outputs()
    assert re.search(r"^paged-jax: error: process 1: process 0 of 2 (closed the step channel without a stop|"
                     r"stopped without shutting down) \(it crashed, was killed or raised\); stopping$",
                     job.output(1), re.MULTILINE), job.outputs()


def test_a_bad_engine_flag_on_one_process_is_one_line_and_exit_2_and_its_peer_stops(tmp_path):
    job = Job(tmp_path, extra_flags=((), ("--kv-cache-dtype", "int4")))
    try:
        assert job.wait_exits() == [distributed.EXIT_PEER_LOST, 2], job.outputs()
        errors = [line for line in job.output(1).splitlines() if "error" in line.lower()]
        assert errors == ["paged-jax-serve: error: kv_cache_dtype 'int4' is not supported; supported: "
                          "['auto', 'int8', 'fp8_e4m3']"], job.outputs()
        assert ("paged-jax: error: process 0: process 1 of 2 stopped without shutting down (it crashed, was "
                "killed or raised); stopping") in job.output(0), job.outputs()
    finally:
        job.close()


@pytest.mark.parametrize("argv, message", [
    (["--num-processes", "2", "--process-id", "1"], "--num-processes 2 needs --coordinator HOST:PORT"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
     "process_id must be in [0, 2) for num_processes=2, got 2")])
def test_bad_process_flags_are_one_line_and_exit_2_before_any_collective(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--no-compilation-cache", "--port", str(free_port())])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"paged-jax-serve: error: {message}\n"


class Recorder:
    """An engine and a StepSender in one, logging in order what AsyncLLM asks of each. A request
    finishes in the step after its add, except one whose prompt is HOLD, which runs until aborted."""

    HOLD = [7]

    def __init__(self):
        self.log, self.added, self.held = [], [], set()

    def add_request(self, request_id, prompt, params, *, cache_salt=None, lora_request=None):
        if not prompt:
            raise ValueError("the prompt is empty: []")
        self.log.append(("add", request_id, prompt, params, cache_salt, lora_request))
        if prompt == self.HOLD:
            self.held.add(request_id)
        else:
            self.added.append(request_id)

    def abort_request(self, request_id):
        self.log.append(("abort", request_id))
        self.held.discard(request_id)

    def has_unfinished_requests(self):
        return bool(self.held)

    def step(self):
        self.log.append("step")
        done, self.added = self.added, []
        return [RequestOutput(r, None, [1], [CompletionOutput(0, "x", [5], finish_reason="length")], True) for r in done]

    def send_step(self, commands):
        self.log.append(("send", list(commands)))

    def stop(self):
        self.log.append("stop")


def test_each_step_is_sent_first_with_the_commands_the_engine_took_and_shutdown_sends_stop():
    recorder = Recorder()
    llm = AsyncLLM(recorder, followers=recorder, max_requests=8)
    params = SamplingParams(max_tokens=1)

    async def collect(request_id, prompt):
        try:
            return [out.request_id async for out in llm.generate(request_id, prompt, params)]
        except ValueError as e:
            return str(e)

    async def client_leaves(request_id):
        stream = llm.generate(request_id, Recorder.HOLD, params)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(stream.__anext__(), 0.2)  # cancelled inside: the request is aborted

    async def session():
        return await asyncio.gather(collect("a", [1, 2]), collect("refused", []), client_leaves("held"),
                                    collect("b", [3]))

    assert asyncio.run(session()) == [["a"], "the prompt is empty: []", None, ["b"]]
    deadline = time.monotonic() + 10
    while recorder.held and time.monotonic() < deadline:  # the abort is queued: let the thread apply it
        time.sleep(0.01)
    llm.shutdown()
    assert recorder.log[-1] == "stop"
    # Every step: the engine's adds and aborts, then one message holding exactly those, then the step.
    log, taken = recorder.log[:-1], []
    for i, entry in enumerate(log):
        if entry == "step":
            assert log[i - 1][0] == "send", log[i - 1:i + 1]
        elif entry[0] == "send":
            assert (entry[1], log[i + 1]) == (taken, "step")
            taken = []
        else:
            taken.append(entry)
    sent = [c for entry in log if entry[0] == "send" for c in entry[1]]
    assert sorted(c[1] for c in sent if c[0] == "add") == ["a", "b", "held"]  # never the refused one
    assert [c for c in sent if c[0] == "abort"] == [("abort", "held")]


def test_a_shutdown_that_lands_just_before_the_engine_thread_clears_its_wake_up_still_stops_it():
    llm = AsyncLLM(Recorder(), followers=Recorder(), max_requests=8)

    class ShutdownBeforeClear(threading.Event):
        """The thread's next clear() first sees shutdown()'s two writes, as a preempted thread can."""

        def clear(self):
            llm._stop = True
            self.set()
            super().clear()

    idle_wake, llm._wake = llm._wake, ShutdownBeforeClear()
    idle_wake.set()  # the idle thread loops once more, into the hooked clear
    llm._thread.join(timeout=10)
    assert not llm._thread.is_alive(), "the engine thread cleared the shutdown's wake-up and sleeps forever"


def test_a_command_crosses_the_channels_json_unchanged():
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, min_p=0.01, seed=3, stop=["\n\n"],
                            stop_token_ids=[2], max_tokens=9, min_tokens=1, logprobs=2, presence_penalty=0.1,
                            output_kind=RequestOutputKind.DELTA)
    recorder = Recorder()
    lora = LoRARequest("sql", 3, "/adapters/sql")
    for command in (("add", "r-0", [4, 5, 6], params, "salt", None), ("abort", "r-0"),
                    ("add", "r-2", [4], params, None, lora)):
        step_broadcast.apply(recorder, json.loads(json.dumps(step_broadcast.encode(command))))
    assert recorder.log == [("add", "r-0", [4, 5, 6], params, "salt", None), ("abort", "r-0"),
                            ("add", "r-2", [4], params, None, lora)]
    with pytest.raises(RuntimeError, match=r"request 'r-1', which process 0 added, is refused here: "
                                           r"the prompt is empty: \[\]"):
        step_broadcast.apply(recorder, step_broadcast.encode(("add", "r-1", [], params, None, None)))
