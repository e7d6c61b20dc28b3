"""The round trip's critical path, segment by segment, on one clock (a GPU machine).

Usage::

    python3 scripts/timeline_hot_path.py [--frames 3000] [--mib 1] [--rounds 3]

Both processes stamp ``time.perf_counter_ns()`` (``CLOCK_MONOTONIC``: one
clock for every process of the host) at a few points of each frame, and
the compiled socket calls are wrapped once each (about 0.1 us added per
call), so the segments add up to the untimed round trip within a few
microseconds (per-function timers would add ~1 us to each caller).  The same
is done for the socket + GPU floor (the comparison's ``socket_gpu_floor``
lane: the same fill and check kernels, a bare socket).  Prints, per segment,
the median over frames of each round, for the channel and the floor, and
which segments lie on the critical path (producer before its send, wake-up,
consumer between its receive and its send, wake-up, producer after).

What it is for (docs/performance.md): which side and which step of the
channel the distance to the floor is made of.  ``--ordered`` adds the ordered
floor (the floor plus the channel's four flag operations: what a channel with
no bookkeeping would measure), ``--slots`` sets the ring, ``--inner`` times the
calls inside the library's per-frame path.  Runs on a GPU machine; ``--help``
works anywhere.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

MiB = 1 << 20
SPAWN = mp.get_context("spawn")
WARMUP = 300
CLOCK = time.perf_counter_ns

#: Producer stamps, in order: start, after frame(), after array(), after the fill
#: launch, before the send call, after it, after publish(), after the with block,
#: when the wait that brought the release back returned, end of the frame.
P_STAMPS = ("start", "frame", "array", "fill", "send0", "send1", "pub", "exit", "back", "end")
#: Consumer stamps: the receive call returned, recv() returned, check launched,
#: before the release call, after it, release() returned.
C_STAMPS = ("recv1", "recv", "check", "rel0", "rel1", "done")

#: (label, from stamp, to stamp); "p."/"c." say whose.  Critical-path segments first.
SEGMENTS = [
    ("P acquire: pub.frame()", "p.start", "p.frame"),
    ("P frame.array()", "p.frame", "p.array"),
    ("P user fill launch", "p.array", "p.fill"),
    ("P publish() before its send", "p.fill", "p.send0"),
    ("P send call", "p.send0", "p.send1"),
    ("wake-up: P send -> C receive returned", "p.send1", "c.recv1"),
    ("C recv() after the receive", "c.recv1", "c.recv"),
    ("C user check launch", "c.recv", "c.check"),
    ("C release() before its call", "c.check", "c.rel0"),
    ("C release call (flag write + send)", "c.rel0", "c.rel1"),
    ("wake-up: C release -> P wait returned", "c.rel1", "p.back"),
    ("P poll() after the wait", "p.back", "p.end"),
    ("= round trip", "p.start", "p.end"),
    ("(off path) P publish() after its send", "p.send1", "p.pub"),
    ("(off path) P with-block exit", "p.pub", "p.exit"),
    ("(off path) C release() after its call", "c.rel1", "c.done"),
]
FLOOR_SEGMENTS = [
    ("P fill launch", "p.start", "p.fill"),
    ("P send", "p.fill", "p.send1"),
    ("wake-up: P send -> C receive returned", "p.send1", "c.recv1"),
    ("C check launch", "c.recv1", "c.check"),
    ("C reply send", "c.check", "c.rel1"),
    ("wake-up: C reply -> P receive returned", "c.rel1", "p.back"),
    ("P after its receive", "p.back", "p.end"),
    ("= round trip", "p.start", "p.end"),
]


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def _wrap(module: Any, name: str, before: list[int] | None, after: list[int] | None) -> None:
    """Make ``module.name`` stamp ``before``/``after`` (one slot each: the last call's)."""
    fn = getattr(module, name)

    def stamped(*args: Any) -> Any:
        if before is not None:
            before[0] = CLOCK()
        try:
            return fn(*args)
        finally:
            if after is not None:
                after[0] = CLOCK()

    setattr(module, name, stamped)


class _StampedSession:
    """The publisher's session (``PublisherSession``), its ``publish`` stamping
    ``before``/``after`` and its ``take`` ``back`` (one slot each: the last call's); the
    rest passed through."""

    def __init__(self, session: Any, before: list[int], after: list[int], back: list[int]) -> None:
        self._session, self._before, self._after, self._back = session, before, after, back

    def publish(self, *args: Any) -> Any:
        self._before[0] = CLOCK()
        try:
            return self._session.publish(*args)
        finally:
            self._after[0] = CLOCK()

    def take(self, *args: Any) -> Any:
        try:
            return self._session.take(*args)
        finally:
            self._back[0] = CLOCK()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


class _Inner:
    """Durations of calls inside the library's per-frame path (``--inner``).

    ``wrap(obj, name, label)`` replaces ``obj.name`` (an instance attribute, a
    bound method or a module function) by a wrapper that records each call's
    duration under ``label``; each wrapper adds ~0.1-0.2 us to its caller.
    """

    def __init__(self) -> None:
        self.times: dict[str, list[int]] = {}

    def wrap(self, obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)
        out = self.times.setdefault(label, [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = CLOCK()
            try:
                return fn(*args, **kwargs)
            finally:
                out.append(CLOCK() - t0)

        setattr(obj, name, timed)

    def medians(self) -> dict[str, float]:
        """p50 us per label over the calls after the warm-up (one call per frame assumed)."""
        return {k: statistics.median(v[WARMUP:]) / 1e3 for k, v in self.times.items() if v[WARMUP:]}


def _inner_consumer(inner: _Inner, sub: Any) -> None:
    from cupy_ipcpool.channel import _subscriber

    inner.wrap(sub._core, "next_view", "C next_view (incl. the receive)")
    inner.wrap(_subscriber, "frame_head", "C frame_head")
    inner.wrap(sub._peer, "_pin", "C peer._pin")
    inner.wrap(sub._peer, "_arrays_from_wire", "C peer._arrays_from_wire")
    inner.wrap(sub, "_stream_ptr", "C _stream_ptr")
    inner.wrap(sub, "_order", "C order (the frame flag's wait)")
    inner.wrap(_subscriber, "_Lease", "C _Lease()")
    inner.wrap(_subscriber, "Frame", "C Frame()")
    inner.wrap(sub._core, "release_with_write", "C core.release_with_write")


def _inner_producer(inner: _Inner, pub: Any) -> None:
    from cupy_ipcpool import _pool
    from cupy_ipcpool.channel import _publisher

    pool = pub._pool
    inner.wrap(pool, "acquire", "P pool.acquire")
    inner.wrap(_pool, "stream_ptr", "P stream_ptr")
    inner.wrap(pool._table, "_pick", "P table._pick (the slot pick)")
    inner.wrap(_pool, "SlotToken", "P SlotToken()")
    inner.wrap(pub._leases, "order_write", "P order_write")
    inner.wrap(pub._leases, "_order_all", "P order_all (the read flags' waits)")
    inner.wrap(_publisher, "PublishFrame", "P PublishFrame()")
    inner.wrap(pub, "_write_flag", "P frame-flag write")
    inner.wrap(pub._core, "publish", "P core.publish (incl. send)")
    inner.wrap(pub._leases, "collect", "P leases.collect (incl. the wait)")


# ------------------------------------------------------------------ the channel
def _recv_spin(s: socket.socket, n: int, spin_ns: int) -> bytes:
    """``s.recv(n)``, busy-polling up to ``spin_ns`` first (the floor's ``spin_us``)."""
    if spin_ns:
        end = CLOCK() + spin_ns
        while CLOCK() < end:
            try:
                return s.recv(n, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
    return s.recv(n)


def _counting(order: Any, counts: list[int]) -> Any:
    """``order``/``order_all`` that counts its calls and the GPU waits it enqueued."""

    def counted(*args: Any) -> Any:
        got = order(*args)
        counts[0] += 1
        counts[1] += int(got)
        return got

    return counted


def _channel_consumer(address: str, q: Any, cpu: int | None, spin_us: float, inner: bool) -> None:
    _pin(cpu)
    import cupy as cp

    import cupy_ipcpool as cip
    from cupy_ipcpool._bench.lanes import GpuWork
    from cupy_ipcpool.channel import _sockets as _session

    _session._load_frameio()
    recv1, rel0, rel1 = [0], [0], [0]
    _wrap(_session, "recv_frame", None, recv1)
    _wrap(_session, "release_frame", rel0, rel1)
    stream = cp.cuda.Stream(non_blocking=True)
    work = GpuWork(cp, 0, stream)
    rows: list[tuple[int, ...]] = []
    waits = [0, 0]
    with cip.subscribe(address, spin_us=spin_us) as sub:
        sub._order = _counting(sub._order, waits)  # type: ignore[union-attr]
        timers = _Inner()
        if inner:
            _inner_consumer(timers, sub)
        q.put("ready")
        while True:
            try:
                f = sub.recv(timeout=60, stream=stream)
            except cip.EndOfStream:
                break
            t_recv = CLOCK()
            a = f.arrays[0]
            work.enqueue_check(a, 7)
            t_check = CLOCK()
            f.release(stream=stream)
            t_done = CLOCK()
            del a, f
            rows.append((recv1[0], t_recv, t_check, rel0[0], rel1[0], t_done))
    stream.synchronize()
    q.put((rows, work.flush(), waits, timers.medians()))


def _channel_round(
    frames: int,
    mib: int,
    cpus: tuple[int, int] | None,
    spin_us: float,
    inner: bool = False,
    slots: int = 4,
) -> tuple[list[dict[str, int]], str]:
    _pin(cpus[0] if cpus else None)
    import cupy as cp

    import cupy_ipcpool as cip
    from cupy_ipcpool._bench.lanes import GpuWork

    send0, send1, back = [0], [0], [0]
    q = SPAWN.Queue()
    address = os.path.join(tempfile.mkdtemp(), "s")
    stream = cp.cuda.Stream(non_blocking=True)
    work = GpuWork(cp, 0, stream)
    nelem = mib * MiB // 4
    rows: list[tuple[int, ...]] = []
    waits = [0, 0]
    with (
        cip.IpcPool(slots, mib * MiB) as pool,
        cip.Publisher(pool, address, spin_us=spin_us) as pub,
    ):
        pub._leases._order_all = _counting(pub._leases._order_all, waits)
        core = pub._core
        core._session = _StampedSession(core._session, send0, send1, back)
        timers = _Inner()
        if inner:
            _inner_producer(timers, pub)
        p = SPAWN.Process(
            target=_channel_consumer,
            args=(address, q, cpus[1] if cpus else None, spin_us, inner),
        )
        p.start()
        assert q.get(timeout=120) == "ready"
        while not pub.subscribers:
            pub.poll(0.05)
        for _ in range(frames + WARMUP):
            t0 = CLOCK()
            with pub.frame(timeout=10, stream=stream) as f:
                t_frame = CLOCK()
                a = f.array((nelem,), cp.int32)
                t_array = CLOCK()
                work.fill(a, 7)
                t_fill = CLOCK()
                f.publish(a)
                t_pub = CLOCK()
                del a
            t_exit = CLOCK()
            while pub.leases(f.slot):
                pub.poll(None)
            t_end = CLOCK()
            rows.append(
                (t0, t_frame, t_array, t_fill, send0[0], send1[0], t_pub, t_exit, back[0], t_end)
            )
    cons, mismatches, c_waits, c_inner = q.get(timeout=120)
    p.join(30)
    if mismatches:
        raise SystemExit(f"channel: {mismatches} mismatching samples")
    note = (
        f"GPU waits enqueued: producer {waits[1]} in {waits[0]} acquires, "
        f"consumer {c_waits[1]} in {c_waits[0]} frames"
    )
    for label, us in {**timers.medians(), **c_inner}.items():
        note += f"\n    {label:44s} {us:6.2f}"
    return _merge(rows, cons), note


# ------------------------------------------------------------------ the floor
def _own_gpu(mib: int, *, zeroed: bool) -> tuple[Any, Any]:
    """The floor's GPU work on device 0, and its own int32 array of ``mib`` MiB."""
    import cupy as cp

    from cupy_ipcpool._bench.lanes import GpuWork

    stream = cp.cuda.Stream(non_blocking=True)
    work = GpuWork(cp, 0, stream)
    with stream:
        make = cp.zeros if zeroed else cp.empty
        arr = make(mib * MiB // 4, dtype=cp.int32)
    work.stream.synchronize()
    return work, arr


def _ring_flags(sync: Any, slots: int, work: Any) -> tuple[list[int], list[int], int]:
    """The ordered floor's flag addresses (frame flags, the one consumer's read flags) of a
    ring of ``slots``, and the raw handle of ``work``'s stream that orders on them."""
    frame_flags = [sync.frame_flag(i) for i in range(slots)]
    read_flags = [sync.read_flag(0, i) for i in range(slots)]
    return frame_flags, read_flags, work.stream.ptr


def _floor_consumer(
    path: str, mib: int, q: Any, cpu: int | None, spin_us: float, ordered: int = 0
) -> None:
    """The floor's consumer; ``ordered``: the ring's slots of the ordered floor (0: none)."""
    _pin(cpu)
    work, local = _own_gpu(mib, zeroed=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    sync = None
    if ordered:
        from cupy_ipcpool._bench.lanes import ring_position
        from cupy_ipcpool.channel._syncpage import SyncPage

        head, fds, _flags, _addr = socket.recv_fds(s, 16, 1)
        sync = SyncPage.import_fd(fds[0], int.from_bytes(head, "little"), ordered, 1, 0)
        os.close(fds[0])
        frame_flags, read_flags, sptr = _ring_flags(sync, ordered, work)
    reply = bytes(16)
    rows: list[tuple[int, ...]] = []
    spin_ns = int(spin_us * 1000)
    k = 0
    while True:
        msg = _recv_spin(s, 256, spin_ns)
        t_recv = CLOCK()
        if not msg:
            break
        if sync is not None:  # the channel's ordering: wait for the frame, then say "read"
            slot, gen = ring_position(k, ordered)
            sync.order(sptr, frame_flags[slot], gen)
            work.enqueue_check(local, 0)
            sync.write(sptr, read_flags[slot], gen)
        else:
            work.enqueue_check(local, 0)
        t_check = CLOCK()
        s.send(reply)
        t_sent = CLOCK()
        rows.append((t_recv, t_recv, t_check, t_check, t_sent, t_sent))
        k += 1
    s.close()
    work.stream.synchronize()
    if sync is not None:
        sync.close()
    q.put((rows, work.flush()))


def _floor_round(
    frames: int, mib: int, cpus: tuple[int, int] | None, spin_us: float, ordered: int = 0
) -> list[dict[str, int]]:
    """The floor's round trips; ``ordered`` (a ring size): with the channel's four flag operations.

    The ordered floor is the floor plus the channel's GPU ordering and
    nothing else: a sync page shared as the channel shares it, the producer's
    stream ordered after the read flag of the slot's previous use before its
    fill and writing the frame flag after it, the consumer's stream ordered
    after the frame flag before its check and writing the read flag after it
    (each through ``SyncPage.order`` / ``write``, host look included).  It is
    what a channel with no bookkeeping at all would measure.
    """
    _pin(cpus[0] if cpus else None)
    q = SPAWN.Queue()
    path = os.path.join(tempfile.mkdtemp(), "f")
    work, arr = _own_gpu(mib, zeroed=False)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    p = SPAWN.Process(
        target=_floor_consumer,
        args=(path, mib, q, cpus[1] if cpus else None, spin_us, ordered),
    )
    spin_ns = int(spin_us * 1000)
    p.start()
    conn, _ = listener.accept()
    sync = None
    if ordered:
        from cupy_ipcpool._bench.lanes import ring_position
        from cupy_ipcpool.channel._syncpage import SyncPage

        sync = SyncPage.create(ordered, 1, 0)
        socket.send_fds(conn, [sync.nbytes.to_bytes(8, "little")], [sync.fd])
        frame_flags, read_flags, sptr = _ring_flags(sync, ordered, work)
    msg = bytes(96)
    rows: list[tuple[int, ...]] = []
    for k in range(frames + WARMUP):
        t0 = CLOCK()
        if sync is not None:  # the channel's ordering: the slot read, then "written"
            slot, gen = ring_position(k, ordered)
            if gen > 1:
                sync.order(sptr, read_flags[slot], gen - 1)
            work.fill(arr, 7)
            sync.write(sptr, frame_flags[slot], gen)
        else:
            work.fill(arr, 7)
        t_fill = CLOCK()
        conn.send(msg)
        t_sent = CLOCK()
        _recv_spin(conn, 64, spin_ns)
        t_back = CLOCK()
        rows.append((t0, t0, t0, t_fill, t_fill, t_sent, t_sent, t_sent, t_back, t_back))
    conn.close()
    listener.close()
    cons, mismatches = q.get(timeout=120)
    p.join(30)
    if sync is not None:
        work.stream.synchronize()
        sync.close()
    if mismatches:
        raise SystemExit(f"floor: {mismatches} mismatching samples")
    return _merge(rows, cons)


def _merge(prod: list[tuple[int, ...]], cons: list[tuple[int, ...]]) -> list[dict[str, int]]:
    """One dict of named stamps per frame after the warm-up (one frame in flight: i <-> i)."""
    out = []
    for p_row, c_row in list(zip(prod, cons, strict=True))[WARMUP:]:
        d = {f"p.{k}": v for k, v in zip(P_STAMPS, p_row, strict=True)}
        d.update({f"c.{k}": v for k, v in zip(C_STAMPS, c_row, strict=True)})
        out.append(d)
    return out


def _medians(frames: list[dict[str, int]], segments: list[tuple[str, str, str]]) -> list[float]:
    return [statistics.median(f[b] - f[a] for f in frames) / 1e3 for _, a, b in segments]


def _row(label: str, xs: list[float]) -> str:
    cells = "  ".join(f"{x:6.1f}" for x in xs)
    return f"{label:44s} {cells}  {statistics.median(xs):6.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=3000)
    ap.add_argument("--mib", type=int, default=1)
    ap.add_argument(
        "--rounds", type=int, default=3, help="channel and floor (and ordered floor) alternating"
    )
    ap.add_argument("--cpus", default="2,4", help="producer,consumer CPUs ('' = no pinning)")
    ap.add_argument(
        "--spin-us",
        type=float,
        default=0.0,
        help="both ends busy-poll this long before they sleep (channel: spin_us; floor: "
        "MSG_DONTWAIT receives); 0: they sleep at once, as by default",
    )
    ap.add_argument("--slots", type=int, default=4, help="the ring (channel, ordered floor)")
    ap.add_argument(
        "--ordered",
        action="store_true",
        help="also run the ordered floor: the floor plus the channel's four flag operations "
        "(what a channel without bookkeeping would measure)",
    )
    ap.add_argument(
        "--inner",
        action="store_true",
        help="also time calls inside the library's per-frame path (p50 per round; adds "
        "~0.1-0.2 us per wrapped call to the segments)",
    )
    args = ap.parse_args()
    cpus: tuple[int, int] | None = None
    if args.cpus:
        first, second = (int(c) for c in args.cpus.split(","))
        cpus = (first, second)
    chan: list[list[float]] = []
    floor: list[list[float]] = []
    ordered: list[list[float]] = []
    for r in range(args.rounds):
        frames, note = _channel_round(
            args.frames, args.mib, cpus, args.spin_us, args.inner, args.slots
        )
        chan.append(_medians(frames, SEGMENTS))
        floor_frames = _floor_round(args.frames, args.mib, cpus, args.spin_us)
        floor.append(_medians(floor_frames, FLOOR_SEGMENTS))
        rt_chan, rt_floor = chan[-1][12], floor[-1][-1]
        line = f"round {r}: channel {rt_chan:.1f} us, floor {rt_floor:.1f} us"
        if args.ordered:
            ordered_frames = _floor_round(args.frames, args.mib, cpus, args.spin_us, args.slots)
            ordered.append(_medians(ordered_frames, FLOOR_SEGMENTS))
            line += f", ordered floor {ordered[-1][-1]:.1f} us"
        print(f"{line}; {note}", flush=True)
    head = "  ".join(f"r{r:<5d}" for r in range(args.rounds))
    spin = f", both ends spin {args.spin_us:g} us" if args.spin_us else ""
    spin += f", {args.slots} slots"
    print(f"\n== channel, {args.mib} MiB{spin}, p50 us per segment (rounds)")
    print(f"{'segment':44s} {head}  median")
    for i, (label, _, _) in enumerate(SEGMENTS):
        print(_row(label, [c[i] for c in chan]))
    print(f"\n== socket + GPU floor, {args.mib} MiB{spin}")
    for i, (label, _, _) in enumerate(FLOOR_SEGMENTS):
        print(_row(label, [c[i] for c in floor]))
    if ordered:
        print(f"\n== ordered floor (the floor + the four flag operations), {args.mib} MiB{spin}")
        for i, (label, _, _) in enumerate(FLOOR_SEGMENTS):
            print(_row(label, [c[i] for c in ordered]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
