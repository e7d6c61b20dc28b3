"""Open question: does a store *from the host* to the registered sync page release a GPU wait?

Usage (GPU machine)::

    timeout 60 python3 -u scripts/diag_hostflags.py

The library never sets a flag from the host (streams write every flag, and the
host only reads them), so this is not needed for correctness; it is needed to
understand a failed test on the H200 machine (docs/performance.md, section 4).

Three trials, each: a stream waits for a flag to reach 7, a fill behind the
wait; after 100 ms the script says whether the stream is still held, then
releases it (by a host store, or by another stream's write) and says whether it
moved on within 2 s.  Nothing here waits on the held stream itself: an earlier
version read an array back (``get()`` on CuPy's legacy default stream) while
the wait was pending and hung without printing, which fits the stream's
hardware queue being shared with the default stream's copy (in-process streams
may share the device's queues) -- not confirmed.  Not yet run in this form.
"""

from __future__ import annotations

import time

import cupy as cp

from cupy_ipcpool.channel._syncpage import SyncPage


def _done_within(stream: cp.cuda.Stream, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if stream.done:
            return True
        time.sleep(0.001)
    return False


def trial(page: SyncPage, label: str, addr: int, release) -> None:  # type: ignore[no-untyped-def]
    held = cp.cuda.Stream(non_blocking=True)
    marker = cp.zeros(1, dtype=cp.int32)
    cp.cuda.Device().synchronize()
    page.wait(held.ptr, addr, 7)
    with held:
        marker.fill(1)
    time.sleep(0.1)
    print(f"{label}: held after 100 ms: {not held.done}", flush=True)
    release()
    print(f"{label}: moved on within 2 s of the release: {_done_within(held, 2.0)}", flush=True)


def main() -> None:
    cp.cuda.Device(0).use()
    cp.zeros(1)
    cp.cuda.Device().synchronize()
    page = SyncPage.create(4, 2, 0)
    writer = cp.cuda.Stream(non_blocking=True, priority=-1)
    off0 = page.layout.frame_offset(0)
    trial(page, "host page, host store", page.frame_flag(0), lambda: page.flags.store(off0, 7))
    flag1 = page.frame_flag(1)
    trial(page, "host page, stream write", flag1, lambda: page.write(writer.ptr, flag1, 7))
    device_flag = cp.zeros(16, dtype=cp.uint32)
    cp.cuda.Device().synchronize()
    dptr = device_flag.data.ptr
    trial(page, "device memory, stream write", dptr, lambda: page.write(writer.ptr, dptr, 7))


if __name__ == "__main__":
    main()
