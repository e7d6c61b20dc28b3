"""Diagnose channel latency on a GPU machine: event API costs and a round-trip breakdown.

Usage: python3 scripts/diag_channel.py   (prints medians in microseconds)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import cupy as cp

import cupy_ipcpool as cip

N = 2000


def _med(xs):
    return statistics.median(xs) / 1e3


def event_costs():
    rt = cp.cuda.runtime
    ipc = rt.eventCreateWithFlags(rt.eventDisableTiming | rt.eventInterprocess)
    plain = rt.eventCreateWithFlags(rt.eventDisableTiming)
    s = cp.cuda.get_current_stream().ptr
    out = {}
    for name, fn in [
        ("eventRecord ipc", lambda: rt.eventRecord(ipc, s)),
        ("eventRecord plain", lambda: rt.eventRecord(plain, s)),
        ("streamWaitEvent ipc", lambda: rt.streamWaitEvent(s, ipc)),
        ("streamWaitEvent plain", lambda: rt.streamWaitEvent(s, plain)),
    ]:
        ts = []
        for _ in range(N):
            t0 = time.perf_counter_ns()
            fn()
            ts.append(time.perf_counter_ns() - t0)
        out[name] = _med(ts)
    a = cp.zeros(16, cp.uint8)
    ts = []
    for _ in range(N):
        t0 = time.perf_counter_ns()
        a[:1] = 1
        ts.append(time.perf_counter_ns() - t0)
    out["tiny kernel launch"] = _med(ts)
    cp.cuda.Device().synchronize()
    return out


def consumer(address, gpu_work, q):
    with cip.subscribe(address) as sub:
        q.put("ready")
        recv_t, rel_t = [], []
        for _i, frame in enumerate(sub):
            t0 = time.perf_counter_ns()
            if gpu_work:
                frame.array[:1] += 1
            t1 = time.perf_counter_ns()
            frame.release()
            t2 = time.perf_counter_ns()
            recv_t.append(t1 - t0)
            rel_t.append(t2 - t1)
        q.put((_med(recv_t), _med(rel_t)))


def round_trip(gpu_work, producer_kernel, mib=1):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    d = tempfile.mkdtemp()
    address = os.path.join(d, "s")
    phases = {k: [] for k in ("acquire", "array", "kernel", "publish", "wait", "total")}
    with cip.IpcPool(4, mib << 20) as pool, cip.Publisher(pool, address) as pub:
        p = ctx.Process(target=consumer, args=(address, gpu_work, q))
        p.start()
        q.get(timeout=120)
        while not pub.subscribers:
            pub.poll(0.05)
        for i in range(N + 200):
            t0 = time.perf_counter_ns()
            f = pub.frame(timeout=10)
            t1 = time.perf_counter_ns()
            a = f.array((16,), cp.uint8)
            t2 = time.perf_counter_ns()
            if producer_kernel:
                a[:1] = 1
            t3 = time.perf_counter_ns()
            f.publish(a)
            t4 = time.perf_counter_ns()
            del a
            while pub.leases(f.slot):
                pub.poll(None)
            t5 = time.perf_counter_ns()
            if i >= 200:
                for k, v in zip(
                    phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0), strict=True
                ):
                    phases[k].append(v)
    cons = q.get(timeout=60)
    p.join(30)
    return {k: round(_med(v), 1) for k, v in phases.items()}, cons


SPIN = r"""
extern "C" __global__ void spin(unsigned char* out, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    out[0] = 7;
}
"""


def launch_consumer(address, q):
    with cip.subscribe(address) as sub:
        q.put("ready")
        frame = sub.recv(timeout=60)
        t0 = time.perf_counter_ns()
        frame.array[:1] += 1  # a launch ordered after the producer's (still running) kernel
        t1 = time.perf_counter_ns()
        cp.cuda.get_current_stream().synchronize()
        t2 = time.perf_counter_ns()
        frame.release()
        q.put(((t1 - t0) / 1e3, (t2 - t0) / 1e3))


def launch_after_wait():
    """Does a consumer's kernel launch block its host while the producer's kernel runs?"""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    address = os.path.join(tempfile.mkdtemp(), "s")
    spin = cp.RawKernel(SPIN, "spin")
    with cip.IpcPool(2, 1 << 20) as pool, cip.Publisher(pool, address) as pub:
        p = ctx.Process(target=launch_consumer, args=(address, q))
        p.start()
        q.get(timeout=120)
        while not pub.subscribers:
            pub.poll(0.05)
        with pub.frame() as f:
            a = f.array((16,), cp.uint8)
            clock_hz = cp.cuda.Device().attributes["ClockRate"] * 1000
            spin((1,), (1,), (a, cp.int64(int(0.3 * clock_hz))))
            f.publish(a)
        del a
        launch_us, done_us = q.get(timeout=60)
        p.join(30)
    return launch_us, done_us


def main():
    print("event costs (us):", {k: round(v, 2) for k, v in event_costs().items()}, flush=True)
    launch_us, done_us = launch_after_wait()
    print(
        f"consumer launch after waiting on a running producer kernel (300 ms): host "
        f"{launch_us:.0f} us for the launch, {done_us:.0f} us until done",
        flush=True,
    )
    for gpu_work, kern in ((False, False), (True, True)):
        ph, cons = round_trip(gpu_work, kern)
        print(
            f"round trip consumer_gpu={gpu_work} producer_kernel={kern}: {ph} "
            f"consumer work/release us={cons}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
