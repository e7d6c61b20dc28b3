"""Control ring round trip against a bare ``SOCK_SEQPACKET`` round trip, in the same run.

A round trip: the parent writes a FRAME (a ring record, or an 80-byte datagram,
the size of today's FRAME message), a spawned child wakes up, reads it and
answers with a RELEASE, the parent wakes up and reads that.  No GPU is
involved; this measures only the per-frame control path that the ring is
meant to replace.

The benchmarks' ``conftest.py`` skips everything on machines without a GPU;
to run this file on a CPU-only machine::

    python3 -m pytest benchmarks/test_bench_ctlring.py --noconftest -o filterwarnings=default
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from typing import Any

import pytest

from cupy_ipcpool.channel._ctlring import PublisherRing, SubscriberRing

try:  # the shared summary of the benchmark suite, when its conftest is importable
    from conftest import record_value
except ImportError:  # pragma: no cover

    def record_value(name: str, seconds: float) -> None:
        pass


SPAWN = mp.get_context("spawn")
SLOTS = 8
ROUNDS = 3000
WARMUP = 300
_medians: dict[str, float] = {}


def _ring_echo(sock: socket.socket, spin_us: float) -> None:
    _msg, fds, _f, _a = socket.recv_fds(sock, 16, 3)
    with SubscriberRing.attach(fds, SLOTS, spin_us=spin_us) as ring:
        sock.send(b"ready")
        while True:
            rec = ring.recv_frame(timeout=None, watch=[sock])
            if rec is None:  # the parent closed the socket
                return
            seq, slot, generation, _payload = rec
            ring.send_release(seq, slot, generation)


def _socket_echo(sock: socket.socket) -> None:
    buf = bytearray(256)
    while True:
        n = sock.recv_into(buf)
        if n == 0:
            return
        sock.send(buf[:24])  # a RELEASE-sized answer


def _run(benchmark: Any, name: str, one_round: Any) -> None:
    for _ in range(WARMUP):
        one_round()
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    _medians[name] = benchmark.stats.stats.median
    record_value(name, benchmark.stats.stats.median)


@pytest.mark.timeout(120)
@pytest.mark.benchmark(group="control round trip")
def test_socket_seqpacket_round_trip(benchmark: Any) -> None:
    """Baseline: one datagram each way over a Unix SOCK_SEQPACKET socketpair."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = SPAWN.Process(target=_socket_echo, args=(child,), daemon=True)
    proc.start()
    child.close()
    msg = bytes(80)
    buf = bytearray(256)

    def one_round() -> None:
        parent.send(msg)
        parent.recv_into(buf)

    try:
        _run(benchmark, "ctlring_socket_roundtrip", one_round)
    finally:
        parent.close()
        proc.join(10)


def _ring_round_trip(benchmark: Any, name: str, spin_us: float) -> None:
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = SPAWN.Process(target=_ring_echo, args=(child, spin_us), daemon=True)
    proc.start()
    child.close()
    with PublisherRing.create(SLOTS, spin_us=spin_us) as ring:
        socket.send_fds(parent, [b"ring"], ring.fds())
        assert parent.recv(16) == b"ready"
        payload = bytes(56)  # FRAME message minus the fields the record has as its own
        seq = [0]

        def one_round() -> None:
            s = seq[0]
            seq[0] = s + 1
            ring.send_frame(s, s & 7, s, payload)
            rec = ring.recv_release(timeout=10)
            assert rec is not None and rec[0] == s

        try:
            _run(benchmark, name, one_round)
        finally:
            parent.close()
            proc.join(10)


@pytest.mark.timeout(120)
@pytest.mark.benchmark(group="control round trip")
def test_ring_round_trip(benchmark: Any) -> None:
    """The ring with eventfd wake-ups, no spin (the default)."""
    _ring_round_trip(benchmark, "ctlring_roundtrip", 0.0)


@pytest.mark.timeout(120)
@pytest.mark.benchmark(group="control round trip")
def test_ring_round_trip_spin(benchmark: Any) -> None:
    """The ring with a 50 us spin on both ends before sleeping (latency-critical option)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("spinning on both ends needs two cores")
    _ring_round_trip(benchmark, "ctlring_roundtrip_spin50", 50.0)


def test_ratio_summary(capsys: Any) -> None:
    """Ratios of the medians measured above (same run); printed, not asserted."""
    base = _medians.get("ctlring_socket_roundtrip")
    if not base:
        pytest.skip("the socket baseline did not run")
    lines = [f"socket round trip p50 {base * 1e6:.2f} us"]
    for name in ("ctlring_roundtrip", "ctlring_roundtrip_spin50"):
        if name in _medians:
            v = _medians[name]
            lines.append(f"{name} p50 {v * 1e6:.2f} us = {v / base:.2f} x socket")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
