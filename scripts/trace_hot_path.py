"""Inclusive host time of every function on the per-frame path, on a GPU machine.

Usage::

    python3 scripts/trace_hot_path.py [--frames 2000] [--mib 1]

Wraps each function named in :data:`PRODUCER` / :data:`CONSUMER` with a timer
(``perf_counter_ns`` before and after; about 0.1-0.3 us added per wrapped
call, which nested callers include) and runs the round-trip loop of
``scripts/profile_hot_path.py`` (one frame in flight, 1 MiB, raw kernels).
Prints, per function, the calls per frame and the median and p90 inclusive
time per call, for both processes.  ``TRACE_SPIN_US=N`` gives both ends
``spin_us=N`` (also in ``scripts/ab_hot_path.py``, which runs this loop).
What it is for: finding which layer of the per-frame path the time goes to,
before changing it
(docs/performance.md, section 5).
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from timeline_hot_path import _counting  # the wait counter of the compiled calls too

MiB = 1 << 20
SPAWN = mp.get_context("spawn")

#: (module, qualified name) of what is timed in the producer.
PRODUCER = [
    ("cupy_ipcpool.channel._publisher", "Publisher.frame"),
    ("cupy_ipcpool.channel._publisher", "Publisher._acquire"),
    ("cupy_ipcpool._pool", "IpcPool.acquire"),
    ("cupy_ipcpool._pool", "stream_ptr"),
    ("cupy_ipcpool._slots", "SlotTable.take"),
    ("cupy_ipcpool._slots", "SlotTable._pick"),
    ("cupy_ipcpool._pool", "SlotToken.__init__"),
    ("cupy_ipcpool.channel._publisher", "_PublisherLeases.order_write"),
    ("cupy_ipcpool.channel._publisher", "_PublisherLeases.leases"),
    ("cupy_ipcpool.channel._leases", "LeaseBook.readers_to_wait"),
    ("cupy_ipcpool.channel._syncpage", "SyncPage.order_all"),
    ("cupy_ipcpool.channel._syncpage", "SyncPage.wait"),
    ("cupy_ipcpool.channel._publisher", "PublishFrame.__init__"),
    ("cupy_ipcpool.channel._publisher", "PublishFrame.array"),
    ("cupy_ipcpool._pool", "SlotToken.array"),
    ("cupy_ipcpool._pool", "IpcPool._arena_array"),
    ("cupy_ipcpool._pool", "normalize_dtype"),
    ("cupy_ipcpool._pool", "normalize_shape"),
    ("cupy_ipcpool.channel._publisher", "PublishFrame.publish"),
    ("cupy_ipcpool.channel._publisher", "Publisher.publish"),
    ("cupy_ipcpool.channel._publisher", "stream_ptr"),
    ("cupy_ipcpool.channel._syncpage", "SyncPage.write"),
    ("cupy_ipcpool.channel._session", "PublisherCore.publish"),
    ("cupy_ipcpool.channel._session", "send_frame"),
    ("cupy_ipcpool.channel._leases", "LeaseBook.publishing"),
    ("cupy_ipcpool.channel._publisher", "Publisher._end_write"),
    ("cupy_ipcpool._pool", "SlotToken.release"),
    ("cupy_ipcpool.channel._publisher", "PublishFrame.__exit__"),
    ("cupy_ipcpool.channel._publisher", "Publisher.poll"),
    ("cupy_ipcpool.channel._publisher", "Publisher.leases"),
    ("cupy_ipcpool.channel._session", "PublisherCore.poll"),
    ("cupy_ipcpool.channel._session", "PublisherCore._wait"),
    ("cupy_ipcpool.channel._session", "wait_releases"),
    ("cupy_ipcpool.channel._protocol", "decode"),
    ("cupy_ipcpool.channel._leases", "LeaseBook.release"),
    ("cupy_ipcpool._pool", "IpcPool.notify_released"),
]

#: The same for the consumer.
CONSUMER = [
    ("cupy_ipcpool.channel._subscriber", "Subscriber.recv"),
    ("cupy_ipcpool._peer", "PeerPool.drop_idle_owners"),
    ("cupy_ipcpool.channel._session", "SubscriberCore.recv_view"),
    ("cupy_ipcpool.channel._session", "recv_frame"),
    ("cupy_ipcpool.channel._session", "SubscriberCore._accept"),
    ("cupy_ipcpool.channel._protocol", "decode"),
    ("cupy_ipcpool._peer", "PeerPool.pin"),
    ("cupy_ipcpool._peer", "PeerPool.arrays_from_wire"),
    ("cupy_ipcpool.channel._subscriber", "_Lease.__init__"),
    ("cupy_ipcpool.channel._subscriber", "stream_ptr"),
    ("cupy_ipcpool.channel._subscriber", "_StreamsInUse.note"),
    ("cupy_ipcpool.channel._syncpage", "SyncPage.order"),
    ("cupy_ipcpool.channel._subscriber", "Frame.__init__"),
    ("cupy_ipcpool.channel._subscriber", "Frame.release"),
    ("cupy_ipcpool.channel._subscriber", "_Lease.release"),
    ("cupy_ipcpool.channel._subscriber", "Subscriber._release"),
    ("cupy_ipcpool.channel._session", "SubscriberCore.release_with_write"),
    ("cupy_ipcpool.channel._session", "release_frame"),
]


class Timings:
    """Per wrapped function: every call's inclusive time, and a frame counter."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = {}
        self.on = False
        self.frames = 0

    def wrap(self, module: str, qualname: str) -> None:
        mod = importlib.import_module(module)
        owner: Any = mod
        parts = qualname.split(".")
        for part in parts[:-1]:
            owner = getattr(owner, part)
        name = parts[-1]
        fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        label = f"{qualname}" if "." in qualname else f"{module.rsplit('.', 1)[-1]}.{qualname}"
        times = self.calls.setdefault(label, [])
        clock = time.perf_counter_ns
        state = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not state.on:
                return fn(*args, **kwargs)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                times.append(clock() - t0)

        timed.__name__ = getattr(fn, "__name__", name)
        setattr(owner, name, timed)

    def table(self) -> str:
        rows = [f"{'function':44s} {'calls/frame':>11s} {'p50 us':>8s} {'p90 us':>8s}"]
        for label, xs in self.calls.items():
            if not xs:
                continue
            s = sorted(xs)
            rows.append(
                f"{label:44s} {len(xs) / max(self.frames, 1):11.2f} "
                f"{statistics.median(s) / 1e3:8.2f} {s[int(0.9 * (len(s) - 1))] / 1e3:8.2f}"
            )
        return "\n".join(rows)


