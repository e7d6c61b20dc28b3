"""``python -m cupy_ipcpool demo``: a producer and N consumer processes passing frames.

The producer is a synthetic camera: each frame is written by a kernel into a
ring slot through the allocator hook, post-processed by a second small kernel
(also into the slot), and published.  Each consumer, in its own process,
receives the frames as ``cupy.ndarray`` views of the same memory, recomputes
the expected content on its GPU and counts mismatching bytes without blocking
its host thread, then releases the frame.  The producer prints live progress
and a summary that says whether every received frame was verified.

Each frame's time from publish to the consumer's ``recv`` returning is split
in two (:func:`split_latency`): the *handoff*, what the channel costs, and the
time the frame was *queued* in the ring because the consumer was still busy
with earlier frames (block mode lets the producer run ahead by up to
``--slots`` frames).  The report prints both and says what each is
(:data:`FIGURES`).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import queue
import shutil
import struct
import tempfile
import time
from typing import Any

from ._handles import MAX_SLOT_NBYTES

_META = struct.Struct("<QQ")  # seq, producer timestamp (CLOCK_MONOTONIC ns)
_CAMERA_SRC = "out = (unsigned char)(((unsigned int)i * 2654435761u + seq * 40503u) >> 24)"
_POST_SRC = "out = in ^ (unsigned char)0x5A"

DESCRIPTION = (
    "A producer process (a synthetic camera: two kernels write each frame into a ring "
    "slot) publishes frames to consumer processes; each consumer receives them as "
    "cupy.ndarray views of the same memory, checks every byte on its GPU and releases "
    "them. Prints frames/s, the handoff latency (what the channel costs) and the time "
    "frames were queued in the ring (the consumers' backlog) every second, and exits 0 "
    "when every consumer verified every frame it received. Needs a GPU."
)

#: Printed before the first progress line.
LEGEND = (
    "latency: 'handoff' is what the channel costs per frame; 'queued' is how long frames "
    "waited in the ring for a busy consumer (explained under the summary)"
)

#: What each latency figure of the report is (printed under the summary).
FIGURES = (
    "handoff: from publish (or from the consumer's call, if the frame was already "
    "waiting) to the consumer's recv returning: what the channel costs per frame",
    "queued: how long a published frame waited in the ring for its consumer to ask for "
    "it (the consumer still busy with earlier frames; block mode lets the producer run "
    "ahead by up to --slots frames): the consumer's backlog, not the channel",
)


#: Most consumer processes (the demo's publisher admits this many subscribers).
MAX_CONSUMERS = 64
#: A frame's array is rows of this many bytes (1024 RGBA pixels); a smaller one has no row.
ROW_NBYTES = 1024 * 4
#: Slot bytes beyond a frame's two arrays.
SLOT_SLACK = 1024
MiB = 1 << 20
#: The range of ``--frame-mib``: from one row to what a slot (two arrays) may hold.
MIN_FRAME_MIB = ROW_NBYTES / MiB
MAX_FRAME_MIB = (MAX_SLOT_NBYTES - SLOT_SLACK) // 2 // MiB


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def frame_mib(text: str) -> float:
    """An argparse ``type``: ``--frame-mib``, a number in ``MIN_FRAME_MIB..MAX_FRAME_MIB``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not MIN_FRAME_MIB <= value <= MAX_FRAME_MIB:  # NaN too
        raise argparse.ArgumentTypeError(
            f"must be in {MIN_FRAME_MIB:g}..{MAX_FRAME_MIB} (MiB: from one "
            f"{ROW_NBYTES // 1024} KiB row to half the largest slot), got {text}"
        )
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the demo's options on ``parser`` (each value checked as it is parsed)."""
    from .channel import MAX_CHANNEL_SLOTS as MAX_SLOTS
    from .remote._cli import int_in  # the command line's one integer-range check

    parser.add_argument(
        "--frame-mib",
        type=frame_mib,
        default=8.0,
        help=f"size of each of a frame's two arrays, MiB ({MIN_FRAME_MIB:g}..{MAX_FRAME_MIB}, "
        f"in whole rows of {ROW_NBYTES // 1024} KiB)",
    )
    parser.add_argument(
        "--slots", type=int_in(2, MAX_SLOTS), default=8, help=f"ring slots (2..{MAX_SLOTS})"
    )
    parser.add_argument(
        "--consumers",
        type=int_in(1, MAX_CONSUMERS),
        default=2,
        help=f"consumer processes (1..{MAX_CONSUMERS})",
    )
    parser.add_argument(
        "--mode",
        choices=("block", "latest"),
        default="block",
        help="block: every consumer gets every frame, the producer waits for the slowest; "
        "latest: a busy consumer skips to the newest frame",
    )
    parser.add_argument("--duration", type=positive_float, default=10.0, help="seconds to publish")
    parser.add_argument("--device", type=int_in(0), default=0, help="CUDA device")
    parser.set_defaults(run=run, gpu=lambda args: args.device)


