#!/usr/bin/env python3
"""Where does a consumer's one-element launch spend 66-74 us of host time? (issue 11, part 1)

A bare two-process loop (producer and consumer started with multiprocessing
``spawn``, connected by a ``SOCK_SEQPACKET`` socketpair) that adds the
channel's per-frame ingredients one at a time and times, on the consumer's
host, each per-frame step with ``time.perf_counter_ns``: the wake-up, the
``cuStreamWaitValue32`` call, the array view over imported memory, the launch
(CuPy elementwise, CuPy ``RawKernel``, raw ``cuLaunchKernel`` — rotating frame
by frame so each kind is the first launch after the wake-up), a second launch
right after the first, the release ``cuStreamWriteValue32`` and the reply.

Self-contained on purpose: it needs only cupy, cuda.bindings, numpy and the
standard library, not cupy_ipcpool (whose internals are being refactored).
The parent process never touches CUDA, so the "alone" rows really have one
context on the GPU.

Usage (on the GPU machine)::

    python3 scripts/launch_cost.py                # all rows, 2000 frames each, ~1 min on an H200
    python3 scripts/launch_cost.py --quick        # 7 rows, 400 frames: a smoke test (~30 s)
    python3 scripts/launch_cost.py --only A5,V-   # rows whose name starts with one of these
    python3 scripts/launch_cost.py --only A5,V-satisfied,V-pending,V-lag,V-norelwait,V-rel
                                                  # the second run's rows with their controls
    python3 scripts/launch_cost.py --list         # the rows and what each isolates
    OUT=/tmp/out python3 scripts/launch_cost.py   # also writes $OUT/launch_cost.json

Prints a markdown table (config, step, p50 us, p99 us, n). A failing row is
printed with its error and the other rows still run.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import queue
import socket
import struct
import sys
import time
import traceback
from typing import Any

WARMUP = 200  # frames run before timing starts (each launch kind is also loaded before)
SPIN_US = 200  # the producer's kernel in the "pending" row: the consumer's wait is still pending
SLEEP_S = 100e-6  # pacing of the "alone, sleeping" row (time.sleep(100 us) sleeps ~150 us)
SLOT = 2 << 20  # bytes of the data slot and of the sync page (one 2 MiB granule each)
FRAME_FLAG = 0  # byte offsets in the sync page
RELEASE_FLAG = 256

_MSG = struct.Struct("<Q")  # frame number (0 = stop); the reply echoes it
_SETUP = struct.Struct("<QQ")  # data bytes, page bytes; fds: [data, page]
_READY = b"ready"
_DONE = b"done"

TOUCH_SRC = r"""
extern "C" __global__ void touch(unsigned char* p) { p[0] += 1; }
"""
SPIN_SRC = r"""
extern "C" __global__ void spin(unsigned char* p, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    p[0] += 1;
}
"""


@dataclasses.dataclass(frozen=True)
class Cfg:
    """One row of the experiment: which ingredients are present."""

    name: str
    what: str
    producer: str = "none"  # none | idle | pingpong
    pkernel: str = "none"  # none | trivial | spin : the producer's GPU work per frame
    pace: str = "none"  # consumer between frames: none | sleep | socket | busypoll
    wait: str = "none"  # none | imported | local : the consumer stream's wait on a flag
    wait_flags: str = "geq"  # geq | eq | geq_flush
    view: bool = False  # launch on a new cupy.ndarray over the imported slot each frame
    release: bool = False  # consumer writes the release flag; producer's stream waits on it
    sched: str = "auto"  # consumer context flags: auto | spin | yield | blocking
    stream: str = "legacy"  # consumer stream: legacy (CuPy's default) | nonblocking | blocking
    psync: bool = False  # producer synchronises before sending: the wait is already satisfied
    pin: bool = False  # pin consumer and producer to two distinct cores
    query: bool = False  # after the reply: cuStreamQuery, counts frames still busy (untimed)
    # The producer's release wait (only with ``release``): before frame i's kernel its stream
    # waits until the release flag >= i - rel_lag (A5: 1, the frame just released; a ring of N
    # slots reusing the least recently released slot: N); 0: never waits (unsafe, measurement).
    rel_lag: int = 1
    # async: enqueue the wait, the host goes on (the channel's acquire);
    # sync: enqueue it, then synchronise: the release has been seen before the producer's kernel
    #   is launched, so its stream never waits on the consumer while the consumer works;
    # ahead: (with psync) after the frame flag is written and the stream synchronised, enqueue
    #   the wait for the release of the frame about to be sent (>= i) before the ping: the
    #   consumer's frame wait is already met, the producer's stream blocked on its release flag.
    relwait: str = "async"


BASE5 = dict(
    producer="pingpong", pkernel="trivial", pace="socket", wait="imported", view=True, release=True
)
CONFIGS: list[Cfg] = [
    Cfg("A0", "consumer alone, launches back to back (legacy stream)"),
    Cfg("A0-sleep", "consumer alone, sleeps ~100 us between frames", pace="sleep"),
    Cfg("A1", "+ producer process with a context and the VMM allocations, idle", producer="idle"),
    Cfg(
        "A2-pingpong",
        "+ blocking socket ping-pong with the producer, no GPU work in the producer",
        producer="pingpong",
        pace="socket",
    ),
    Cfg(
        "A2",
        "+ producer kernel per frame (on its own VMM slot) before the ping",
        producer="pingpong",
        pkernel="trivial",
        pace="socket",
    ),
    Cfg(
        "A3",
        "+ consumer stream waits (GEQ) on the imported frame flag the producer writes",
        producer="pingpong",
        pkernel="trivial",
        pace="socket",
        wait="imported",
    ),
    Cfg(
        "A4",
        "+ consumer launches on a new cupy.ndarray over the imported slot",
        producer="pingpong",
        pkernel="trivial",
        pace="socket",
        wait="imported",
        view=True,
    ),
    Cfg("A5", "+ release write; producer stream waits on it (the channel's pattern)", **BASE5),
    Cfg(
        "V-localflag",
        "A5, but the wait is on a local (cudaMalloc) flag",
        **{**BASE5, "wait": "local"},
    ),
    Cfg("V-eq", "A5 with CU_STREAM_WAIT_VALUE_EQ", **BASE5, wait_flags="eq"),
    Cfg("V-flush", "A5 with GEQ | CU_STREAM_WAIT_VALUE_FLUSH", **BASE5, wait_flags="geq_flush"),
    Cfg("V-spin", "A5, consumer context CU_CTX_SCHED_SPIN", **BASE5, sched="spin"),
    Cfg("V-yield", "A5, consumer context CU_CTX_SCHED_YIELD", **BASE5, sched="yield"),
    Cfg(
        "V-blocksync", "A5, consumer context CU_CTX_SCHED_BLOCKING_SYNC", **BASE5, sched="blocking"
    ),
    Cfg("V-nonblocking", "A5 on a non-blocking stream", **BASE5, stream="nonblocking"),
    Cfg(
        "V-blockingstream", "A5 on a created stream with default flags", **BASE5, stream="blocking"
    ),
    Cfg("V-satisfied", "A5, producer syncs before the ping: wait already met", **BASE5, psync=True),
    Cfg(
        "V-pending",
        f"A5, producer kernel spins {SPIN_US} us: the wait is pending at the launch",
        **{**BASE5, "pkernel": "spin"},
    ),
    Cfg(
        "V-pending-nb",
        "V-pending on a non-blocking stream",
        **{**BASE5, "pkernel": "spin", "stream": "nonblocking"},
    ),
    # -- second run: a cycle of pending cross-process stream waits? does a ring's lag fix it? --
    Cfg("V-lag2", "A5, producer waits release >= i-2 (a ring of 2 slots)", **BASE5, rel_lag=2),
    Cfg("V-lag3", "A5, producer waits release >= i-3 (a ring of 3 slots)", **BASE5, rel_lag=3),
    Cfg("V-lag7", "A5, producer waits release >= i-7 (a ring of 7 slots)", **BASE5, rel_lag=7),
    Cfg(
        "V-norelwait",
        "A5, consumer writes the release flag, producer never waits on it (unsafe)",
        **BASE5,
        rel_lag=0,
    ),
    Cfg(
        "V-relsync",
        "A5, producer host synchronises on its release wait (>= i-1) before its kernel",
        **BASE5,
        relwait="sync",
    ),
    Cfg(
        "V-relpending",
        "V-satisfied, then the producer stream waits release >= i before the ping",
        **BASE5,
        psync=True,
        rel_lag=0,
        relwait="ahead",
    ),
    Cfg(
        "V-busypoll",
        "A5, consumer busy-polls the socket instead of blocking",
        **{**BASE5, "pace": "busypoll"},
    ),
    Cfg("V-pinned", "A5, consumer and producer pinned to two cores", **BASE5, pin=True),
    Cfg(
        "V-nb-alone",
        "A0 on a non-blocking stream (the issue's separate measurement)",
        stream="nonblocking",
    ),
]
QUICK = ("A0", "A2", "A5", "V-nonblocking", "V-satisfied", "V-pending", "V-lag3")

LAUNCHES = ("cupy_ew", "cupy_raw", "cuLaunchKernel")


# ----------------------------------------------------------------------- helpers


def _stats(samples_ns: list[int]) -> dict[str, float]:
    xs = sorted(samples_ns)
    n = len(xs)
    if not n:
        return {"n": 0}

    def q(p: float) -> float:
        return xs[min(n - 1, int(p * n))] / 1e3

    return {
        "n": n,
        "p50_us": q(0.5),
        "p99_us": q(0.99),
        "min_us": xs[0] / 1e3,
        "mean_us": sum(xs) / n / 1e3,
    }


class _Cuda:
    """The driver calls the children need, each checked (``(err, *values)`` tuples)."""

    def __init__(self) -> None:
        from cuda.bindings import driver as d

        self.d = d

    def ck(self, name: str, res: Any) -> Any:
        err = res[0]
        if err:
            try:
                _e2, s = self.d.cuGetErrorName(err)
                ename = s.decode() if isinstance(s, bytes) else str(s)
            except Exception:
                ename = str(err)
            raise RuntimeError(f"{name}: {ename} ({int(err)})")
        if len(res) == 1:
            return None
        return res[1] if len(res) == 2 else res[1:]

    def init(self, sched: str) -> int:
        """cuInit, set the primary context's flags before CuPy activates it, make it current."""
        d = self.d
        self.ck("cuInit", d.cuInit(0))
        dev = self.ck("cuDeviceGet", d.cuDeviceGet(0))
        flags = {
            "auto": d.CUctx_flags.CU_CTX_SCHED_AUTO,
            "spin": d.CUctx_flags.CU_CTX_SCHED_SPIN,
            "yield": d.CUctx_flags.CU_CTX_SCHED_YIELD,
            "blocking": d.CUctx_flags.CU_CTX_SCHED_BLOCKING_SYNC,
        }[sched]
        self.ck("cuDevicePrimaryCtxSetFlags", d.cuDevicePrimaryCtxSetFlags(dev, int(flags)))
        ctx = self.ck("cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain(dev))
        self.ck("cuCtxSetCurrent", d.cuCtxSetCurrent(ctx))
        self.dev = dev
        return 0

    def _prop(self) -> Any:
        d = self.d
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0
        prop.requestedHandleTypes = (
            d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
        return prop

    def _map(self, handle: Any, size: int) -> int:
        d = self.d
        ptr = self.ck("cuMemAddressReserve", d.cuMemAddressReserve(size, 0, 0, 0))
        self.ck("cuMemMap", d.cuMemMap(ptr, size, 0, handle, 0))
        acc = d.CUmemAccessDesc()
        acc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = 0
        acc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.ck("cuMemSetAccess", d.cuMemSetAccess(ptr, size, [acc], 1))
        return int(ptr)

    def create_exported(self, size: int) -> tuple[int, int]:
        """cuMemCreate (POSIX-fd exportable) + map + export; returns (ptr, fd)."""
        d = self.d
        prop = self._prop()
        gran = int(
            self.ck(
                "cuMemGetAllocationGranularity",
                d.cuMemGetAllocationGranularity(
                    prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
            )
        )
        if size % gran:
            raise RuntimeError(f"size {size} is not a multiple of the granularity {gran}")
        handle = self.ck("cuMemCreate", d.cuMemCreate(size, prop, 0))
        ptr = self._map(handle, size)
        fd = self.ck(
            "cuMemExportToShareableHandle",
            d.cuMemExportToShareableHandle(
                handle, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
            ),
        )
        self.ck("cuMemsetD32", d.cuMemsetD32(ptr, 0, size // 4))
        return ptr, int(fd)

    def import_fd(self, fd: int, size: int) -> int:
        d = self.d
        handle = self.ck(
            "cuMemImportFromShareableHandle",
            d.cuMemImportFromShareableHandle(
                fd, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            ),
        )
        return self._map(handle, size)


def _pin(core_index: int) -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 2:
        cores = cores[1:]  # leave the first core to the system
    os.sched_setaffinity(0, {cores[core_index % len(cores)]})


def _recv_exact(sock: socket.socket, buf: bytearray) -> int:
    n = sock.recv_into(buf)
    if n == 0:
        raise EOFError("peer closed the socket")
    return n


# ----------------------------------------------------------------------- producer


def producer_main(cfg: Cfg, sock: socket.socket, results: Any, frames: int) -> None:
    stats: dict[str, Any] = {}
    try:
        if cfg.pin:
            _pin(1)
        cu = _Cuda()
        cu.init("auto")
        import cupy as cp

        d = cu.d
        data_ptr, data_fd = cu.create_exported(SLOT)
        page_ptr, page_fd = cu.create_exported(SLOT)
        socket.send_fds(sock, [_SETUP.pack(SLOT, SLOT)], [data_fd, page_fd])
        buf = bytearray(64)
        if cfg.producer == "idle":
            while True:  # READY, then DONE (or EOF) when the consumer has finished
                n = sock.recv_into(buf)
                if n == 0 or bytes(buf[:n]) == _DONE:
                    break
            results.put(("producer", {}, None))
            return
        stream = cp.cuda.Stream.null  # the channel's benchmarks publish on CuPy's default stream
        sptr = stream.ptr
        mem = cp.cuda.UnownedMemory(data_ptr, SLOT, cu, 0)
        slot_arr = cp.ndarray((16,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))
        spin = cp.RawKernel(SPIN_SRC, "spin")
        try:
            clock_khz = int(
                cu.ck(
                    "cuDeviceGetAttribute",
                    d.cuDeviceGetAttribute(
                        d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE, cu.dev
                    ),
                )
            )
        except Exception:
            clock_khz = 1_980_000  # H200 boost clock
        cycles = cp.int64(int(SPIN_US * clock_khz / 1000))
        slot_arr[:1] += 1
        spin((1,), (1,), (slot_arr, cp.int64(1)))
        cp.cuda.Device(0).synchronize()
        write, wait = d.cuStreamWriteValue32, d.cuStreamWaitValue32
        geq = int(d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        frame_flag, rel_flag = page_ptr + FRAME_FLAG, page_ptr + RELEASE_FLAG
        _recv_exact(sock, buf)  # READY
        rt, kern, flag, sync_t, relw = [], [], [], [], []
        lag = cfg.rel_lag
        relwait = cfg.release and lag > 0 and cfg.relwait != "ahead"
        total = frames + WARMUP
        for i in range(1, total + 1):
            t0 = time.perf_counter_ns()
            if cfg.pkernel == "spin":
                stream.synchronize()  # keep at most one spin kernel queued
            tr = time.perf_counter_ns()
            if relwait and i > lag:
                (err,) = wait(sptr, rel_flag, i - lag, geq)  # the channel's acquire
                if err:
                    cu.ck("cuStreamWaitValue32 (producer)", (err,))
                if cfg.relwait == "sync":
                    stream.synchronize()
            t1 = time.perf_counter_ns()
            if cfg.pkernel == "trivial":
                slot_arr[:1] += 1
            elif cfg.pkernel == "spin":
                spin((1,), (1,), (slot_arr, cycles))
            t2 = time.perf_counter_ns()
            if cfg.wait == "imported":
                (err,) = write(sptr, frame_flag, i, 0)
                if err:
                    cu.ck("cuStreamWriteValue32 (producer)", (err,))
            t3 = time.perf_counter_ns()
            if cfg.psync:
                stream.synchronize()
            if cfg.release and cfg.relwait == "ahead":
                # the stream waits for the release of the frame the consumer is about to get
                (err,) = wait(sptr, rel_flag, i, geq)
                if err:
                    cu.ck("cuStreamWaitValue32 (producer, ahead)", (err,))
            t4 = time.perf_counter_ns()
            sock.send(_MSG.pack(i))
            _recv_exact(sock, buf)
            t5 = time.perf_counter_ns()
            if i > WARMUP:
                rt.append(t5 - t0)
                kern.append(t2 - t1)
                flag.append(t3 - t2)
                sync_t.append(t4 - t3)
                if relwait:
                    relw.append(t1 - tr)
        sock.send(_MSG.pack(0))
        _recv_exact(sock, buf)  # DONE: the consumer's stream is drained
        stream.synchronize()
        stats = {"P round trip": _stats(rt), "P kernel launch": _stats(kern)}
        if cfg.wait == "imported":
            stats["P flag write"] = _stats(flag)
        if cfg.psync:
            stats["P synchronize"] = _stats(sync_t)
        if relwait:
            stats["P release wait (host)"] = _stats(relw)
        results.put(("producer", stats, None))
    except BaseException as exc:
        results.put(("producer", stats, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# ----------------------------------------------------------------------- consumer


def consumer_main(cfg: Cfg, sock: socket.socket | None, results: Any, frames: int) -> None:
    stats: dict[str, Any] = {}
    try:
        if cfg.pin:
            _pin(0)
        cu = _Cuda()
        cu.init(cfg.sched)
        import cupy as cp

        d = cu.d
        env = _env(cu, cp)
        data_ptr = page_ptr = 0
        if sock is not None:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 64, 4)
            if len(fds) != 2 or len(msg) != _SETUP.size:
                raise RuntimeError(f"bad SETUP: {len(msg)} bytes, {len(fds)} fds")
            data_n, page_n = _SETUP.unpack(msg)
            if cfg.view:
                data_ptr = cu.import_fd(fds[0], data_n)
            if cfg.wait == "imported" or cfg.release:
                page_ptr = cu.import_fd(fds[1], page_n)
            for fd in fds:
                os.close(fd)
        # the stream
        if cfg.stream == "legacy":
            stream = cp.cuda.Stream.null
        elif cfg.stream == "nonblocking":
            stream = cp.cuda.Stream(non_blocking=True)
        else:
            stream = cp.cuda.Stream(non_blocking=False)
        stream.use()
        sptr = stream.ptr
        local = cp.zeros(16, cp.uint8)
        local_flag = cp.zeros(1, cp.uint32)  # stays 0: a GEQ/EQ wait for 0 is always met
        touch = cp.RawKernel(TOUCH_SRC, "touch")
        # load every kernel module before the loop (a first launch loads it and may block)
        local[:1] += 1
        touch((1,), (1,), (local,))
        cp.cuda.Device(0).synchronize()
        # the raw driver launch of the same (NVRTC-compiled) kernel: its void** parameter array
        arg = ctypes.c_void_p(local.data.ptr)
        params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
        params_addr = ctypes.addressof(params)
        launch_kernel = d.cuLaunchKernel
        fn: Any = None
        try:
            fn = d.CUfunction(int(touch.kernel.ptr))
            cu.ck("cuLaunchKernel", launch_kernel(fn, 1, 1, 1, 1, 1, 1, 0, sptr, params_addr, 0))
            cu.ck("cuStreamSynchronize", d.cuStreamSynchronize(sptr))
        except Exception as exc:  # keep the row: that launch kind is left out
            env["cuLaunchKernel_setup_error"] = f"{type(exc).__name__}: {exc}"
            fn = None

        W = d.CUstreamWaitValue_flags
        wflags = {
            "geq": int(W.CU_STREAM_WAIT_VALUE_GEQ),
            "eq": int(W.CU_STREAM_WAIT_VALUE_EQ),
            "geq_flush": int(W.CU_STREAM_WAIT_VALUE_GEQ) | int(W.CU_STREAM_WAIT_VALUE_FLUSH),
        }[cfg.wait_flags]
        if cfg.wait_flags == "geq_flush":
            can = cu.ck(
                "cuDeviceGetAttribute",
                d.cuDeviceGetAttribute(
                    d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, cu.dev
                ),
            )
            env["can_flush_remote_writes"] = int(can)
        wait, write, query = d.cuStreamWaitValue32, d.cuStreamWriteValue32, d.cuStreamQuery
        not_ready = d.CUresult.CUDA_ERROR_NOT_READY
        flag_addr = {"imported": page_ptr + FRAME_FLAG, "local": local_flag.data.ptr}.get(
            cfg.wait, 0
        )
        rel_addr = page_ptr + RELEASE_FLAG
        unowned, memptr, ndarray, u8 = (
            cp.cuda.UnownedMemory,
            cp.cuda.MemoryPointer,
            cp.ndarray,
            cp.uint8,
        )

        class _Owner:  # what UnownedMemory keeps alive (the channel passes its lease)
            pass

        owner = _Owner()
        steps = ["wake", "wait", "view", *[f"launch[{k}]" for k in LAUNCHES], "launch2[cupy_ew]"]
        steps += ["release", "reply", "active (wait..reply)"]
        rec: dict[str, list[int]] = {s: [] for s in steps}
        busy = 0
        buf = bytearray(64)
        if sock is not None:
            if cfg.pace == "busypoll":
                sock.setblocking(False)
            sock.send(_READY)
        total = frames + WARMUP
        i = 0
        n = 0
        while True:
            # -- wake-up --
            tw = time.perf_counter_ns()
            if cfg.pace in ("socket", "busypoll"):
                if cfg.pace == "socket":
                    _recv_exact(sock, buf)  # type: ignore[union-attr]
                else:
                    while True:
                        try:
                            _recv_exact(sock, buf)  # type: ignore[union-attr]
                            break
                        except BlockingIOError:
                            pass
                (i,) = _MSG.unpack_from(buf)
                if i == 0:
                    break
            else:
                i += 1
                if i > total:
                    break
                if cfg.pace == "sleep":
                    time.sleep(SLEEP_S)
                elif i % 256 == 0:  # back to back: keep the queue short (untimed)
                    stream.synchronize()
                    tw = time.perf_counter_ns()
            t0 = time.perf_counter_ns()
            # -- the stream waits on the frame flag --
            if cfg.wait != "none":
                value = i if cfg.wait == "imported" else 0
                (err,) = wait(sptr, flag_addr, value, wflags)
                if err:
                    cu.ck("cuStreamWaitValue32", (err,))
            t1 = time.perf_counter_ns()
            # -- the frame's array --
            if cfg.view:
                arr = ndarray((16,), u8, memptr(unowned(data_ptr, 16, owner, 0), 0))
            else:
                arr = local
            t2 = time.perf_counter_ns()
            # -- the user's launch (kind rotates) and a second one --
            kind = i % 3
            if kind == 2 and fn is None:
                kind = 1
            if kind == 0:
                arr[:1] += 1
            elif kind == 1:
                touch((1,), (1,), (arr,))
            else:
                arg.value = arr.data.ptr
                (err,) = launch_kernel(fn, 1, 1, 1, 1, 1, 1, 0, sptr, params_addr, 0)
                if err:
                    cu.ck("cuLaunchKernel", (err,))
            t3 = time.perf_counter_ns()
            arr[:1] += 1
            t4 = time.perf_counter_ns()
            # -- release: the stream writes the read flag --
            if cfg.release:
                (err,) = write(sptr, rel_addr, i, 0)
                if err:
                    cu.ck("cuStreamWriteValue32", (err,))
            t5 = time.perf_counter_ns()
            if sock is not None and cfg.pace in ("socket", "busypoll"):
                sock.send(_MSG.pack(i))
            t6 = time.perf_counter_ns()
            del arr
            if cfg.query:
                busy += query(sptr)[0] == not_ready
            n += 1
            if n > WARMUP:
                rec["wake"].append(t0 - tw)
                if cfg.wait != "none":
                    rec["wait"].append(t1 - t0)
                if cfg.view:
                    rec["view"].append(t2 - t1)
                rec[f"launch[{LAUNCHES[kind]}]"].append(t3 - t2)
                rec["launch2[cupy_ew]"].append(t4 - t3)
                if cfg.release:
                    rec["release"].append(t5 - t4)
                if cfg.pace in ("socket", "busypoll"):
                    rec["reply"].append(t6 - t5)
                rec["active (wait..reply)"].append(t6 - t0)
        stream.synchronize()
        cp.cuda.Device(0).synchronize()
        stats = {s: _stats(v) for s, v in rec.items() if v}
        if cfg.query:
            stats["stream busy after reply (%)"] = {"n": n, "value": 100.0 * busy / max(n, 1)}
        results.put(("consumer", stats, None, env))
        if sock is not None:
            sock.setblocking(True)
            sock.send(_DONE)
    except BaseException as exc:
        results.put(
            ("consumer", stats, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", {})
        )
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()  # the producer's recv sees EOF instead of waiting for its timeout


def _env(cu: _Cuda, cp: Any) -> dict[str, Any]:
    d = cu.d
    env: dict[str, Any] = {"python": platform.python_version(), "cupy": cp.__version__}
    try:
        from cuda.bindings import __version__ as cbv

        env["cuda_bindings"] = cbv
    except Exception:
        pass
    try:
        env["driver"] = int(cu.ck("cuDriverGetVersion", d.cuDriverGetVersion()))
        name = cu.ck("cuDeviceGetName", d.cuDeviceGetName(256, cu.dev))
        env["device"] = name.split(b"\0", 1)[0].decode()
    except Exception as exc:
        env["env_error"] = str(exc)
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    env["CUDA_MODULE_LOADING"] = os.environ.get("CUDA_MODULE_LOADING")
    return env


# ----------------------------------------------------------------------- orchestration


def run_config(cfg: Cfg, frames: int, timeout: float) -> dict[str, Any]:
    """Start the row's processes, collect their statistics; never raises."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    out: dict[str, Any] = {"name": cfg.name, "what": cfg.what, "cfg": dataclasses.asdict(cfg)}
    procs = []
    psock = csock = None
    try:
        if cfg.producer != "none":
            psock, csock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            procs.append(ctx.Process(target=producer_main, args=(cfg, psock, results, frames)))
        procs.append(ctx.Process(target=consumer_main, args=(cfg, csock, results, frames)))
        for p in procs:
            p.start()
        for s in (psock, csock):
            if s is not None:
                s.close()
        deadline = time.monotonic() + timeout
        want = {"consumer"} | ({"producer"} if cfg.producer != "none" else set())
        errors = []
        while want and time.monotonic() < deadline:
            try:
                item = results.get(timeout=0.5)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            role, stats, err = item[0], item[1], item[2]
            want.discard(role)
            out.setdefault("stats", {}).update(stats)
            if role == "consumer":
                out["env"] = item[3]
            if err:
                errors.append(f"{role}: {err}")
        if want:
            errors.append(f"no result from {sorted(want)} within {timeout:.0f} s (killed)")
        if errors:
            out["error"] = "\n".join(errors)
    except BaseException as exc:
        out["error"] = f"orchestration: {type(exc).__name__}: {exc}"
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n| config | step | p50 µs | p99 µs | n |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        for step, s in r.get("stats", {}).items():
            if "value" in s:
                print(f"| {r['name']} | {step} | {s['value']:.1f} | | {s['n']} |")
            elif s.get("n"):
                print(
                    f"| {r['name']} | {step} | {s['p50_us']:.1f} | {s['p99_us']:.1f} | {s['n']} |"
                )
        if r.get("error"):
            first = r["error"].strip().splitlines()[0]
            print(f"| {r['name']} | **failed** | {first} | | |")
    print("\nRows:")
    for r in rows:
        print(f"- {r['name']}: {r['what']}")
    errs = [r for r in rows if r.get("error")]
    for r in errs:
        print(f"\n--- {r['name']} failed:\n{r['error']}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=2000, help="timed frames per row (default 2000)")
    ap.add_argument("--quick", action="store_true", help=f"rows {', '.join(QUICK)}, 400 frames")
    ap.add_argument("--only", default="", help="comma-separated name prefixes of rows to run")
    ap.add_argument("--timeout", type=float, default=45.0, help="seconds per row before a kill")
    ap.add_argument("--list", action="store_true", help="list the rows and exit")
    args = ap.parse_args(argv)
    configs = CONFIGS
    frames = args.frames
    if args.quick:
        configs = [c for c in CONFIGS if c.name in QUICK]
        frames = min(frames, 400)
    if args.only:
        prefixes = [p for p in args.only.split(",") if p]
        configs = [c for c in configs if any(c.name.startswith(p) for p in prefixes)]
    if args.list:
        for c in configs:
            print(f"{c.name:18} {c.what}")
        return 0
    rows = []
    t_start = time.monotonic()
    for c in configs:
        t0 = time.monotonic()
        r = run_config(c, frames, args.timeout + frames * 0.002)
        r["seconds"] = round(time.monotonic() - t0, 1)
        rows.append(r)
        status = "FAILED" if r.get("error") else "ok"
        print(
            f"[{time.monotonic() - t_start:6.1f} s] {c.name}: {status} ({r['seconds']} s)",
            flush=True,
        )
    print_table(rows)
    env = next((r["env"] for r in rows if r.get("env")), {})
    print(f"\nenv: {json.dumps(env)}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "launch_cost.json")
        with open(path, "w") as f:
            json.dump({"frames": frames, "warmup": WARMUP, "env": env, "rows": rows}, f, indent=2)
        print(f"wrote {path}")
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