def _wrap_all(spec: list[tuple[str, str]]) -> Timings:
    t = Timings()
    for module, qualname in spec:
        t.wrap(module, qualname)
    return t


def _spin_us() -> float:
    """Both ends' ``spin_us`` (``TRACE_SPIN_US``; default 0: they sleep at once)."""
    return float(os.environ.get("TRACE_SPIN_US", "0"))


def _pin(cpu: int | None) -> None:
    """Run this process on one CPU (None: leave it to the scheduler)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def _spinning_order(order: Any, flags: Any, base: int, spin_ns: int, counts: list[int]) -> Any:
    """``order`` that first watches the flag on the host for up to ``spin_ns`` (an experiment).

    ``counts``: [calls, GPU waits enqueued].
    """
    clock = time.perf_counter_ns

    def spun(stream: int, addr: int, value: int) -> bool:
        counts[0] += 1
        end = clock() + spin_ns
        while not flags.reached(addr - base, value) and clock() < end:
            pass
        waited = order(stream, addr, value)
        counts[1] += waited
        return waited

    return spun


def _consumer(address: str, q: Any, cpu: int | None = None, timed: bool = True) -> None:
    _pin(cpu)
    import cupy as cp

    timings = _wrap_all(CONSUMER) if timed else Timings()
    import cupy_ipcpool as cip
    from cupy_ipcpool._bench.lanes import GpuWork

    stream = cp.cuda.Stream(non_blocking=True)
    work = GpuWork(cp, 0, stream)
    n = 0
    # experiment: TRACE_ORDER_SPIN_US=N makes recv watch the frame flag on the host
    # for up to N us before it asks the stream to wait (counts the waits either way)
    spin_ns = int(float(os.environ.get("TRACE_ORDER_SPIN_US", "0")) * 1000)
    counts = [0, 0]
    with cip.subscribe(address, spin_us=_spin_us()) as sub:
        sync = sub._sync
        sub._order = _spinning_order(sub._order, sync.flags, sync._base, spin_ns, counts)
        if spin_ns:  # the experiment needs recv's Python path, which orders through _order
            sub._take_frame = lambda *args: None
        else:  # count the compiled assembly's waits too
            sub._take_frame = _counting(sub._take_frame, counts, 3)
        q.put("ready")
        while True:
            try:
                f = sub.recv(timeout=60, stream=stream)
            except cip.EndOfStream:
                break
            a = f.arrays[0]
            work.enqueue_check(a, 7)
            f.release(stream=stream)
            del a, f
            n += 1
            if n == 200:
                timings.on = timed
                counts[:] = [0, 0]
            if n > 200:
                timings.frames += 1
    stream.synchronize()
    waits = (
        f"consumer GPU waits enqueued: {counts[1]} of {counts[0]} (host spin {spin_ns // 1000} us)"
    )
    q.put((timings.table() + "\n" + waits, work.flush()))


def _producer(
    frames: int, mib: int, timed: bool, cpus: tuple[int, int] | None = None
) -> tuple[str, str, float]:
    """The round-trip loop; ``cpus``: pin the producer and the consumer to these CPUs."""
    _pin(cpus[0] if cpus else None)
    import cupy as cp

    timings = _wrap_all(PRODUCER) if timed else Timings()
    import cupy_ipcpool as cip
    from cupy_ipcpool._bench.lanes import GpuWork

    q = SPAWN.Queue()
    address = os.path.join(tempfile.mkdtemp(), "s")
    stream = cp.cuda.Stream(non_blocking=True)
    work = GpuWork(cp, 0, stream)
    nelem = mib * MiB // 4
    total: list[int] = []
    with (
        cip.IpcPool(4, mib * MiB) as pool,
        cip.Publisher(pool, address, spin_us=_spin_us()) as pub,
    ):
        p = SPAWN.Process(target=_consumer, args=(address, q, cpus[1] if cpus else None, timed))
        p.start()
        assert q.get(timeout=120) == "ready"
        while not pub.subscribers:
            pub.poll(0.05)
        for i in range(frames + 200):
            if i == 200:
                timings.on = timed
            t0 = time.perf_counter_ns()
            with pub.frame(timeout=10, stream=stream) as f:
                a = f.array((nelem,), cp.int32)
                work.fill(a, 7)
                f.publish(a)
                del a
            while pub.leases(f.slot):
                pub.poll(None)
            if i >= 200:
                total.append(time.perf_counter_ns() - t0)
                timings.frames += 1
        timings.on = False
    cons_table, mismatches = q.get(timeout=120)
    p.join(30)
    stream.synchronize()
    rt = statistics.median(total) / 1e3
    head = (
        f"round trip p50 {rt:.1f} us; mismatching samples {mismatches}; "
        + cons_table.rsplit("\n", 1)[-1]
    )
    return head, timings.table() + "\n--- consumer\n" + cons_table, rt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=2000)
    ap.add_argument("--mib", type=int, default=1)
    ap.add_argument(
        "--spin-rounds",
        type=int,
        default=0,
        help="the host-watch experiment: this many rounds of TRACE_ORDER_SPIN_US 0 and "
        "--spin-us alternating, untimed, at 1 MiB and --mib; the round trip and the "
        "consumer's GPU waits of each",
    )
    ap.add_argument("--spin-us", type=float, default=20.0)
    args = ap.parse_args()
    if args.spin_rounds:
        sizes = sorted({1, args.mib})
        for r in range(args.spin_rounds):
            for mib in sizes:
                for spin in (0.0, args.spin_us):
                    os.environ["TRACE_ORDER_SPIN_US"] = str(spin)
                    head, _, _ = _producer(args.frames, mib, timed=False)
                    print(f"round {r} {mib:5d} MiB host watch {spin:5.1f} us: {head}", flush=True)
        return 0
    head, _, _ = _producer(args.frames, args.mib, timed=False)
    print(f"== untimed: {head}")
    head, table, _ = _producer(args.frames, args.mib, timed=True)
    print(f"== timed (each wrapper adds its own cost to its callers): {head}")
    print("--- producer")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
