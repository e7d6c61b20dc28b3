"""Where a frame's host time goes, per step and per function, on a GPU machine.

Usage::

    python3 scripts/profile_hot_path.py     # prints a table; $OUT/profile_*.txt if OUT is set
    python3 scripts/profile_hot_path.py --frames 3000 --no-profile

Producer and consumer run the comparison lanes' GPU work (the ``cipbench_fill``
and ``cipbench_check`` raw kernels, on one created stream per process), so the
figures hold the library's cost and one raw launch per side, not CuPy's
elementwise machinery.  Three loops:

* ``rt``: round trip, one frame in flight (the producer waits for the lease);
* ``stream``: the producer publishes as fast as slots come back (8 slots);
* ``profile``: ``rt`` again under ``cProfile`` in both processes (the top
  functions by own time go to ``$OUT/profile_producer.txt`` / ``_consumer.txt``).

``--ahead``: every loop with frames handed out ahead (``Publisher(ahead=True)``,
``subscribe(mode="ahead", depth=1)``); the profiles are ``profile_*_ahead.txt``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import tempfile
import time

MiB = 1 << 20
SPAWN = mp.get_context("spawn")


def _med(xs: list[int]) -> float:
    return statistics.median(xs) / 1e3 if xs else float("nan")


def _p99(xs: list[int]) -> float:
    xs = sorted(xs)
    return xs[int(0.99 * (len(xs) - 1))] / 1e3 if xs else float("nan")


def _profile_text(prof: cProfile.Profile | None) -> str:
    """The top functions by own and by cumulative time ("" without a profile)."""
    if prof is None:
        return ""
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumulative").print_stats(45)
    return buf.getvalue()


def _summary(steps: dict[str, list[int]]) -> dict[str, tuple[float, float]]:
    return {k: (_med(v), _p99(v)) for k, v in steps.items()}


def _count_waits(obj: object, attr: str) -> list[int]:
    """Wrap ``obj.attr`` (a bound ``SyncPage.order``, or ``order_all`` when ``attr``
    ends so): count the flags it was given and the GPU waits it enqueued."""
    counts = [0, 0]
    order = getattr(obj, attr)

    def counted(stream: int, addr: int, value: int) -> bool:
        waited = order(stream, addr, value)
        counts[0] += 1
        counts[1] += waited
        return waited

    def counted_all(stream: int, addrs: list[int], value: int) -> int:
        waited = order(stream, addrs, value)
        counts[0] += len(addrs)
        counts[1] += waited
        return waited

    setattr(obj, attr, counted_all if attr.endswith("_all") else counted)
    return counts


def _consumer(address: str, frames: int, profile: bool, q, spin: float, ahead: bool) -> None:  # type: ignore[no-untyped-def]
    import cupy as cp

    import cupy_ipcpool as cip
    from cupy_ipcpool._bench.lanes import GpuWork

    stream = cp.cuda.Stream(non_blocking=True)
    work = GpuWork(cp, 0, stream)
    prof = cProfile.Profile() if profile else None
    steps: dict[str, list[int]] = {"recv": [], "kernel": [], "release": []}
    options = {"mode": "ahead", "depth": 1} if ahead else {}
    with cip.subscribe(address, spin_us=spin, **options) as sub:
        waits = _count_waits(sub, "_order")
        q.put("ready")
        if prof is not None:
            prof.enable()
        n = 0
        while True:
            t0 = time.perf_counter_ns()
            try:
                f = sub.recv(timeout=60, stream=stream)
            except cip.EndOfStream:
                break
            t1 = time.perf_counter_ns()
            a = f.arrays[0]
            work.enqueue_check(a, 7)
            t2 = time.perf_counter_ns()
            f.release(stream=stream)
            t3 = time.perf_counter_ns()
            del a, f
            n += 1
            if n > 200:
                steps["recv"].append(t1 - t0)
                steps["kernel"].append(t2 - t1)
                steps["release"].append(t3 - t2)
        if prof is not None:
            prof.disable()
    stream.synchronize()
    text = _profile_text(prof)
    q.put((_summary(steps), text, work.flush(), waits))


def _run(
    mode: str,
    frames: int,
    mib: int,
    profile: bool,
    spin: float = 0.0,
    consumers: int = 1,
    ahead: bool = False,
) -> dict[str, object]:
    import cupy as cp

    import cupy_ipcpool as cip
    from cupy_ipcpool._bench.lanes import GpuWork

    q = SPAWN.Queue()
    address = os.path.join(tempfile.mkdtemp(), "s")
    stream = cp.cuda.Stream(non_blocking=True)
    work = GpuWork(cp, 0, stream)
    nelem = mib * MiB // 4
    steps: dict[str, list[int]] = {
        k: [] for k in ("acquire", "array", "kernel", "publish", "exit", "wait", "total")
    }
    polls: list[int] = []  # pub.poll calls (wake-ups) per round trip
    prof = cProfile.Profile() if profile else None
    slots = 4 if mode == "rt" else 8
    with (
        cip.IpcPool(slots, mib * MiB) as pool,
        cip.Publisher(pool, address, spin_us=spin, ahead=ahead) as pub,
    ):
        waits = _count_waits(pub._leases, "_order_all")  # what order_write calls
        procs = [
            SPAWN.Process(target=_consumer, args=(address, frames, profile, q, spin, ahead))
            for _ in range(consumers)
        ]
        for p in procs:
            p.start()
        for _ in procs:
            assert q.get(timeout=120) == "ready"
        while len(pub.subscribers) < consumers:
            pub.poll(0.05)
        if prof is not None:
            prof.enable()
        t_start = 0
        for i in range(frames + 200):
            if i == 200:
                t_start = time.perf_counter_ns()
            t0 = time.perf_counter_ns()
            with pub.frame(timeout=10, stream=stream) as f:
                t1 = time.perf_counter_ns()
                a = f.array((nelem,), cp.int32)
                t2 = time.perf_counter_ns()
                work.fill(a, 7)
                t3 = time.perf_counter_ns()
                f.publish(a)
                t4 = time.perf_counter_ns()
                del a
            t5 = time.perf_counter_ns()
            n_polls = 0
            if mode == "rt":
                while pub.leases(f.slot):
                    pub.poll(None)
                    n_polls += 1
            t6 = time.perf_counter_ns()
            if i >= 200:
                polls.append(n_polls)
                for k, v in zip(
                    steps,
                    (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t6 - t0),
                    strict=True,
                ):
                    steps[k].append(v)
        while any(pub.leases(s) for s in range(pool.num_slots)):
            pub.poll(None)
        elapsed = time.perf_counter_ns() - t_start
        if prof is not None:
            prof.disable()
    # the first consumer's figures are reported; mismatches and waits are summed
    replies = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    cons_steps, cons_prof, _m, _w = replies[0]
    mismatches = sum(r[2] for r in replies)
    cons_waits = [sum(r[3][0] for r in replies), sum(r[3][1] for r in replies)]
    stream.synchronize()
    text = _profile_text(prof)
    return {
        "producer": _summary(steps),
        "consumer": cons_steps,
        "fps": frames / (elapsed / 1e9),
        "polls": statistics.mean(polls) if polls else 0.0,
        "mismatches": mismatches,
        "gpu_waits": (
            f"producer {waits[1]} of {waits[0]}, consumer {cons_waits[1]} of {cons_waits[0]}"
        ),
        "producer_profile": text,
        "consumer_profile": cons_prof,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=3000)
    ap.add_argument("--mib", type=int, default=1)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument(
        "--ahead",
        action="store_true",
        help='frames handed out ahead (Publisher(ahead=True), mode="ahead", depth 1)',
    )
    ap.add_argument("--spin", type=float, action="append", default=[], help="extra rt runs")
    ap.add_argument(
        "--consumers",
        type=int,
        action="append",
        default=[],
        help="fan-out: rt runs with this many subscribers (repeatable; replaces the other runs)",
    )
    args = ap.parse_args()
    out = os.environ.get("OUT")
    runs = [("rt", False, spin, 1) for spin in args.spin]
    runs += [("rt", False, 0.0, 1), ("stream", False, 0.0, 1)]
    if not args.no_profile:
        runs.append(("rt", True, 0.0, 1))
    if args.consumers:
        runs = [("rt", False, 0.0, n) for n in args.consumers]
    for mode, profile, spin, consumers in runs:
        r = _run(mode, args.frames, args.mib, profile, spin, consumers, args.ahead)
        label = f"{mode}{' (cProfile)' if profile else ''}{f' spin_us={spin}' if spin else ''}"
        label += f" {consumers} subscribers" if consumers > 1 else ""
        label += " ahead" if args.ahead else ""
        print(
            f"== {label} {args.mib} MiB: {r['fps']:.0f} frames/s, "
            f"mismatching samples {r['mismatches']}; GPU waits enqueued: {r['gpu_waits']}; "
            f"producer polls per round trip {r['polls']:.2f}"
        )
        for side in ("producer", "consumer"):
            cells = ", ".join(
                f"{k} {m:.1f}/{p:.1f}"
                for k, (m, p) in r[side].items()  # type: ignore[attr-defined]
            )
            print(f"   {side} p50/p99 us: {cells}")
        if profile and out:
            for side in ("producer", "consumer"):
                name = f"profile_{side}{'_ahead' if args.ahead else ''}.txt"
                with open(os.path.join(out, name), "w") as fh:
                    fh.write(str(r[f"{side}_profile"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