def _kernels(cp: Any) -> tuple[Any, Any]:
    camera = cp.ElementwiseKernel("uint32 seq", "uint8 out", _CAMERA_SRC, "demo_camera")
    post = cp.ElementwiseKernel("uint8 in", "uint8 out", _POST_SRC, "demo_post")
    return camera, post


def _consumer(address: str, mode: str, index: int, shape: tuple[int, ...], reports: Any) -> None:
    """Consumer process: verify every received frame on the GPU, report stats."""
    try:
        import cupy as cp

        import cupy_ipcpool as cip

        camera, post = _kernels(cp)
        received = 0
        errors = cp.zeros((), dtype=cp.int64)
        _warm_up(cp, camera, post, errors, shape)
        latencies: list[tuple[int, int]] = []  # (handoff, queued) ns per frame
        last_report = time.monotonic()
        with cip.subscribe(address, mode=mode) as sub:
            reports.put(("ready", index, os.getpid()))
            scratch = None
            frames = iter(sub)
            while True:
                asked = time.monotonic_ns()
                frame = next(frames, None)  # None: the publisher closed the stream
                now = time.monotonic_ns()
                if frame is None:
                    break
                seq, t_pub = _META.unpack(frame.metadata)
                latencies.append(split_latency(t_pub, asked, now))
                raw, processed = frame.arrays
                if scratch is None or scratch.shape != raw.shape:
                    scratch = cp.empty_like(raw)
                camera(cp.uint32(seq), scratch)
                errors += cp.count_nonzero(raw != scratch)
                errors += cp.count_nonzero(processed != post(scratch))
                frame.release()
                received += 1
                if now / 1e9 - last_report >= 0.5:
                    reports.put(("progress", index, received, latencies))
                    latencies = []
                    last_report = now / 1e9
            cp.cuda.get_current_stream().synchronize()
            reports.put(("done", index, received, latencies, int(errors)))
    except BaseException as exc:
        reports.put(("error", index, f"{type(exc).__name__}: {exc}"))


def _warm_up(cp: Any, camera: Any, post: Any, errors: Any, shape: tuple[int, ...]) -> None:
    """Compile every kernel the loop uses before timing starts (NVRTC takes seconds).

    CuPy compiles elementwise kernels per dtype and number of dimensions, so
    the warm-up uses arrays of the frame's shape.
    """
    a = cp.empty(shape, dtype=cp.uint8)
    b = cp.empty_like(a)
    camera(cp.uint32(0), a)
    camera(cp.uint32(0), b)
    errors += cp.count_nonzero(a != b)
    errors += cp.count_nonzero(post(a) != post(b))
    cp.cuda.get_current_stream().synchronize()
    errors.fill(0)


