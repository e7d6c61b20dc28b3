"""Does a ``cuStreamWaitValue32`` on a sync-page flag hold the stream?  (GPU machine.)

Usage::

    timeout 90 python3 -u scripts/diag_waits.py

Each trial: a fresh non-blocking stream waits for a flag (value 0) to reach 7
(``CU_STREAM_WAIT_VALUE_GEQ``), a one-element fill is enqueued behind the wait,
and 100 ms later the script prints whether the stream is still held.  Then
another stream writes 7 and the script prints whether the held stream moved
on within 2 s.  Nothing waits on a held stream on the host.  The trials differ
in where the flag lies (the registered host page, or device memory) and how
the wait is enqueued (``_fastpath.memop`` on the ``cuGetProcAddress`` pointer,
or the ``cuda.bindings`` function).  (Across processes the channel's own
GPU tests check the same with verified data.)

Every kernel is launched once before any wait is enqueued.  The first version
of this script did not, and hung in its first trial without printing: with
CUDA's lazy module loading (the default since CUDA 12.2), the first launch of
a kernel loads its module, and that load may synchronise the context -- here
with a stream held by a wait that only a later write releases.
"""

from __future__ import annotations

import os
import time
from typing import Any

import cupy as cp

from cupy_ipcpool import _driver
from cupy_ipcpool.channel._syncpage import SyncPage

GEQ = 0


def _done_within(stream: Any, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if stream.done:
            return True
        time.sleep(0.001)
    return bool(stream.done)


def _bindings_wait(stream: int, addr: int, value: int) -> None:
    drv = _driver.driver_module()
    (rc,) = drv.cuStreamWaitValue32(drv.CUstream(stream), drv.CUdeviceptr(addr), value, GEQ)
    assert int(rc) == 0, rc


def _bindings_write(stream: int, addr: int, value: int) -> None:
    drv = _driver.driver_module()
    (rc,) = drv.cuStreamWriteValue32(drv.CUstream(stream), drv.CUdeviceptr(addr), value, 0)
    assert int(rc) == 0, rc


def trial(label: str, addr: int, wait: Any, write: Any) -> None:
    held = cp.cuda.Stream(non_blocking=True)
    writer = cp.cuda.Stream(non_blocking=True)
    marker = cp.zeros(1, dtype=cp.int32)
    with held:
        marker.fill(1)  # the fill kernel loaded before any wait (see the module docstring)
    cp.cuda.Device().synchronize()
    wait(held.ptr, addr, 7)
    with held:
        marker.fill(1)
    time.sleep(0.1)
    print(f"{label}: held after 100 ms: {not held.done}", flush=True)
    write(writer.ptr, addr, 7)
    print(f"{label}: moved on within 2 s of the write: {_done_within(held, 2.0)}", flush=True)


def main() -> None:
    cp.cuda.Device(0).use()
    cp.zeros(1)
    drv = _driver.driver_module()
    dev = drv.CUdevice(0)
    for name in (
        "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1",
        "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS",
        "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR",
        "CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM",
        "CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS",
        "CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED",
    ):
        attr = getattr(drv.CUdevice_attribute, name, None)
        if attr is not None:
            print(name, drv.cuDeviceGetAttribute(attr, dev)[1])
    write_fn, wait_fn = _driver.memop_pointers()
    for ver in (11000, 12000, 13000):
        r = drv.cuGetProcAddress(b"cuStreamWaitValue32", ver, 0)
        print(f"cuGetProcAddress(cuStreamWaitValue32, {ver}) = {int(r[1]):#x}")
    print(f"library's wait pointer {wait_fn:#x}, write pointer {write_fn:#x}", flush=True)

    page = SyncPage.create(4, 2, 0)
    trial("host page, _fastpath", page.frame_flag(0), page.wait, page.write)
    trial("host page, bindings", page.frame_flag(1), _bindings_wait, _bindings_write)
    dev_flags = cp.zeros(64, dtype=cp.int32)
    base = dev_flags.data.ptr
    trial("device memory, _fastpath", base, page.wait, page.write)
    trial("device memory, bindings", base + 128, _bindings_wait, _bindings_write)

    os._exit(0)


if __name__ == "__main__":
    main()
