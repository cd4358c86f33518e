"""One process of tests/paged_jax/test_distributed.py's jobs: `python -m tests.paged_jax.distributed_worker
PORT PROCESS_ID NUM_PROCESSES RECORDS`. Each process has 2 CPU devices, loads the embedded model (Orbax) and
appends one JSON line per result to the file RECORDS: greedy tokens at tensor_parallel_size 4, the bad
sizes' errors; then process 1 dies, and process 0's next generate must be stopped by the liveness
channel. Not stdout: gloo's C++ writes its own lines there, and one can run into a record's line."""
import json
import os
import sys
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from paged_jax import LLM, SamplingParams
from paged_jax.worker import distributed

MODEL = Path(__file__).resolve().parents[2] / "models" / "embedded"
PROMPTS = ["def add(a, b):\n", "import os\n"]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
TIMEOUT_S = 20


def build_llm(tensor_parallel_size):
    return LLM(str(MODEL), num_blocks=32, max_num_seqs=4, num_decode_steps=4, log_stats=False,
               tensor_parallel_size=tensor_parallel_size)


def completions(llm):
    return llm.generate(PROMPTS, GREEDY)


def tokens(llm):
    return [o.outputs[0].token_ids for o in completions(llm)]


def main(port, process_id, num_processes, records_path):
    def emit(**record):
        with open(records_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    jax.config.update("jax_num_cpu_devices", 2)
    distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id, timeout_s=TIMEOUT_S)
    emit(devices=jax.device_count(), local_devices=jax.local_device_count())
    llm = build_llm(4)
    emit(tp=4, mesh_processes=[d.process_index for d in llm.engine.mesh.devices.flat], tokens=tokens(llm))
    for tp in (6, 3):
        try:
            build_llm(tp)
        except ValueError as e:
            emit(tp=tp, error=str(e))
    # Both have reported before process 1 dies: the channel would otherwise cut a slower process 0 short.
    multihost_utils.sync_global_devices("reported")
    if process_id == 1:
        os._exit(3)  # no exit hooks: what a crash looks like to the others
    tokens(llm)  # blocks in a collective process 1 never joins, until the liveness channel stops it
    emit(error="generate finished without its peer")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
