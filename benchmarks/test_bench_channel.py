"""Channel benchmarks: round trip, throughput, fan-out, and the bare-socket floor beside them.

Round trip = publish -> the consumer holds the array -> release -> the
producer sees the lease back, timed on the producer's host with trivial
kernels (the frame size must not matter: no byte is copied).
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import time

import pytest
from conftest import record_value

import cupy_ipcpool as cip

MiB = 1 << 20
SPAWN = mp.get_context("spawn")
ROUNDS = 2000
WARMUP = 200


def _echo_consumer(address, ready):
    import cupy as cp

    with cip.subscribe(address) as sub:
        ready.put("ready")
        for frame in sub:
            frame.array[:1] += 1  # touch the frame on the GPU (trivial kernel)
            frame.release()
    cp.cuda.get_current_stream().synchronize()


def _start_consumers(address, n):
    ready = SPAWN.Queue()
    procs = [SPAWN.Process(target=_echo_consumer, args=(address, ready)) for _ in range(n)]
    for p in procs:
        p.start()
    for _ in procs:
        assert ready.get(timeout=120) == "ready"
    return procs


def _round_trips(pub, rounds, shape):
    import cupy as cp

    times = []
    for i in range(rounds + WARMUP):
        t0 = time.perf_counter_ns()
        with pub.frame(timeout=10) as f:
            a = f.array(shape, cp.uint8)
            a[:1] = 1  # trivial producer kernel
            f.publish(a)
        del a
        slot = f.slot
        while pub.leases(slot):
            pub.poll(None)
        if i >= WARMUP:
            times.append(time.perf_counter_ns() - t0)
    return times


def _summary(times):
    times = sorted(times)
    return statistics.median(times) / 1e9, times[int(0.99 * (len(times) - 1))] / 1e9


@pytest.mark.parametrize("mib", [1, 64, 256])
def test_round_trip(tmp_path, mib):
    address = str(tmp_path / "rt.sock")
    with cip.IpcPool(4, mib * MiB) as pool, cip.Publisher(pool, address) as pub:
        procs = _start_consumers(address, 1)
        while len(pub.subscribers) < 1:
            pub.poll(0.05)
        times = _round_trips(pub, ROUNDS, (mib * MiB,))
    for p in procs:
        p.join(30)
    p50, p99 = _summary(times)
    record_value(f"roundtrip_p50_{mib}MiB", p50)
    record_value(f"roundtrip_p99_{mib}MiB", p99)


@pytest.mark.parametrize("mib", [1, 64, 256])
def test_throughput(tmp_path, mib):
    import cupy as cp

    address = str(tmp_path / "tp.sock")
    n = 10_000
    with cip.IpcPool(8, mib * MiB) as pool, cip.Publisher(pool, address) as pub:
        procs = _start_consumers(address, 1)
        while len(pub.subscribers) < 1:
            pub.poll(0.05)
        for phase in ("warmup", "measure"):
            count = 1000 if phase == "warmup" else n
            t0 = time.perf_counter()
            for _ in range(count):
                with pub.frame(timeout=10) as f:
                    a = f.array((mib * MiB,), cp.uint8)
                    a[:1] = 1
                    f.publish(a)
                del a
            while any(pub.leases(s) for s in range(pool.num_slots)):
                pub.poll(None)
            elapsed = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    record_value(f"throughput_fps_{mib}MiB", n / elapsed)  # frames per second (not seconds)


@pytest.mark.parametrize("fan", [1, 2, 4, 8])
def test_fan_out(tmp_path, fan):
    address = str(tmp_path / "fan.sock")
    with cip.IpcPool(4, 1 * MiB) as pool, cip.Publisher(pool, address) as pub:
        procs = _start_consumers(address, fan)
        while len(pub.subscribers) < fan:
            pub.poll(0.05)
        times = _round_trips(pub, 1000, (MiB,))
    for p in procs:
        p.join(30)
    p50, p99 = _summary(times)
    record_value(f"fanout_p50_{fan}", p50)
    record_value(f"fanout_p99_{fan}", p99)


def _echo_socket(sock):
    while True:
        data = sock.recv(256)
        if not data:
            return
        sock.send(data[:16])


def test_bare_socket_floor():
    """A bare SOCK_SEQPACKET round trip of the same size as a frame message (floor)."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = SPAWN.Process(target=_echo_socket, args=(child,))
    proc.start()
    child.close()
    msg = bytes(80)  # FRAME header + one 1-D array handle + event index
    times = []
    for i in range(ROUNDS + WARMUP):
        t0 = time.perf_counter_ns()
        parent.send(msg)
        parent.recv(256)
        if i >= WARMUP:
            times.append(time.perf_counter_ns() - t0)
    parent.close()
    proc.join(30)
    p50, p99 = _summary(times)
    record_value("socket_floor_p50", p50)
    record_value("socket_floor_p99", p99)
