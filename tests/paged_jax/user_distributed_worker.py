"""One process of test_user_distributed.py's job, set up as a JAX program sets itself up: its own
`jax.distributed.initialize` (not paged_jax's helper), then `LLM(path, tensor_parallel_size=2)` for a
Hugging Face directory, an Orbax directory and a GGUF file, one CPU device per process.

    python -m tests.paged_jax.user_distributed_worker PORT PROCESS_ID RECORDS HF_DIR ORBAX_DIR GGUF_FILE

Then the server's step channel (paged_jax.entrypoints.step_broadcast) opens between the two, and
process 1 first knocks on process 0's port as strangers would: no secret, a wrong one, an id out of
range, a silent connection. Records go to the file RECORDS, one JSON line each (gloo writes to stdout)."""
import json
import socket
import struct
import sys

import jax

from paged_jax import LLM, SamplingParams
from paged_jax.entrypoints.step_broadcast import StepReceiver, StepSender
from paged_jax.worker import handshake

PROMPTS = [[1, 5, 9, 17, 33], [1, 100, 3]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
TIMEOUT_S = 60


def strangers(address, secret: bytes) -> tuple[list[socket.socket], list[str]]:
    """Connections that must each be refused -> (the open ones, held to the end; the refusals seen)."""
    no_secret = socket.create_connection(address)
    handshake.recv_exact(no_secret, 16)
    no_secret.sendall(struct.pack("!i", 1) + b"\0" * 48)
    refused = []
    for key, process_id in ((b"wrong" * 8, 1), (secret, 2)):
        try:
            handshake.connect(address, key, "step", process_id, timeout_s=10)
        except RuntimeError as e:
            refused.append(str(e))
    return [no_secret, socket.create_connection(address)], refused


def main(port, process_id, records_path, *paths):
    def emit(**record):
        with open(records_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=TIMEOUT_S)
    for path in paths:
        llm = LLM(path, tensor_parallel_size=2, num_blocks=16, max_num_seqs=2, num_decode_steps=2, log_stats=False)
        emit(path=path, tokens=[o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)])
    if process_id == 0:
        sender = StepSender("localhost", 2, TIMEOUT_S)
        emit(seated=sorted(sender.conns))
        sender.send_step([["abort", "nothing"]])
        sender.stop()
    else:
        # The published address and secret, read as a member of the job may (the first step channel).
        value = handshake._store().blocking_key_value_get("paged_jax/step/1", TIMEOUT_S * 1000)
        host, port, secret = value.rsplit(":", 2)
        held, refused = strangers((host, int(port)), bytes.fromhex(secret))
        receiver = StepReceiver(2, process_id, TIMEOUT_S)
        emit(listening=host, refused=refused, steps=[receiver.next_step(), receiver.next_step()])
        for conn in held:
            conn.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
