"""What the command lines share (scripts/generate.py, the server): the multi-process flags, their
start-up, and one-line failures. The engine's own flags are EngineArgs.add_cli_args."""
from __future__ import annotations

import sys
from typing import NoReturn

from paged_jax.worker import distributed


def add_distributed_args(ap) -> None:
    """--coordinator, --num-processes, --process-id, --distributed-timeout (paged_jax.worker.distributed)."""
    ap.add_argument("--coordinator", metavar="HOST:PORT",
                    help="process 0's address for jax.distributed (all processes pass the same)")
    ap.add_argument("--num-processes", type=int, default=1, help="processes in the job (default: 1)")
    ap.add_argument("--process-id", type=int, default=0, help="this process's index, 0 to num-processes - 1")
    ap.add_argument("--distributed-timeout", type=float, default=distributed.DEFAULT_TIMEOUT_S, metavar="SECONDS",
                    help="how long to wait for peers to start, and for a dead one "
                         f"(default: {distributed.DEFAULT_TIMEOUT_S})")


def initialize_distributed(args) -> distributed.LivenessChannel | None:
    """`distributed.initialize` from add_distributed_args' flags, before anything touches a device;
    a missing coordinator with several processes is named."""
    if args.num_processes != 1 and args.coordinator is None:
        raise ValueError(f"--num-processes {args.num_processes} needs --coordinator HOST:PORT")
    return distributed.initialize(args.coordinator or "127.0.0.1:1", args.num_processes, args.process_id,
                                  timeout_s=args.distributed_timeout)


def fail(prog: str, message: str) -> NoReturn:
    """One line on stderr and exit status 2 (argparse's for bad usage): no traceback for a bad
    input; the other processes of a job stop too, not at a timeout."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    distributed.exit_after_error(2)
