"""Tensor parallelism across processes: jax's multi-controller runtime on 127.0.0.1 (gloo CPU
collectives), two processes, a free coordinator port and a hard time limit per job, the embedded
model: scripts/generate.py with one CPU device per process at tensor_parallel_size 2, and
tests/paged_jax/distributed_worker.py with 2 devices per process at 4. The reference is one process."""
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from paged_jax.worker import distributed, sharding
from scripts import generate
from tests.paged_jax import distributed_worker as worker
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
JOB_LIMIT_S = 240  # a loaded 2-core machine compiles the 2 x 8 programs of one job in about a minute


def run_job(commands: list[list[str]], what: str) -> list[tuple[int, str, str]]:
    """Start one process per command, together -> [(exit status, stdout, stderr)] in process order."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the worker sets its device count
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for command in commands]
    deadline = time.monotonic() + JOB_LIMIT_S
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            results.append((proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not finish within {JOB_LIMIT_S} s (a hang)")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return results


def run_worker(tmp: Path) -> list[tuple[int, list[dict], str]]:
    """Both worker processes -> [(exit status, JSON records, stderr)]."""
    port = str(free_port())
    records = [tmp / f"records-{i}.jsonl" for i in range(2)]
    commands = [[sys.executable, "-m", "tests.paged_jax.distributed_worker", port, str(i), "2", str(records[i])]
                for i in range(2)]
    results = run_job(commands, "the worker job")
    return [(status, [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [], err)
            for (status, _, err), path in zip(results, records)]


def ours(stdout: str) -> str:
    """stdout less gloo's own connection lines (written by its C++ code, on every process)."""
    return "".join(line for line in stdout.splitlines(keepends=True) if not line.startswith("[Gloo] "))


@pytest.fixture(scope="module")
def one_process():
    return worker.completions(worker.build_llm(1))


def test_generate_py_on_two_processes_prints_the_single_process_text_once(one_process):
    port = str(free_port())
    commands = [[sys.executable, "scripts/generate.py", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                 "--process-id", str(i), "--tensor-parallel-size", "2", "--temperature", "0", "--max-tokens",
                 str(worker.MAX_TOKENS), "--no-compilation-cache", *(a for p in worker.PROMPTS for a in ("--prompt", p))]
                for i in range(2)]
    (status0, out0, err0), (status1, out1, err1) = run_job(commands, "generate.py")
    assert (status0, status1) == (0, 0), err0[-3000:] + err1[-3000:]
    want = "".join(generate.header(i, 0, len(worker.PROMPTS), 1) + worker.PROMPTS[i] + o.outputs[0].text + "\n"
                   for i, o in enumerate(one_process))
    assert ours(out0).startswith(want + "\nrequests 2, generated tokens 16, "), out0
    assert ours(out1) == ""  # only process 0 prints


def test_two_processes_of_two_devices_give_the_single_process_tokens_at_tp_4_then_one_dies(one_process, tmp_path):
    want = [o.outputs[0].token_ids for o in one_process]
    assert [len(t) for t in want] == [worker.MAX_TOKENS] * 2
    results = run_worker(tmp_path)
    common = [
        {"devices": 4, "local_devices": 2},
        {"tp": 4, "mesh_processes": [0, 0, 1, 1], "tokens": want},
        {"tp": 6, "error": "tensor_parallel_size must be in [1, 4] (the devices of all 2 processes), got 6"},
        {"tp": 3, "error": "tensor_parallel_size=3 is not a multiple of the 2 processes: each process "
                           "needs the same share of the mesh"},
    ]
    (status0, records0, err0), (status1, records1, err1) = results
    assert (status1, records1) == (3, common), err1[-3000:]  # process 1 died on purpose
    # Process 0 was inside a step's collective: stopped by the liveness channel, not jax's abort.
    assert (status0, records0) == (distributed.EXIT_PEER_LOST, common), err0[-3000:]
    assert ("paged-jax: error: process 0: process 1 of 2 stopped without shutting down "
            "(it crashed, was killed or raised); stopping") in err0


class Exited(Exception):
    pass


