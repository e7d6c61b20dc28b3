"""What the per-frame primitives cost on this machine (host time, µs).

Usage::

    python3 scripts/hotpath_primitives.py            # needs a GPU for part A's memops

Part B runs first (before CUDA is touched, it forks): two processes ping-pong
a 64-byte ``SOCK_SEQPACKET`` message, 3,000 rounds after 300 warm-up rounds,
each way of waiting in turn:

* ``blocking``: blocking ``recv`` / ``send`` (what the floor lanes do);
* ``poll+recv``: a non-blocking socket, ``poll(-1)`` then ``recv_into`` (what
  the channel does when it has to wait);
* ``poll+recv+2 poll(0)``: as the channel's subscriber, with the two hang-up
  checks per frame (socket and a pidfd);
* ``spin socket 200us``: ``recv`` with ``MSG_DONTWAIT`` in a loop for up to
  200 µs, then ``poll`` (the channel's ``spin_us``);
* ``spin doorbell 200us``: the sender bumps a counter in shared memory after
  each ``send``; the receiver watches the counter (no system call) for up to
  200 µs, then ``recv`` (falls back to ``poll`` when it runs out).

Part A times single calls in one process: a Python call, ``poll(0)``, a
failing ``recv``, ``send``, ``time.monotonic``, a lock, and the stream memory
operations through ``cuda.bindings`` and through ``cupy_ipcpool._fastpath``.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import statistics
import struct
import sys
import threading
import time

ROUNDS = 3000
WARM = 300
SPIN_NS = 200_000


def _wait_blocking(sock: socket.socket, buf: bytearray, st: dict) -> int:
    return sock.recv_into(buf)


def _wait_poll(sock: socket.socket, buf: bytearray, st: dict) -> int:
    st["poller"].poll(-1)
    return sock.recv_into(buf)


def _wait_poll_checks(sock: socket.socket, buf: bytearray, st: dict) -> int:
    st["poller"].poll(-1)
    n = sock.recv_into(buf)
    st["hangup"].poll(0)
    st["hangup"].poll(0)
    return n


def _wait_spin_socket(sock: socket.socket, buf: bytearray, st: dict) -> int:
    end = time.perf_counter_ns() + SPIN_NS
    while True:
        try:
            return sock.recv_into(buf, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            if time.perf_counter_ns() > end:
                break
    st["poller"].poll(-1)
    return sock.recv_into(buf)


def _wait_spin_doorbell(sock: socket.socket, buf: bytearray, st: dict) -> int:
    bell, idx = st["bell"], st["in"]
    seen = st["seen"]
    end = time.perf_counter_ns() + SPIN_NS
    while bell[idx] <= seen:  # the peer bumps after its send: never ahead of the data
        if time.perf_counter_ns() > end:
            st["poller"].poll(-1)
            break
    st["seen"] = seen + 1
    return sock.recv_into(buf)


VARIANTS = {
    "blocking": (_wait_blocking, True),
    "poll+recv": (_wait_poll, False),
    "poll+recv+2 poll(0)": (_wait_poll_checks, False),
    "spin socket 200us": (_wait_spin_socket, False),
    "spin doorbell 200us": (_wait_spin_doorbell, False),
}


def _side(sock: socket.socket, name: str, bell: memoryview, me: int, peer_pid: int, first: bool):
    wait, blocking = VARIANTS[name]
    sock.setblocking(blocking)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    hangup = select.poll()
    hangup.register(sock, 0)
    try:
        pidfd = os.pidfd_open(peer_pid)
        hangup.register(pidfd, select.POLLIN)
    except (AttributeError, OSError):
        pidfd = -1
    st = {"poller": poller, "hangup": hangup, "bell": bell, "in": 1 - me, "seen": 0}
    buf = bytearray(256)
    msg = b"x" * 64
    out = []
    for i in range(ROUNDS + WARM):
        if first:
            t0 = time.perf_counter_ns()
            sock.send(msg)
            bell[me] += 1
            wait(sock, buf, st)
            if i >= WARM:
                out.append(time.perf_counter_ns() - t0)
        else:
            wait(sock, buf, st)
            sock.send(msg)
            bell[me] += 1
    if pidfd >= 0:
        os.close(pidfd)
    return out


def part_b() -> list[str]:
    """Each variant in a fresh interpreter (nothing left over from the one before)."""
    import subprocess

    lines = ["== B: ping-pong round trip between two processes (64-byte SEQPACKET), µs"]
    for name in VARIANTS:
        res = subprocess.run(
            [sys.executable, __file__, "--variant", name], capture_output=True, text=True
        )
        lines.append(res.stdout.rstrip() or f"  {name}: failed: {res.stderr.strip()[-300:]}")
    return lines


def one_variant(name: str) -> str:
    """One ping-pong variant between this process and a forked child; its p50/p99 line."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    bell_fd = os.memfd_create("bell")
    os.ftruncate(bell_fd, 4096)
    mm = mmap.mmap(bell_fd, 4096)
    os.close(bell_fd)
    bell = memoryview(mm).cast("Q")
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        a.close()
        _side(b, name, bell, 1, parent, first=False)
        os._exit(0)
    b.close()
    out = _side(a, name, bell, 0, pid, first=True)
    os.waitpid(pid, 0)
    a.close()
    out.sort()
    return (
        f"  {name:24s} p50 {statistics.median(out) / 1e3:7.2f}  "
        f"p99 {out[int(0.99 * (len(out) - 1))] / 1e3:7.2f}"
    )


