"""Helpers shared by the GPU-tier tests (imported lazily: CuPy kernels need a device)."""

from __future__ import annotations

import os
import traceback
from typing import Any

FILL_SRC = r"""
extern "C" __global__ void fill(unsigned int* out, unsigned long long n, unsigned int seed) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) out[i] = seed * 2654435761u + (unsigned int)i;
}
"""

_kernels: dict[str, Any] = {}


def fill(array: Any, seed: int) -> None:
    """Write ``seed * 2654435761 + i`` into a uint32 array with a RawKernel."""
    import cupy as cp

    k = _kernels.get("fill")
    if k is None:
        k = _kernels["fill"] = cp.RawKernel(FILL_SRC, "fill")
    n = array.size
    k((min(1024, max(1, (n + 255) // 256)),), (256,), (array, cp.uint64(n), cp.uint32(seed)))


def expected(n: int, seed: int) -> Any:
    """The host-side values :func:`fill` writes."""
    import numpy as np

    i = np.arange(n, dtype=np.uint64)
    return ((seed * 2654435761 + i) & 0xFFFFFFFF).astype(np.uint32)


def fd_count() -> int:
    """Open fds of this process."""
    return len(os.listdir("/proc/self/fd"))


def device_free(device: int = 0) -> int:
    """Free device memory in bytes (driver view)."""
    from cupy_ipcpool import _driver

    return _driver.mem_info(device)[0]


def report_exception(queue: Any) -> None:
    """Send the current exception to the parent as (type name, message, traceback)."""
    import sys

    exc = sys.exc_info()[1]
    queue.put(("error", type(exc).__name__, str(exc), traceback.format_exc()))


def run_consumer_checking_values(address: str, frames: int, queue: Any) -> None:
    """Subscribe, receive ``frames`` frames of constant arrays; put the list of their values.

    Each frame's array must hold one value everywhere (checked on the GPU,
    waited for); the value is ``int(array[0])``.  Puts ``"ready"`` first, and
    an error tuple (see :func:`report_exception`) if anything fails.
    """
    try:
        import cupy as cp

        import cupy_ipcpool as cip

        values = []
        with cip.subscribe(address) as sub:
            queue.put("ready")
            for _ in range(frames):
                with sub.recv(timeout=60) as frame:
                    a = frame.array
                    first = int(a[0])
                    if not bool((a == first).all()):
                        raise AssertionError(f"frame {frame.seq} is not constant")
                    values.append(first)
                    del a
            cp.cuda.get_current_stream().synchronize()
        queue.put(values)
    except BaseException:
        report_exception(queue)


def run_consumer_tracking_arrays(address: str, frames: int, release: bool, queue: Any) -> None:
    """Receive ``frames`` frames; put ``(values, frames whose array was the slot's last one)``.

    ``release``: release each frame explicitly; else drop it (and its array)
    without releasing, relying on the lease coming back when both are gone.
    Arrays are compared by identity through weak references (which do not
    keep them in use).
    """
    try:
        import weakref

        import cupy as cp

        import cupy_ipcpool as cip

        values, reused = [], 0
        last: dict[int, Any] = {}
        with cip.subscribe(address) as sub:
            queue.put("ready")
            for _ in range(frames):
                frame = sub.recv(timeout=30)
                a = frame.array
                previous = last.get(frame.slot)
                reused += previous is not None and previous() is a
                last[frame.slot] = weakref.ref(a)
                values.append(int(a[0]))
                if release:
                    frame.release()
                del a, frame
            cp.cuda.get_current_stream().synchronize()
        queue.put((values, reused))
    except BaseException:
        report_exception(queue)
