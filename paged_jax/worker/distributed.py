"""Several processes, one engine: jax's multi-controller runtime (`jax.distributed.initialize`).

Every process runs the same script, scheduler and engine on the same inputs; jax runs each jitted
step across the devices of all of them (tensor parallelism over a mesh that spans the processes),
so every host-side decision is taken identically everywhere and only the collectives inside the
step cross between processes.

A process that dies in the middle of a step leaves the others blocked inside a collective. jax's
coordination service notices only after its heartbeat timeout, and then aborts the survivors from
C++. So each process also holds one TCP connection to process 0 (a liveness channel): a connection
that closes while its process has not begun a normal exit means that process crashed, and the
survivor stops at once with one line naming it (exit status `EXIT_PEER_LOST`). jax's heartbeat and
shutdown timeouts, set to the same limit, stay the backstop for a peer that hangs without dying.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from typing import NoReturn

import jax

from paged_jax.worker import handshake

EXIT_PEER_LOST = 70  # sysexits' EX_SOFTWARE: an internal failure, here another process's
DEFAULT_TIMEOUT_S = 60
PEER_CLOSE_S = 2.0  # how long a failed collective waits for a dead peer's liveness connection to close


def parse_coordinator(address: str) -> tuple[str, int]:
    """"HOST:PORT" -> (host, port); ValueError naming the address."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator address must be HOST:PORT with a port in [1, 65535], got {address!r}")
    return host, int(port)


def check_process_args(coordinator: str, num_processes: int, process_id: int) -> tuple[str, int]:
    """Validated before any collective: a bad process id would otherwise wait for peers that never come."""
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be an integer >= 1, got {num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}) for num_processes={num_processes}, "
                         f"got {process_id!r}")
    return parse_coordinator(coordinator)


_stopping = threading.Lock()


def stop_on_lost_peer(process_id: int, message: str) -> NoReturn:
    """End this process with one line saying why, now. The main thread may be blocked inside a
    collective that can never finish: no exception can reach it. Several channels may notice the
    same loss at once, each on its own thread: the first one says it, the others wait for the exit
    (unlocked, their lines ran into each other)."""
    _stopping.acquire()
    sys.stderr.write(f"paged-jax: error: process {process_id}: {message}; stopping\n")
    sys.stderr.flush()
    os._exit(EXIT_PEER_LOST)


class LivenessChannel:
    """Process 0 accepts one proven connection from every other process (paged_jax.worker.handshake);
    each side watches the other."""

    def __init__(self, host: str, num_processes: int, process_id: int, timeout_s: float):
        self.num_processes, self.process_id, self.timeout_s = num_processes, process_id, timeout_s
        self.leaving = False  # set when this process begins a normal exit: closed peers are expected then
        self.conns: dict[int, socket.socket] = {}  # by peer
        if process_id == 0:
            server, secret = handshake.listen("liveness", host)
            threading.Thread(target=self._accept, args=(server, secret), daemon=True,
                             name="paged-jax-liveness").start()
        else:
            address, secret = handshake.find("liveness", timeout_s)
            self._watch(handshake.connect(address, secret, "liveness", process_id, timeout_s), 0)

    def _accept(self, server: socket.socket, secret: bytes) -> None:
        try:
            peers = handshake.accept_peers(server, secret, "liveness", self.num_processes, self.timeout_s)
        except OSError as e:
            self._peer_lost(str(e))
        for peer, conn in peers.items():
            self._watch(conn, peer)

    def _watch(self, conn: socket.socket, peer: int) -> None:
        conn.settimeout(None)
        self.conns[peer] = conn
        threading.Thread(target=self._read, args=(conn, peer), daemon=True, name=f"paged-jax-peer-{peer}").start()

    def _read(self, conn: socket.socket, peer: int) -> None:
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        if not self.leaving:
            self._lost(peer)

    def _lost(self, peer: int) -> None:
        self._peer_lost(f"process {peer} of {self.num_processes} stopped without shutting down "
                        "(it crashed, was killed or raised)")

    def _peer_lost(self, message: str) -> None:
        stop_on_lost_peer(self.process_id, message)

    def on_exit(self) -> None:
        """A normal exit keeps the connections open: jax's shutdown barrier, which runs after this,
        holds every process until all have arrived, so a closed connection after it is expected.

        An uncaught exception is a failure the peers must hear of now, and this process leaves
        without jax's barrier, which they will not reach (it would abort this one at its timeout).
        Where a peer's connection has closed, that peer's end is the cause (a collective fails as
        soon as its peer goes, before this connection's reader may have run): this process stops
        as the reader would have, naming it. A failed collective (a JaxRuntimeError: gloo's
        "Connection reset by peer") may arrive before the dead peer's other sockets are seen to
        close, so that one waits up to PEER_CLOSE_S for them."""
        if not hasattr(sys, "last_value"):
            self.leaving = True
            return
        wait = PEER_CLOSE_S if isinstance(sys.last_value, jax.errors.JaxRuntimeError) else 0.0
        deadline = time.monotonic() + wait
        while True:
            for peer, conn in self.conns.items():
                if _closed(conn):
                    self._lost(peer)
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        self.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def close(self) -> None:
        """The peers hear of it now. A socket whose reader thread is blocked in `recv` stays open
        through `close` (no FIN goes out), so each connection is shut down first."""
        self.leaving = True  # this process's own readers now see the connections end: expected
        for conn in self.conns.values():
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:  # the peer closed it already
                pass
            conn.close()


def _closed(conn: socket.socket) -> bool:
    """Whether the peer has closed `conn` (read without waiting or taking anything)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def initialize(coordinator: str, num_processes: int, process_id: int, *,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> LivenessChannel | None:
    """`jax.distributed.initialize` with the checks and limits above; CPU devices talk through gloo.
    Call it before anything touches a jax device. One process (num_processes=1) starts nothing."""
    host, _ = check_process_args(coordinator, num_processes, process_id)
    if num_processes == 1:
        return None
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the CPU client's; GPUs use NCCL
    limit = max(int(timeout_s), 1)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=limit,
                               heartbeat_timeout_seconds=limit, shutdown_timeout_seconds=limit)
    global _channel
    _channel = LivenessChannel(host, num_processes, process_id, timeout_s)
    atexit.register(_channel.on_exit)  # runs before jax's own shutdown hook (registered earlier)
    return _channel


_channel: LivenessChannel | None = None  # this process's, once initialize has run (one per process, as jax's)


def exit_after_error(status: int) -> NoReturn:
    """Exit with `status` after an error that is no uncaught exception (2 after a bad input). One
    process: `sys.exit`. In a job the peers stop now (their liveness connections to this process
    end), instead of waiting in jax's shutdown barrier until its timeout, and this process leaves
    without that barrier too: its peers never reach it, and jax would abort this process there."""
    if _channel is None:
        sys.exit(status)
    _channel.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