@pytest.mark.parametrize("peer_gone", [True, False])
def test_an_uncaught_exception_names_a_lost_peer_or_tells_the_peers(monkeypatch, peer_gone):
    """Process 0's exit hooks after an uncaught exception, on loopback sockets: if peer 2's connection
    closed already (a collective failed as it went, before its reader ran), the process stops naming
    it; otherwise the peers' connections end now. Either way jax's shutdown barrier is skipped."""
    ours, theirs = zip(*(socket.socketpair() for _ in range(2)))
    channel = distributed.LivenessChannel.__new__(distributed.LivenessChannel)
    channel.num_processes, channel.process_id, channel.leaving = 3, 0, False
    channel.conns = {1: ours[0], 2: ours[1]}
    if peer_gone:
        theirs[1].close()
    stops = []

    def stop(process_id, message):
        stops.append((process_id, message))
        raise Exited

    def exit_now(status):
        stops.append(status)
        raise Exited
    monkeypatch.setattr(distributed, "stop_on_lost_peer", stop)
    monkeypatch.setattr(distributed.os, "_exit", exit_now)
    monkeypatch.setattr(sys, "last_value", RuntimeError("a collective failed"), raising=False)
    with pytest.raises(Exited):
        channel.on_exit()
    if peer_gone:
        assert stops == [(0, "process 2 of 3 stopped without shutting down (it crashed, was killed or raised)")]
    else:
        assert stops == [1] and theirs[0].recv(1) == b"" and theirs[1].recv(1) == b""  # both peers hear of it now
    monkeypatch.delattr(sys, "last_value")
    mine, peer = socket.socketpair()
    channel.conns, channel.leaving = {1: mine}, False
    channel.on_exit()  # a normal exit: the connections stay open for jax's barrier
    assert channel.leaving and not distributed._closed(mine) and not distributed._closed(peer)


def test_a_failed_collective_waits_for_the_dead_peers_connection_to_close(monkeypatch):
    """gloo may report a dead peer ("Connection reset by peer", a JaxRuntimeError) before that
    peer's liveness connection is seen to close (CI caught it: exit 1 with a traceback, not 70):
    the exit hook waits up to PEER_CLOSE_S for it, and names the peer when it closes 0.3 s later."""
    ours, theirs = socket.socketpair()
    channel = distributed.LivenessChannel.__new__(distributed.LivenessChannel)
    channel.num_processes, channel.process_id, channel.leaving, channel.conns = 2, 0, False, {1: ours}
    stops = []

    def stop(*why):  # (process_id, message), or an exit status
        stops.append(why if len(why) > 1 else why[0])
        raise Exited
    monkeypatch.setattr(distributed, "stop_on_lost_peer", stop)
    monkeypatch.setattr(distributed.os, "_exit", stop)
    monkeypatch.setattr(sys, "last_value", jax.errors.JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: "
                                                                      "Connection reset by peer"), raising=False)
    closing = threading.Timer(0.3, theirs.close)
    closing.start()
    start = time.monotonic()
    with pytest.raises(Exited):
        channel.on_exit()
    assert stops == [(0, "process 1 of 2 stopped without shutting down (it crashed, was killed or raised)")]
    assert 0.25 < time.monotonic() - start < distributed.PEER_CLOSE_S


def test_bad_process_arguments_are_refused_before_any_collective(capsys):
    with pytest.raises(ValueError, match=r"process_id must be in \[0, 2\) for num_processes=2, got 2"):
        distributed.check_process_args("127.0.0.1:1234", 2, 2)
    with pytest.raises(ValueError, match=r"num_processes must be an integer >= 1, got 0"):
        distributed.check_process_args("127.0.0.1:1234", 0, 0)
    with pytest.raises(ValueError, match=r"HOST:PORT .* got '127.0.0.1'"):
        distributed.check_process_args("127.0.0.1", 2, 0)
    # generate.py stops with one line, no traceback, and never reaches jax.distributed.
    for argv, message in ((["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "-1"],
                           "process_id must be in [0, 2) for num_processes=2, got -1"),
                          (["--num-processes", "2", "--process-id", "1"], "--num-processes 2 needs --coordinator HOST:PORT")):
        with pytest.raises(SystemExit) as exit_info:
            generate.main(argv)
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == f"generate.py: error: {message}\n"


def test_a_program_across_processes_is_one_executable_from_any_call_stack_or_install_path(tmp_path):
    """jax 0.12.1 matches a launch's collectives across processes by an id taken from the
    executable's fingerprint; a server's processes trace the engine's steps from different call
    stacks (and hosts may install the package in different places). With jax's defaults the stack
    and the file's path are in the program, so the fingerprints differ (a server's first all-reduce
    then waits forever); after sharding.same_programs_in_every_process they are one."""
    functions = []
    for place in ("one", "other"):
        (tmp_path / place).mkdir()
        path = tmp_path / place / "program.py"
        path.write_text("import jax.numpy as jnp\n\n\ndef f(a):\n    return jnp.sin(a) * 2\n")
        spec = importlib.util.spec_from_file_location(f"program_{place}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        functions.append(module.f)

    def fingerprint(f, depth: int):  # traced `depth` calls deeper
        if depth:
            return fingerprint(f, depth - 1)
        jax.clear_caches()
        return jax.jit(f).lower(jnp.ones(4)).compile().runtime_executable().fingerprint

    def fingerprints():
        return {fingerprint(functions[0], 0), fingerprint(functions[0], 3), fingerprint(functions[1], 0)}

    names = ("jax_include_full_tracebacks_in_locations", "jax_hlo_source_file_canonicalization_regex")
    saved = {name: getattr(jax.config, name) for name in names}
    assert len(fingerprints()) == 3
    try:
        sharding.same_programs_in_every_process()
        assert len(fingerprints()) == 1
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        jax.clear_caches()
