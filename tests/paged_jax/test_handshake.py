"""The channels' handshake (paged_jax.worker.handshake) against strangers, on loopback sockets in one
process: process 0's accept loop refuses and logs every connection that does not prove the job's
secret with a free, in-range process id, keeps accepting, and seats exactly the real peers."""
import logging
import socket
import struct
import threading

import pytest

from paged_jax.worker import handshake

SECRET = bytes(range(32))


def listener():
    server = socket.create_server((handshake.bind_address("localhost"), 0))
    return server, server.getsockname()[:2]


def closed_by_peer(conn: socket.socket) -> bool:
    """Whether the other end closed `conn` (after at most the 16-byte nonce it sends everyone)."""
    conn.settimeout(5)
    try:
        return len(conn.recv(64)) <= 16 and conn.recv(64) == b""
    except ConnectionResetError:
        return True


def test_strangers_are_refused_and_logged_and_the_real_peers_are_seated(caplog):
    server, address = listener()
    assert address[0] == "127.0.0.1"  # a local job listens on loopback only
    seated = {}
    accepting = threading.Thread(target=lambda: seated.update(handshake.accept_peers(
        server, SECRET, "step", num_processes=3, timeout_s=20, handshake_timeout_s=0.5)))
    with caplog.at_level(logging.WARNING, logger="paged_jax.channels"):
        accepting.start()
        silent = socket.create_connection(address)  # connects and never answers: dropped at 0.5 s
        no_secret = socket.create_connection(address)
        handshake.recv_exact(no_secret, 16)
        no_secret.sendall(struct.pack("!i", 1) + b"\0" * (16 + 32))
        strangers = [silent, no_secret]
        with pytest.raises(RuntimeError, match="refused process 1"):
            handshake.connect(address, b"wrong" * 8, "step", 1, timeout_s=5)
        with pytest.raises(RuntimeError, match="refused process 3"):
            handshake.connect(address, SECRET, "step", 3, timeout_s=5)  # out of range for 3 processes
        with pytest.raises(RuntimeError, match="refused process 1"):
            handshake.connect(address, SECRET, "liveness", 1, timeout_s=5)  # another channel's MAC
        one = handshake.connect(address, SECRET, "step", 1, timeout_s=5)
        with pytest.raises(RuntimeError, match="refused process 1"):
            handshake.connect(address, SECRET, "step", 1, timeout_s=5)  # the seat is taken
        two = handshake.connect(address, SECRET, "step", 2, timeout_s=5)
        accepting.join(10)
    assert sorted(seated) == [1, 2]
    assert all(closed_by_peer(s) for s in strangers)
    seated[1].sendall(b"to 1")
    seated[2].sendall(b"to 2")
    assert (one.recv(4), two.recv(4)) == (b"to 1", b"to 2")
    reasons = [r.getMessage().rsplit(": ", 1)[1] for r in caplog.records]
    assert sorted(reasons) == sorted([
        "timed out", "it did not prove the job's secret", "it did not prove the job's secret",
        "process id 3 is out of range [1, 3)", "it did not prove the job's secret",
        "process 1 is already connected"])
    assert SECRET.hex() not in caplog.text
    with pytest.raises(OSError):  # seated: the listener is closed
        socket.create_connection(address, timeout=1)


def test_a_follower_refuses_a_process_0_that_does_not_know_the_secret():
    server, address = listener()

    def impostor():
        conn, _ = server.accept()
        conn.sendall(b"n" * 16)
        handshake.recv_exact(conn, 4 + 16 + 32)
        conn.sendall(b"\0" * 32)

    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(RuntimeError, match="did not prove the job's secret"):
        handshake.connect(address, SECRET, "step", 1, timeout_s=5)
    server.close()


def test_peers_that_never_come_are_named_after_the_timeout():
    server, _ = listener()
    with pytest.raises(TimeoutError, match=r"processes \[1, 2\] did not connect to process 0's step channel"):
        handshake.accept_peers(server, SECRET, "step", num_processes=3, timeout_s=0.3)
