"""Who may join a job's channels: the per-job secret and the handshake both channels share.

Process 0 listens, for each channel (the liveness channel, the server's step channel), on the one
address the peers use to reach it (the coordinator's host: 127.0.0.1 in a local job), never on every
interface (vLLM's GHSA-9f8f-2vmf-885j). It publishes that address and a random secret through jax's
coordination service (the key-value store `jax.distributed` already runs), or takes the secret from
$PAGED_JAX_JOB_SECRET when the launcher sets one on every process. A connection is trusted only once
it has proven the secret: process 0 sends a fresh nonce, the peer answers with its process id, its
own nonce and an HMAC-SHA256 over both nonces and the id, and process 0 answers with its own HMAC (so
a follower never replays a stranger's steps). The secret never crosses a connection and is never
logged. A connection that fails (no answer within the handshake limit, a wrong MAC, an id out of
range or already seated) is closed with one logged line, and process 0 goes on accepting.

Raw sockets rather than pyzmq: each channel is a handful of long-lived point-to-point connections
whose whole protocol is this handshake and length-prefixed frames; zmq would add a dependency and
still need this handshake (its CURVE/ZAP authentication is a bigger protocol of its own).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import time

SECRET_ENV = "PAGED_JAX_JOB_SECRET"
HANDSHAKE_TIMEOUT_S = 5.0  # a peer of the job answers in milliseconds; a silent stranger is dropped
_NONCE = 16
_MAC = hashlib.sha256().digest_size
_PROCESS_ID = struct.Struct("!i")

log = logging.getLogger("paged_jax.channels")


class Refused(Exception):
    """A connection that did not prove itself a peer the job still waits for."""


def bind_address(host: str) -> str:
    """The IPv4 address peers reach `host` at: process 0 listens there and nowhere else."""
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"cannot resolve the coordinator host {host!r}: {e}") from e


def _mac(secret: bytes, label: str, role: bytes, nonces: bytes, process_id: int) -> bytes:
    message = b"|".join((label.encode(), role, nonces, _PROCESS_ID.pack(process_id)))
    return hmac.new(secret, message, hashlib.sha256).digest()


def recv_exact(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


def _admit(conn: socket.socket, secret: bytes, label: str, num_processes: int, seated) -> int:
    """Process 0's side of one handshake -> the peer's process id, or Refused/OSError."""
    nonce = os.urandom(_NONCE)
    conn.sendall(nonce)
    reply = recv_exact(conn, _PROCESS_ID.size + _NONCE + _MAC)
    (peer,) = _PROCESS_ID.unpack(reply[:_PROCESS_ID.size])
    nonces = nonce + reply[_PROCESS_ID.size:-_MAC]
    if not hmac.compare_digest(reply[-_MAC:], _mac(secret, label, b"follower", nonces, peer)):
        raise Refused("it did not prove the job's secret")
    if not 0 < peer < num_processes:
        raise Refused(f"process id {peer} is out of range [1, {num_processes})")
    if peer in seated:
        raise Refused(f"process {peer} is already connected")
    conn.sendall(_mac(secret, label, b"leader", nonces, peer))
    return peer


def accept_peers(server: socket.socket, secret: bytes, label: str, num_processes: int, timeout_s: float,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> dict[int, socket.socket]:
    """Process 0: one proven connection from each of processes 1..num_processes-1 within `timeout_s`
    -> {process id: connection}; every other connection is closed and logged. Closes `server`."""
    deadline = time.monotonic() + timeout_s
    conns: dict[int, socket.socket] = {}
    try:
        while len(conns) < num_processes - 1:
            server.settimeout(max(deadline - time.monotonic(), 1e-3))
            try:
                conn, address = server.accept()
            except TimeoutError:
                missing = sorted(set(range(1, num_processes)) - set(conns))
                raise TimeoutError(f"processes {missing} did not connect to process 0's {label} channel "
                                   f"within {timeout_s} s") from None
            conn.settimeout(min(handshake_timeout_s, timeout_s))
            try:
                peer = _admit(conn, secret, label, num_processes, conns)
            except (Refused, OSError, struct.error) as e:
                log.warning("paged-jax: %s channel: refused a connection from %s:%s: %s",
                            label, address[0], address[1], e)
                conn.close()
                continue
            conn.settimeout(None)
            conns[peer] = conn
    finally:
        server.close()
    return conns


def connect(address: tuple[str, int], secret: bytes, label: str, process_id: int, timeout_s: float) -> socket.socket:
    """A follower: a proven connection to process 0's `address`, retried until `timeout_s` (a refused
    first try is a host whose network is still coming up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection(address, timeout=timeout_s)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"process {process_id} could not reach process 0's {label} channel at "
                                   f"{address[0]}:{address[1]} within {timeout_s} s: {e}") from e
            time.sleep(0.1)
    try:
        nonces = recv_exact(conn, _NONCE) + os.urandom(_NONCE)
        conn.sendall(_PROCESS_ID.pack(process_id) + nonces[_NONCE:] +
                     _mac(secret, label, b"follower", nonces, process_id))
        proof = recv_exact(conn, _MAC)
    except OSError as e:
        conn.close()
        raise RuntimeError(f"process 0 refused process {process_id} on its {label} channel ({e}): a wrong "
                           "secret, a process id out of range or already connected") from e
    if not hmac.compare_digest(proof, _mac(secret, label, b"leader", nonces, process_id)):
        conn.close()
        raise RuntimeError(f"the {label} channel at {address[0]}:{address[1]} did not prove the job's secret")
    conn.settimeout(None)
    return conn


# -- the rendezvous: where process 0 listens, and the secret, through jax's key-value store ---------

_opened: dict[str, int] = {}  # label -> channels opened so far: every process opens them in one order


def _store():
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        raise RuntimeError("a channel between processes needs jax.distributed.initialize first")
    return client


def _key(label: str) -> str:
    _opened[label] = _opened.get(label, 0) + 1
    return f"paged_jax/{label}/{_opened[label]}"


def _env_secret() -> bytes | None:
    value = os.environ.get(SECRET_ENV)
    return hashlib.sha256(value.encode()).digest() if value else None


def listen(label: str, host: str) -> tuple[socket.socket, bytes]:
    """Process 0: a listening socket on `host`'s address and the channel's secret, both published."""
    server = socket.create_server((bind_address(host), 0))
    secret = _env_secret()
    shared = b"" if secret is not None else secrets.token_bytes(32)
    address, port = server.getsockname()[:2]
    _store().key_value_set(_key(label), f"{address}:{port}:{shared.hex()}")
    return server, secret or shared


def find(label: str, timeout_s: float) -> tuple[tuple[str, int], bytes]:
    """A follower: (process 0's address for the channel, its secret), waiting up to `timeout_s`."""
    value = _store().blocking_key_value_get(_key(label), max(int(timeout_s * 1000), 1))
    address, port, shared = value.rsplit(":", 2)
    return (address, int(port)), _env_secret() or bytes.fromhex(shared)
