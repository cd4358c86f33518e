"""Process 0's scheduling, replayed by the other processes of a multi-process server.

Each engine step is one jitted program across the devices of every process (tensor parallelism's
collectives run inside it), so every process must call `LLMEngine.step()` as often as the others,
on the same requests in the same order. Only process 0 hears HTTP. Before each of its steps it sends
every follower one message: the adds and aborts its engine applied since its last step, in the order
applied (a step with none is sent too: an idle-going step still runs the pool's jitted frees). A
follower applies them to its own engine and steps; at shutdown a stop message ends it. Nothing a
follower does depends on its clock or on when a request reached it: a request's sampling key comes
from its seed, or from the engine's seed and its arrival index (LLMEngine.add_request), and the
arrival order is process 0's.

The channel is its own TCP connection per follower, apart from the liveness channel (which stays a
silent connection whose closing means a crash, read by a thread), opened and proven as the liveness
channel's (paged_jax.worker.handshake: the coordinator's address only, the job's secret). A message
is a 4-byte length and JSON, not pickle: a follower runs nothing a peer sends.
"""
from __future__ import annotations

import dataclasses
import json
import struct

from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.lora.request import LoRARequest
from paged_jax.sampling_params import RequestOutputKind, SamplingParams
from paged_jax.worker import distributed, handshake

_LENGTH = struct.Struct("!I")


def encode(command: tuple) -> list:
    """("add", request_id, prompt, SamplingParams, cache_salt, LoRARequest or None) or ("abort",
    request_id) -> JSON data."""
    if command[0] == "abort":
        return list(command)
    kind, request_id, prompt, params, cache_salt, lora = command
    fields = dataclasses.asdict(params) | {"output_kind": params.output_kind.name}
    return [kind, request_id, prompt, fields, cache_salt, lora and dataclasses.astuple(lora)]


def apply(engine: LLMEngine, command: list) -> None:
    """One command of process 0's, applied to this process's engine as process 0 applied it."""
    if command[0] == "abort":
        engine.abort_request(command[1])
        return
    _, request_id, prompt, fields, cache_salt, lora = command
    params = SamplingParams(**fields | {"output_kind": RequestOutputKind[fields["output_kind"]]})
    try:
        engine.add_request(request_id, prompt, params, cache_salt=cache_salt,
                           lora_request=lora and LoRARequest(*lora))
    except ValueError as e:  # process 0's engine took it: the two engines are no longer the same
        raise RuntimeError(f"request {request_id!r}, which process 0 added, is refused here: {e}") from e


def summary(engine: LLMEngine, steps: int) -> str:
    """What every process of one job must have done alike (the test of a job compares them)."""
    k = engine.counters
    return f"{steps} steps, {k['prompt_tokens']} prompt tokens, {k['generation_tokens']} generated tokens"


class StepSender:
    """Process 0's end: one connection from every follower, accepted before serving starts."""

    def __init__(self, host: str, num_processes: int, timeout_s: float):
        """`host`: the coordinator's, the only address listened on."""
        server, secret = handshake.listen("step", host)
        self.steps = 0
        try:
            self.conns = handshake.accept_peers(server, secret, "step", num_processes, timeout_s)
        except OSError as e:
            raise RuntimeError(str(e)) from e

    def send_step(self, commands: list[tuple]) -> None:
        """Before each step of process 0's engine: the commands it applied since the last one."""
        self.steps += 1
        self._send({"step": [encode(c) for c in commands]})

    def stop(self) -> None:
        """After the last step: the followers leave their loops and exit normally."""
        self._send({"stop": True})
        for conn in self.conns.values():
            conn.close()

    def _send(self, message: dict) -> None:
        data = json.dumps(message).encode()
        frame = _LENGTH.pack(len(data)) + data
        for peer, conn in self.conns.items():
            try:
                conn.sendall(frame)
            except OSError as e:
                distributed.stop_on_lost_peer(0, f"process {peer} closed its step channel ({e}): it crashed, "
                                                 "was killed or raised")


class StepReceiver:
    """A follower's end, connected to process 0 where it published its step channel."""

    def __init__(self, num_processes: int, process_id: int, timeout_s: float):
        self.num_processes, self.process_id = num_processes, process_id
        address, secret = handshake.find("step", timeout_s)
        # No timeout once connected: process 0 may sit idle for as long as no request comes.
        self.conn = handshake.connect(address, secret, "step", process_id, timeout_s)

    def next_step(self) -> list[list] | None:
        """The commands of process 0's next step, or None when it stopped serving."""
        (length,) = _LENGTH.unpack(self._read(_LENGTH.size))
        message = json.loads(self._read(length))
        return None if message.get("stop") else message["step"]

    def _read(self, size: int) -> bytes:
        try:
            return handshake.recv_exact(self.conn, size)
        except OSError:
            distributed.stop_on_lost_peer(
                self.process_id, f"process 0 of {self.num_processes} closed the step channel without a "
                                 "stop (it crashed, was killed or raised)")


def follow(engine: LLMEngine, receiver: StepReceiver) -> int:
    """A follower's serving loop: process 0's steps replayed until its stop -> the steps run.
    The outputs are process 0's to deliver; here they are dropped."""
    steps = 0
    while (commands := receiver.next_step()) is not None:
        for command in commands:
            apply(engine, command)
        engine.step()
        steps += 1
    return steps
