"""A producer publishes a model's output straight from a ring slot; a consumer reads it in place.

The producer computes ``y = relu(x @ w + b)`` under ``pool.allocating()``
inside ``with pub.frame() as f:``, so ``y`` (and the temporaries of the
expression) are allocated in the frame's slot, and publishes ``y`` with
``f.publish(y)``: nothing is copied.  A consumer in another process (started
with ``spawn``) receives each frame as a ``cupy.ndarray`` over the same
physical memory, recomputes the expected result and compares.

Needs a GPU with VMM and POSIX-fd handle support, and the package installed
(``python3 -m pip install -e .``)::

    python3 examples/producer_consumer.py

Prints what it verified; exits 0 when every frame checked out.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import struct
import sys
import tempfile
import time

import cupy as cp

import cupy_ipcpool as cip

BATCH, IN, OUT = 64, 256, 128  # y is 64 x 128 float32 = 32 KiB
FRAMES = 20
SLOTS = 4
SLOT_NBYTES = 1 << 20  # room for y and the temporaries of the expression
META = struct.Struct("<Q")  # the seed of the frame's input


def _ints(n: int, a: int, c: int) -> cp.ndarray:
    """Deterministic small integers in [-4, 4] as float32 (so every sum is exact)."""
    return ((cp.arange(n, dtype=cp.int64) * a + c) % 9 - 4).astype(cp.float32)


def weights() -> tuple[cp.ndarray, cp.ndarray]:
    """The model's parameters (the same in both processes)."""
    return _ints(IN * OUT, 7, 3).reshape(IN, OUT), _ints(OUT, 5, 1)


def make_input(seed: int) -> cp.ndarray:
    """The input of frame ``seed``."""
    return _ints(BATCH * IN, 11, seed).reshape(BATCH, IN)


def model(x: cp.ndarray, w: cp.ndarray, b: cp.ndarray) -> cp.ndarray:
    return cp.maximum(x @ w + b, 0)


def consume(address: str, results: mp.Queue) -> None:
    """Consumer process: check every frame against a local recomputation."""
    try:
        w, b = weights()
        seeds, bad, in_place = [], 0, 0
        with cip.subscribe(address) as sub:
            for frame in sub:  # ends when the publisher closes
                with frame:  # returns the lease at the end of the block
                    (seed,) = META.unpack(frame.metadata)
                    y = frame.array  # a view of the producer's slot, no copy
                    base = sub.peer.ptr(frame.slot)
                    in_place += base <= y.data.ptr < base + sub.peer.slot_nbytes
                    # this stream already waits for the producer's kernels (no host block)
                    if not bool(cp.array_equal(y, model(make_input(seed), w, b))):
                        bad += 1
                    seeds.append(seed)
        results.put(("done", seeds, bad, in_place))
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def main() -> int:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    tmpdir = tempfile.mkdtemp(prefix="cupy_ipcpool-example-")
    address = os.path.join(tmpdir, "channel.sock")
    consumer = None
    try:
        with cip.IpcPool(SLOTS, SLOT_NBYTES) as pool, cip.Publisher(pool, address) as pub:
            w, b = weights()
            consumer = ctx.Process(target=consume, args=(address, results))
            consumer.start()
            deadline = time.monotonic() + 120
            while not pub.subscribers:  # adopt the subscriber before the first frame
                pub.poll(0.05)
                if not consumer.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError("the consumer did not subscribe")
            for seed in range(FRAMES):
                x = make_input(seed)  # ordinary CuPy memory
                with pub.frame(timeout=10.0) as f:
                    with pool.allocating():  # allocations below land in slot f.slot
                        y = model(x, w, b)
                    f.publish(y, metadata=META.pack(seed))
                del y  # a live y would keep its slot from being reused
        # the publisher is closed: the consumer's loop ends cleanly
        try:
            msg = results.get(timeout=120)
        except queue.Empty:
            msg = ("error", "no result from the consumer")
    except (cip.CudaUnavailableError, cip.UnsupportedDeviceError) as exc:
        print(f"no GPU: {exc}")
        return 1
    finally:
        if consumer is not None:
            consumer.join(30)
            if consumer.is_alive():
                consumer.kill()
        shutil.rmtree(tmpdir, ignore_errors=True)
    if msg[0] == "error":
        print(f"consumer failed: {msg[1]}")
        return 1
    _, seeds, bad, in_place = msg
    ok = seeds == list(range(FRAMES)) and bad == 0 and in_place == FRAMES
    print(f"published {FRAMES} frames of relu(x @ w + b), shape ({BATCH}, {OUT}) float32")
    print(f"consumer received {len(seeds)} frames, in order: {seeds == list(range(FRAMES))}")
    print(f"frames equal to the consumer's own computation: {len(seeds) - bad}/{len(seeds)}")
    print(f"frames read in place from the shared slot (no copy): {in_place}/{len(seeds)}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
