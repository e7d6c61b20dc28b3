"""Where the GPU is during the round trip: the two processes' work on the GPU's own clock.

Usage::

    python3 scripts/gpu_clock_hot_path.py [--frames 2000] [--mib 1] [--rounds 2]
                                          [--throughput]

``timeline_hot_path.py`` times the host; this times the GPU.  Around the
user's work in each process a one-thread kernel writes the GPU's
``%globaltimer`` (one nanosecond clock for every context on the device):

* producer: ``pre`` (its stream got past the acquire's read-flag wait and is
  about to fill), ``filled``;
* consumer: ``seen`` (its stream got past the frame-flag wait), ``checked``.

The same stamps are taken around the socket + GPU floor's fill and check
(no flags, no dependency between the processes).  Per round it prints the
medians over frames of the GPU segments (fill, the hand-over from the
producer's fill to the consumer's check, the check, the period between two
frames on the GPU and on the host) and the *GPU lag*: how long after the host
launched a stamp the GPU ran it, less the shortest such delay seen on an idle
GPU in the same process (so 0 means "ran as soon as an idle GPU would have").

``--throughput``: the producer does not wait for each frame's release (block
mode, the ring's ``--slots`` bound what is in flight), as the throughput
benchmarks do; the floor is not run then.  ``--hold N``: the consumer keeps
its last N frames before releasing the oldest (the pipelined benchmark's
subscriber).

The stamp launches add host time to both loops (a few microseconds each):
read the host figures of ``timeline_hot_path.py``, not these.

What it is for: docs/performance.md, section 9 — whether the GPU, and not
the host, bounds the round trip and the throughput.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
from collections import deque
from typing import Any

from timeline_hot_path import CLOCK, SPAWN, WARMUP, _own_gpu, _pin, _recv_spin

MiB = 1 << 20

STAMP_SOURCE = r"""
extern "C" __global__ void cip_stamp(unsigned long long* out, long long i) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    out[i] = t;
}
"""


class GpuStamps:
    """One-thread kernels that write the GPU clock into slots of a device array.

    ``stamp(i)`` notes the host clock at the launch and enqueues the write of
    ``%globaltimer`` into slot ``i`` on ``stream``.
    """

    def __init__(self, cp: Any, stream: Any, n: int) -> None:
        import numpy

        self._np = numpy
        self.stream = stream
        self._kernel = cp.RawKernel(STAMP_SOURCE, "cip_stamp")
        with stream:
            self.gpu = cp.zeros(n, dtype=cp.uint64)
        self.host = [0] * n
        self.idle_offset = self._calibrate(cp)

    def stamp(self, i: int) -> None:
        self.host[i] = CLOCK()
        with self.stream:
            self._kernel((1,), (1,), (self.gpu, self._np.int64(i)))

    def _calibrate(self, cp: Any, tries: int = 200) -> int:
        """GPU clock minus host launch time, the least over launches on an idle GPU."""
        with self.stream:
            probe = cp.zeros(1, dtype=cp.uint64)
        self.stream.synchronize()
        best = None
        for _ in range(tries):
            h = CLOCK()
            with self.stream:
                self._kernel((1,), (1,), (probe, self._np.int64(0)))
            self.stream.synchronize()
            d = int(probe.get()[0]) - h
            best = d if best is None else min(best, d)
        assert best is not None
        return best

    def collect(self) -> tuple[list[int], list[int]]:
        """(GPU stamps, host launch times), after the stream finished."""
        self.stream.synchronize()
        return [int(x) for x in self.gpu.get()], self.host


# ------------------------------------------------------------------ the channel
def _channel_consumer(address: str, n: int, hold: int, q: Any, cpu: int | None) -> None:
    _pin(cpu)
    import cupy as cp

    import cupy_ipcpool as cip
    from cupy_ipcpool._bench.lanes import GpuWork

    stream = cp.cuda.Stream(non_blocking=True)
    work = GpuWork(cp, 0, stream)
    st = GpuStamps(cp, stream, 2 * n)
    k = 0
    held: deque[Any] = deque()
    with cip.subscribe(address) as sub:
        q.put("ready")
        while True:
            try:
                f = sub.recv(timeout=60, stream=stream)
            except cip.EndOfStream:
                break
            st.stamp(2 * k)
            a = f.arrays[0]
            work.enqueue_check(a, 7)
            st.stamp(2 * k + 1)
            held.append(f)
            if len(held) > hold:
                held.popleft().release(stream=stream)
            del a, f
            k += 1
        while held:
            held.popleft().release(stream=stream)
    gpu, host = st.collect()
    q.put((k, gpu, host, st.idle_offset, work.flush()))


def _channel_round(
    frames: int, mib: int, cpus: tuple[int, int] | None, throughput: bool, slots: int, hold: int
) -> dict[str, Any]:
    _pin(cpus[0] if cpus else None)
    import cupy as cp

    import cupy_ipcpool as cip
    from cupy_ipcpool._bench.lanes import GpuWork

    n = frames + WARMUP
    q = SPAWN.Queue()
    address = os.path.join(tempfile.mkdtemp(), "s")
    stream = cp.cuda.Stream(non_blocking=True)
    work = GpuWork(cp, 0, stream)
    st = GpuStamps(cp, stream, 2 * n)
    nelem = mib * MiB // 4
    starts = [0] * (n + 1)
    with (
        cip.IpcPool(slots, mib * MiB) as pool,
        cip.Publisher(pool, address) as pub,
    ):
        p = SPAWN.Process(
            target=_channel_consumer, args=(address, n, hold, q, cpus[1] if cpus else None)
        )
        p.start()
        assert q.get(timeout=120) == "ready"
        while not pub.subscribers:
            pub.poll(0.05)
        for k in range(n):
            starts[k] = CLOCK()
            with pub.frame(timeout=10, stream=stream) as f:
                a = f.array((nelem,), cp.int32)
                st.stamp(2 * k)
                work.fill(a, 7)
                st.stamp(2 * k + 1)
                f.publish(a)
                del a
            if not throughput:
                while pub.leases(f.slot):
                    pub.poll(None)
        starts[n] = CLOCK()
        gpu, host = st.collect()
    got, c_gpu, c_host, c_offset, mismatches = q.get(timeout=120)
    p.join(30)
    if mismatches or got != n:
        raise SystemExit(f"channel: {mismatches} mismatching samples, {got} of {n} frames")
    return _segments(gpu, host, st.idle_offset, c_gpu, c_host, c_offset, starts)


# ------------------------------------------------------------------ the floor
def _floor_consumer(path: str, mib: int, n: int, q: Any, cpu: int | None) -> None:
    _pin(cpu)
    import cupy as cp

    work, local = _own_gpu(mib, zeroed=True)
    st = GpuStamps(cp, work.stream, 2 * n)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    reply = bytes(16)
    k = 0
    while True:
        msg = _recv_spin(s, 256, 0)
        if not msg:
            break
        st.stamp(2 * k)
        work.enqueue_check(local, 0)
        st.stamp(2 * k + 1)
        s.send(reply)
        k += 1
    s.close()
    gpu, host = st.collect()
    q.put((k, gpu, host, st.idle_offset, work.flush()))


def _floor_round(frames: int, mib: int, cpus: tuple[int, int] | None) -> dict[str, Any]:
    _pin(cpus[0] if cpus else None)
    import cupy as cp

    n = frames + WARMUP
    q = SPAWN.Queue()
    path = os.path.join(tempfile.mkdtemp(), "f")
    work, arr = _own_gpu(mib, zeroed=False)
    st = GpuStamps(cp, work.stream, 2 * n)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    p = SPAWN.Process(target=_floor_consumer, args=(path, mib, n, q, cpus[1] if cpus else None))
    p.start()
    conn, _ = listener.accept()
    msg = bytes(96)
    starts = [0] * (n + 1)
    for k in range(n):
        starts[k] = CLOCK()
        st.stamp(2 * k)
        work.fill(arr, 7)
        st.stamp(2 * k + 1)
        conn.send(msg)
        _recv_spin(conn, 64, 0)
    starts[n] = CLOCK()
    conn.close()
    listener.close()
    gpu, host = st.collect()
    got, c_gpu, c_host, c_offset, mismatches = q.get(timeout=120)
    p.join(30)
    if mismatches or got != n:
        raise SystemExit(f"floor: {mismatches} mismatching samples, {got} of {n} frames")
    return _segments(gpu, host, st.idle_offset, c_gpu, c_host, c_offset, starts)


# ------------------------------------------------------------------ the figures
ROWS = (
    "GPU: P fill (pre -> filled)",
    "GPU: hand-over (P filled -> C seen)",
    "GPU: C check (seen -> checked)",
    "GPU: C checked -> next P pre",
    "GPU: period (pre -> next pre)",
    "host: period (frame start -> next)",
    "GPU lag: P pre after its launch",
    "GPU lag: C seen after its launch",
    "frames/s: host loop",
    "frames/s: GPU (last pre - first pre)",
)


def _segments(
    p_gpu: list[int],
    p_host: list[int],
    p_off: int,
    c_gpu: list[int],
    c_host: list[int],
    c_off: int,
    starts: list[int],
) -> dict[str, Any]:
    """Medians (us) of each row over the frames after the warm-up."""
    n = len(p_gpu) // 2
    ks = range(WARMUP, n - 1)

    def med(xs: Any) -> float:
        return statistics.median(xs) / 1e3

    pre = [p_gpu[2 * k] for k in range(n)]
    filled = [p_gpu[2 * k + 1] for k in range(n)]
    seen = [c_gpu[2 * k] for k in range(n)]
    checked = [c_gpu[2 * k + 1] for k in range(n)]
    span = n - 1 - WARMUP
    values = [
        med(filled[k] - pre[k] for k in ks),
        med(seen[k] - filled[k] for k in ks),
        med(checked[k] - seen[k] for k in ks),
        med(pre[k + 1] - checked[k] for k in ks),
        med(pre[k + 1] - pre[k] for k in ks),
        med(starts[k + 1] - starts[k] for k in ks),
        med(pre[k] - p_host[2 * k] - p_off for k in ks),
        med(seen[k] - c_host[2 * k] - c_off for k in ks),
        span * 1e9 / (starts[n - 1] - starts[WARMUP]),
        span * 1e9 / (pre[n - 1] - pre[WARMUP]),
    ]
    return dict(zip(ROWS, values, strict=True))


def _print(title: str, rounds: list[dict[str, Any]]) -> None:
    head = "  ".join(f"r{r:<7d}" for r in range(len(rounds)))
    print(f"\n== {title}")
    print(f"{'':40s} {head}  median")
    for row in ROWS:
        xs = [r[row] for r in rounds]
        cells = "  ".join(f"{x:8.1f}" for x in xs)
        print(f"{row:40s} {cells}  {statistics.median(xs):8.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=2000)
    ap.add_argument("--mib", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="channel and floor alternating")
    ap.add_argument("--cpus", default="2,4", help="producer,consumer CPUs ('' = no pinning)")
    ap.add_argument(
        "--throughput", action="store_true", help="the producer does not wait for releases"
    )
    ap.add_argument("--slots", type=int, default=4, help="the channel's ring size")
    ap.add_argument("--hold", type=int, default=0, help="frames the consumer keeps (throughput)")
    args = ap.parse_args()
    cpus: tuple[int, int] | None = None
    if args.cpus:
        first, second = (int(c) for c in args.cpus.split(","))
        cpus = (first, second)
    chan: list[dict[str, Any]] = []
    floor: list[dict[str, Any]] = []
    for r in range(args.rounds):
        chan.append(
            _channel_round(args.frames, args.mib, cpus, args.throughput, args.slots, args.hold)
        )
        line = f"round {r}: channel GPU period {chan[-1][ROWS[4]]:.1f} us"
        if not args.throughput:
            floor.append(_floor_round(args.frames, args.mib, cpus))
            line += f", floor {floor[-1][ROWS[4]]:.1f} us"
        print(line, flush=True)
    what = "throughput (no per-frame wait)" if args.throughput else "round trip"
    what += f", {args.slots} slots" + (f", consumer holds {args.hold}" if args.hold else "")
    _print(f"channel, {args.mib} MiB, {what}, medians in us (frames/s rows: rates)", chan)
    if floor:
        _print(f"socket + GPU floor, {args.mib} MiB", floor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
