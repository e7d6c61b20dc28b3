"""Diagnose stream waits on registered host memory: memfd vs anonymous shared mapping."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import cupy as cp
from cuda.bindings import driver as d

from cupy_ipcpool import _driver
from cupy_ipcpool._fastpath import memop

cp.cuda.Device(0).use()
cp.zeros(1)
wfn, vfn = _driver.memop_pointers()
GEQ = int(d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)


def page(kind: str):
    if kind == "memfd":
        fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 4096)
        mm = mmap.mmap(fd, 4096)
    elif kind == "anon":
        mm = mmap.mmap(-1, 4096)
    else:
        mm = None
    if mm is not None:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        flags = d.CU_MEMHOSTREGISTER_PORTABLE | d.CU_MEMHOSTREGISTER_DEVICEMAP
        print(kind, "register", d.cuMemHostRegister(addr, 4096, flags))
        err, dptr = d.cuMemHostGetDevicePointer(addr, 0)
        print(kind, "devptr", err, hex(int(dptr)), hex(addr))
        words = memoryview(mm).cast("I")
        return int(dptr), words, mm
    err, hptr = d.cuMemHostAlloc(4096, d.CU_MEMHOSTALLOC_PORTABLE | d.CU_MEMHOSTALLOC_DEVICEMAP)
    err, dptr = d.cuMemHostGetDevicePointer(hptr, 0)
    words = (ctypes.c_uint32 * 1024).from_address(int(hptr))
    return int(dptr), words, None


def done_within(s, t):
    end = time.time() + t
    while time.time() < end:
        if s.done:
            return True
        time.sleep(0.001)
    return False


for kind in ("hostalloc", "anon", "memfd"):
    dptr, words, _keep = page(kind)
    s = cp.cuda.Stream(non_blocking=True)
    marker = cp.zeros(1, dtype=cp.int32)
    cp.cuda.Device().synchronize()
    rc = memop(vfn, s.ptr, dptr, 2, GEQ)
    with s:
        marker.fill(1)
    time.sleep(0.05)
    print(kind, "wait rc", rc, "done before store:", s.done, "marker", int(marker.get()))
    words[0] = 2
    print(kind, "done after host store:", done_within(s, 2.0), "marker", int(marker.get()))
    # GPU write on A, GPU wait on B
    a = cp.cuda.Stream(non_blocking=True)
    b = cp.cuda.Stream(non_blocking=True)
    memop(vfn, b.ptr, dptr + 8, 5, GEQ)
    time.sleep(0.01)
    memop(wfn, a.ptr, dptr + 8, 5, 0)
    print(kind, "gpu write->gpu wait done:", done_within(b, 2.0), "host sees", words[2])
