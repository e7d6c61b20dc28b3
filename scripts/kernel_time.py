"""GPU time of the benchmarks' per-frame kernels, back to back, in one process.

Usage::

    python3 scripts/kernel_time.py [--launches 1000]

For each buffer (CuPy's own memory and an ``IpcPool`` slot, 1 MiB and 64 MiB)
it launches the comparison lanes' fill kernel (and the sampled check)
``--launches`` times on one stream between two CUDA events, and prints the GPU
time per kernel (events) and the host time per launch.  The kernels are
launched while the stream is still busy with fills of a large buffer, so they
queue up and the GPU runs them without waiting for the host: the event time
is the kernels' own.  Part 8 (docs/performance.md, section 9)
read the GPU-clock stamps under MPS as kernels 7-9x slower; this tells kernel
time from the host's launch spacing: run it with and without the MPS daemon.
"""

from __future__ import annotations

import argparse
import time

import cupy as cp

import cupy_ipcpool as cip
from cupy_ipcpool._bench.lanes import GpuWork

MiB = 1 << 20
#: The stream is kept busy by this many fills of an 8 GiB buffer (~3 ms each on an
#: H200) while the timed kernels are launched.
HEAD_FILLS = 8
HEAD_NBYTES = 8 << 30


def _time(
    work: GpuWork, a: cp.ndarray, head: cp.ndarray, launches: int, what: str
) -> tuple[float, float]:
    """(GPU µs per kernel, host µs per launch) of ``launches`` kernels back to back.

    ``what``: ``"fill"`` (writes 1 into ``a``) or ``"check"`` (compares ``a`` with 1).
    The timed kernels are launched while fills of the big ``head`` keep the
    stream busy, so that they are all queued before the GPU reaches them.
    """
    stream = work.stream
    launch = work.fill if what == "fill" else work.enqueue_check
    work.fill(a, 1)
    for _ in range(20):  # warm: module loaded, clocks up
        launch(a, 1)
    stream.synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(HEAD_FILLS):
        work.fill(head, 0)
    start.record(stream)
    t0 = time.perf_counter()
    for _ in range(launches):
        launch(a, 1)
    host = (time.perf_counter() - t0) / launches * 1e6
    end.record(stream)
    end.synchronize()
    gpu = cp.cuda.get_elapsed_time(start, end) * 1e3 / launches
    return gpu, host


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=1000)
    args = ap.parse_args()
    work = GpuWork(cp, 0)
    head = cp.zeros(HEAD_NBYTES // 4, cp.int32)
    print(f"{'buffer':<24} {'kernel':<6} {'GPU us/kernel':>14} {'host us/launch':>15}")
    for mib in (1, 64):
        nbytes = mib * MiB
        plain = cp.zeros(nbytes // 4, cp.int32)
        with cip.IpcPool(2, nbytes) as pool:
            token = pool.acquire(stream=work.stream)
            slot = token.array((nbytes // 4,), cp.int32)
            for name, a in ((f"cupy memory {mib} MiB", plain), (f"pool slot {mib} MiB", slot)):
                for what in ("fill", "check"):
                    gpu, host = _time(work, a, head, args.launches, what)
                    print(f"{name:<24} {what:<6} {gpu:14.2f} {host:15.2f}")
            work.stream.synchronize()
            del slot
            token.release()
        del plain
    print(f"mismatching samples: {work.flush()}")


if __name__ == "__main__":
    main()