def _time(fn, n: int = 20000) -> float:
    for _ in range(200):
        fn()
    best = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best.append((time.perf_counter_ns() - t0) / n / 1e3)
    return statistics.median(best)


def part_a() -> list[str]:
    lines = ["== A: single calls in one process, µs per call (median of 5 batches)"]

    def nothing() -> None:
        pass

    lines.append(f"  python call                 {_time(nothing):.3f}")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setblocking(False)
    b.setblocking(False)
    hang = select.poll()
    hang.register(a, 0)
    pidfd = os.pidfd_open(os.getpid())
    lines.append(f"  poll(0), 1 fd               {_time(lambda: hang.poll(0)):.3f}")
    hang.register(pidfd, select.POLLIN)
    lines.append(f"  poll(0), socket + pidfd     {_time(lambda: hang.poll(0)):.3f}")
    buf = bytearray(256)

    def fail_recv() -> None:
        try:  # noqa: SIM105 - the try statement is what the channel pays
            a.recv_into(buf)
        except BlockingIOError:
            pass

    lines.append(f"  recv_into -> EAGAIN         {_time(fail_recv):.3f}")
    msg = b"x" * 64

    def send_recv() -> None:
        a.send(msg)
        b.recv_into(buf)

    lines.append(f"  send + recv (same process)  {_time(send_recv):.3f}")
    lines.append(f"  time.monotonic              {_time(time.monotonic):.3f}")
    lock = threading.Lock()

    def locked() -> None:
        with lock:
            pass

    lines.append(f"  with Lock                   {_time(locked):.3f}")
    pack = struct.Struct("<IIII").pack
    lines.append(f"  struct.pack 4 fields        {_time(lambda: pack(1, 2, 3, 4)):.3f}")
    lines.append(f"  sys.getrefcount            {_time(lambda: sys.getrefcount(buf)):.3f}")

    import cupy
    from cuda.bindings import driver

    from cupy_ipcpool import _fastpath

    cupy.cuda.Device(0).use()
    s = cupy.cuda.Stream(non_blocking=True)
    flags = cupy.zeros(64, dtype=cupy.uint32)
    cupy.cuda.Device().synchronize()
    addr = flags.data.ptr
    sp = s.ptr
    geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    plain = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
    n = {"i": 0}

    def every(fn):
        def run() -> None:
            fn()
            n["i"] += 1
            if n["i"] % 2000 == 0:
                s.synchronize()

        return run

    lines.append(
        "  binding cuStreamWriteValue32 "
        f"{_time(every(lambda: driver.cuStreamWriteValue32(sp, addr, 0, plain)), 4000):.3f}"
    )
    lines.append(
        "  binding cuStreamWaitValue32  "
        f"{_time(every(lambda: driver.cuStreamWaitValue32(sp, addr, 0, geq)), 4000):.3f}"
    )
    ver = driver.cuDriverGetVersion()[1]
    res = driver.cuGetProcAddress(b"cuStreamWriteValue32", min(ver, 12000), 0)
    wfn = int(res[1])
    res = driver.cuGetProcAddress(b"cuStreamWaitValue32", min(ver, 12000), 0)
    vfn = int(res[1])
    iplain, igeq = int(plain), int(geq)
    memop = _fastpath.memop
    lines.append(
        "  _fastpath write              "
        f"{_time(every(lambda: memop(wfn, sp, addr, 0, iplain)), 4000):.3f}"
    )
    lines.append(
        "  _fastpath wait               "
        f"{_time(every(lambda: memop(vfn, sp, addr, 0, igeq)), 4000):.3f}"
    )
    # correctness: a write then a read back
    memop(wfn, sp, addr + 4, 12345, iplain)
    s.synchronize()
    lines.append(f"  _fastpath write landed: {int(flags[1].get()) == 12345}")
    cs = cupy.cuda.get_current_stream

    lines.append(f"  cupy get_current_stream().ptr {_time(lambda: cs().ptr):.3f}")
    return lines


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--variant":
        print(one_variant(sys.argv[2]))
        return
    lines = part_b()
    print("\n".join(lines), flush=True)
    a = part_a()
    print("\n".join(a), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "primitives.txt"), "w") as fh:
            fh.write("\n".join(lines + a) + "\n")


if __name__ == "__main__":
    main()