def split_latency(published_ns: int, asked_ns: int, returned_ns: int) -> tuple[int, int]:
    """Split one frame's publish -> ``recv`` time into ``(handoff, queued)``, in ns.

    Parameters
    ----------
    published_ns
        ``CLOCK_MONOTONIC`` when the producer published the frame (system-wide,
        so comparable across processes).
    asked_ns
        When the consumer asked for its next frame (called ``recv``).
    returned_ns
        When that call returned the frame.

    Returns
    -------
    tuple of int
        ``handoff``: from the later of the publish and the consumer's call to
        the return, what the channel costs; ``queued``: how long the frame
        waited for the consumer to ask for it (0 when the consumer was already
        waiting).  Their sum is ``returned_ns - published_ns``.
    """
    start = max(published_ns, asked_ns)
    return max(0, returned_ns - start), max(0, start - published_ns)


def percentile(values: list[int], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` (nearest rank; NaN when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))])


def latency_text(samples: list[tuple[int, int]]) -> str:
    """``handoff p50 .. p99 .. | queued p50 .. p99 ..`` for ``(handoff, queued)`` ns samples."""
    handoff = [h for h, _ in samples]
    queued = [q for _, q in samples]

    def us(values: list[int], q: float) -> str:
        return f"{percentile(values, q) / 1e3:7.1f}"

    return (
        f"handoff p50 {us(handoff, 0.5)} us  p99 {us(handoff, 0.99)} us  |  "
        f"queued p50 {us(queued, 0.5)} us  p99 {us(queued, 0.99)} us"
    )


def progress_line(
    elapsed_s: float,
    published: int,
    rate: float,
    received: list[int],
    samples: list[tuple[int, int]],
) -> str:
    """One line of live progress: frames published, their rate, received, both latencies."""
    return (
        f"t={elapsed_s:5.1f}s  published {published:8d}  {rate:9.0f} frames/s  "
        f"received {'/'.join(str(r) for r in received)}  {latency_text(samples)}"
    )


def summary_lines(
    *,
    published: int,
    elapsed_s: float,
    frame_bytes: int,
    mode: str,
    done: dict[int, tuple[int, int]],
    received: list[int],
    failures: list[str],
    samples: list[tuple[int, int]],
) -> tuple[bool, list[str]]:
    """The closing report and whether the demo passed.

    Parameters
    ----------
    published, elapsed_s, frame_bytes, mode
        What the producer did: frames, seconds, bytes per array (two per frame),
        ``"block"`` or ``"latest"``.
    done
        Per consumer that finished: ``(frames received, mismatching bytes)``,
        ``-1`` bytes for a consumer that failed.
    received
        Frames each consumer had reported (for consumers that did not finish).
    failures
        One text per consumer error.
    samples
        Every ``(handoff, queued)`` ns sample of the run (:func:`split_latency`).
    """
    ok = not failures and len(done) == len(received)
    rate = published / max(elapsed_s, 1e-9)
    lines = [
        f"summary: published {published} frames in {elapsed_s:.1f} s "
        f"({rate:.0f} frames/s, {rate * frame_bytes * 2 / 1e9:.1f} GB/s handed over "
        "without copies)",
        f"  latency over the run: {latency_text(samples)}",
    ]
    for i, count in enumerate(received):
        got, errs = done.get(i, (count, -1))
        verified = errs == 0
        ok = ok and verified and (got == published or mode == "latest") and got > 0
        state = (
            "all verified"
            if verified
            else f"{errs} mismatching bytes"
            if errs > 0
            else "did not finish"
        )
        lines.append(f"  consumer {i}: received {got} frames, {state}")
    lines += [f"  {f}" for f in failures]
    lines += [f"  {figure}" for figure in FIGURES]
    block_note = f" (block mode: all {published} frames delivered to every consumer)"
    lines.append(
        "every received frame verified: "
        + ("YES" if ok else "NO")
        + (block_note if ok and mode == "block" else "")
    )
    return ok, lines


def run(args: argparse.Namespace) -> int:
    """Run the demo; return 0 when every consumer verified every frame it received.

    ``args`` were checked as they were parsed (:func:`add_arguments`), and the
    command line checked that ``--device`` exists (the ``gpu`` default).

    Raises
    ------
    CudaUnavailableError, UnsupportedDeviceError
        No GPU, or one that cannot host a pool (the command line prints one line).
    """
    from . import _driver

    _driver.require_vmm_device(args.device)
    import cupy as cp

    import cupy_ipcpool as cip

    nbytes = int(args.frame_mib * (1 << 20))
    width = 1024
    rows = max(1, nbytes // (width * 4))
    shape = (rows, width, 4)
    frame_bytes = rows * width * 4
    tmpdir = tempfile.mkdtemp(prefix="cupy_ipcpool-demo-")
    address = os.path.join(tmpdir, "demo.sock")
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    procs: list[Any] = []
    camera, post = _kernels(cp)
    _warm_up(cp, camera, post, cp.zeros((), dtype=cp.int64), shape)
    print(
        f"demo: {args.consumers} consumer(s), mode={args.mode}, frames {shape} uint8 "
        f"({frame_bytes / 2**20:.1f} MiB, x2 arrays), {args.slots} slots, {args.duration:g} s\n"
        f"{LEGEND}",
        flush=True,
    )
    published = 0
    elapsed = 0.0
    lat: list[tuple[int, int]] = []  # since the last progress line
    every: list[tuple[int, int]] = []  # the whole run
    received = [0] * args.consumers
    done: dict[int, tuple[int, int]] = {}
    failures: list[str] = []

    def drain(block_s: float = 0.0) -> None:
        deadline = time.monotonic() + block_s
        while True:
            try:
                msg = (
                    reports.get(timeout=max(0.0, deadline - time.monotonic()))
                    if block_s
                    else reports.get_nowait()
                )
            except queue.Empty:
                return
            kind, index = msg[0], msg[1]
            if kind == "progress":
                received[index] = msg[2]
                lat.extend(msg[3])
                every.extend(msg[3])
            elif kind == "done":
                received[index] = msg[2]
                lat.extend(msg[3])
                every.extend(msg[3])
                done[index] = (msg[2], msg[4])
            elif kind == "error":
                failures.append(f"consumer {index}: {msg[2]}")
                done[index] = (received[index], -1)

    try:
        with (
            cp.cuda.Device(args.device),
            cip.IpcPool(args.slots, 2 * frame_bytes + 1024, device=args.device) as pool,
            cip.Publisher(pool, address, max_subscribers=MAX_CONSUMERS) as pub,
        ):
            for i in range(args.consumers):
                p = ctx.Process(target=_consumer, args=(address, args.mode, i, shape, reports))
                p.start()
                procs.append(p)
            deadline = time.monotonic() + 120
            while len(pub.subscribers) < args.consumers:
                pub.poll(0.05)
                drain()
                if failures or time.monotonic() > deadline:
                    raise cip.IpcPoolError("consumers did not subscribe: " + "; ".join(failures))
            start = last = time.monotonic()
            last_pub = 0
            while time.monotonic() - start < args.duration:
                with pub.frame(timeout=10.0) as f:
                    with pool.allocating():
                        raw = cp.empty(shape, dtype=cp.uint8)
                        camera(cp.uint32(published), raw)
                        processed = post(raw)
                    f.publish(raw, processed, metadata=_META.pack(published, time.monotonic_ns()))
                del raw, processed
                published += 1
                now = time.monotonic()
                if now - last >= 1.0:
                    drain()
                    rate = (published - last_pub) / (now - last)
                    print(progress_line(now - start, published, rate, received, lat), flush=True)
                    lat.clear()
                    last, last_pub = now, published
            elapsed = time.monotonic() - start
        # the publisher is closed: consumers see a clean end of stream
        end = time.monotonic() + 60
        while len(done) < args.consumers and time.monotonic() < end:
            drain(0.5)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(tmpdir, ignore_errors=True)
    ok, lines = summary_lines(
        published=published,
        elapsed_s=elapsed,
        frame_bytes=frame_bytes,
        mode=args.mode,
        done=done,
        received=received,
        failures=failures,
        samples=every,
    )
    print("\n".join(lines), flush=True)
    return 0 if ok else 1
