"""The C library's GPU half: a Python ``Publisher`` feeding a C subscriber (GPU only).

The C side is ``c/tests/gpu_consumer.c``, built here with the system compiler
(no CUDA toolkit: the driver is loaded at run time).  What each test checks:

* ``test_c_subscriber_checks_every_frame``: 10,000 frames in all (1 MiB and
  64 MiB, block and latest).  The producer fills each frame on its own stream
  with a pattern that depends on the frame's seed; the C subscriber's stream
  waits on the frame flag (``cip_frame_wait``), copies to pinned host memory
  on that same stream three 4 KiB samples of every frame (first, last, and one
  that moves with the seed) and, every ``full_every``-th frame, the whole frame
  (every frame at 1 MiB, every 16th at 64 MiB), checks every copied element,
  and releases on the stream.  A missing wait or a slot reused under a lease
  shows as mismatching elements (the previous frame's pattern).
* ``test_producer_killed_while_the_c_stream_waits``: the producer's stream is
  busy for 30 s before it would write the frame flag; the C subscriber's
  stream waits on that flag; the producer is SIGKILLed.  The C side must
  report end-of-stream with the flag already set (the library writes the
  flag the dead producer never will, waiting for the producer's pidfd when
  the socket's hang-up comes first), so that its stream, synchronised right
  after the end, finishes; ``cip_frame_complete`` then says 0, one flag was
  forced, and every fd the library took is closed.
* ``test_c_attach_and_array_from_handle``: ``cip_pool_attach`` of an
  ``IpcPool``'s descriptor bytes (pidfd and the fd server) and
  ``cip_array_from_handle`` of an ``ArrayHandle``'s bytes read every element.

Run: ``python -m pytest -q -p no:cacheprovider tests/test_c_library_gpu.py``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import select
import signal
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_c_library import C_DIR, build_c_program

pytestmark = pytest.mark.gpu

MiB = 1 << 20
#: What the library's own fds look like in /proc/PID/fd (the driver keeps none of these).
LIBRARY_FD_KINDS = ("socket:", "/memfd:", "/proc/")
SPAWN = mp.get_context("spawn")


@pytest.fixture(scope="module")
def consumer_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_c_program(
        tmp_path_factory.mktemp("cgpu"), "gpu_consumer", [C_DIR / "tests" / "gpu_consumer.c"]
    )


@pytest.fixture
def address(tmp_path: Path) -> str:
    return str(tmp_path / "c.sock")


def _line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The C program's next output line (within ``timeout``)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"the C consumer said nothing within {timeout} s")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"the C consumer exited with {proc.wait()}")
    return line.strip()


def _report(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    lines = [x for x in out.strip().splitlines() if x.startswith("{")]
    assert lines, f"no report from the C consumer (exit {proc.returncode}): {out}{err}"
    report = json.loads(lines[-1])
    assert "error" not in report, report["error"]
    assert proc.returncode == 0, report
    return report


@pytest.fixture
def c_process() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def _warm_up(cp: Any, fill: Any, stream: Any) -> None:
    """Load the fill kernel before the first frame (docs/protocol.md, 'load kernels first')."""
    scratch = cp.empty(16, dtype=cp.uint32)
    with stream:
        fill(scratch, 0)
    stream.synchronize()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("mode", "mib", "frames", "full_every"),
    [
        ("block", 1, 3000, 1),
        ("latest", 1, 3000, 1),
        ("block", 64, 2000, 16),
        ("latest", 64, 2000, 16),
    ],
)
def test_c_subscriber_checks_every_frame(
    consumer_exe: Path,
    address: str,
    c_process: list[subprocess.Popen[str]],
    mode: str,
    mib: int,
    frames: int,
    full_every: int,
) -> None:
    import cupy as cp
    from gpu_helpers import fill

    import cupy_ipcpool as cip

    nelem = mib * MiB // 4
    t0 = time.monotonic()
    with cip.IpcPool(8, mib * MiB) as pool, cip.Publisher(pool, address) as pub:
        proc = subprocess.Popen(
            [str(consumer_exe), "check", address, mode, str(full_every)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        c_process.append(proc)
        assert _line(proc, 60) == "ready"
        deadline = time.monotonic() + 30
        while not pub.subscribers:
            assert time.monotonic() < deadline, "the C subscriber was not adopted"
            pub.poll(0.05)
        stream = cp.cuda.Stream(non_blocking=True)
        _warm_up(cp, fill, stream)
        for i in range(frames):
            with pub.frame(timeout=30, stream=stream) as f:
                a = f.array((nelem,), "uint32")
                with stream:
                    fill(a, i + 1)
                f.publish(a, metadata=struct.pack("<Q", i + 1))
                del a
        stream.synchronize()
    report = _report(proc, 60)
    elapsed = time.monotonic() - t0
    assert report["mismatches"] == 0, report
    assert report["out_of_order"] == 0, report
    if mode == "block":
        assert report["frames"] == frames, report
        assert report["gaps"] == 0 and report["last_seq"] == frames - 1, report
        assert report["full_checks"] == -(-frames // full_every), report
    else:
        assert 1 <= report["frames"] <= frames, report
        assert report["full_checks"] >= 1, report
    per_frame = (3 * 4096) + (nelem * 4 if full_every == 1 else 0)
    assert report["bytes_checked"] >= report["frames"] * per_frame, report
    print(f"{mode} {mib} MiB: {report} in {elapsed:.1f} s")


def _dying_producer(address: str, queue: Any) -> None:
    """Publish one frame whose flag write waits behind a 30 s kernel, then wait to be killed."""
    import cupy as cp

    import cupy_ipcpool as cip

    spin = cp.RawKernel(
        r"""
        extern "C" __global__ void spin(long long cycles) {
            long long t0 = clock64();
            while (clock64() - t0 < cycles) { }
        }
        """,
        "spin",
    )
    with cip.IpcPool(2, MiB) as pool, cip.Publisher(pool, address) as pub:
        queue.put("listening")
        deadline = time.monotonic() + 60
        while not pub.subscribers and time.monotonic() < deadline:
            pub.poll(0.05)
        stream = cp.cuda.Stream(non_blocking=True)
        spin((1,), (1,), (cp.int64(1000),), stream=stream)  # load the module first
        stream.synchronize()
        rate = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrClockRate, 0)
        with pub.frame(stream=stream) as f:
            a = f.array((256,), "uint32")
            spin((1,), (1,), (cp.int64(30 * rate * 1000),), stream=stream)  # ~30 s
            f.publish(a, metadata=struct.pack("<Q", 1))
            del a
        queue.put("published")
        time.sleep(300)


@pytest.mark.timeout(180)
def test_producer_killed_while_the_c_stream_waits(
    consumer_exe: Path, address: str, c_process: list[subprocess.Popen[str]]
) -> None:
    queue = SPAWN.Queue()
    producer = SPAWN.Process(target=_dying_producer, args=(address, queue), daemon=True)
    producer.start()
    try:
        assert queue.get(timeout=120) == "listening"
        proc = subprocess.Popen(
            [str(consumer_exe), "death", address],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        c_process.append(proc)
        assert _line(proc, 60) == "ready"
        assert queue.get(timeout=60) == "published"
        assert _line(proc, 60) == "waiting"  # its stream waits on the unwritten flag
        t0 = time.monotonic()
        assert producer.pid is not None
        os.kill(producer.pid, signal.SIGKILL)
        report = _report(proc, 60)
        elapsed = time.monotonic() - t0
    finally:
        if producer.is_alive():
            producer.kill()
        producer.join(30)
    assert report["end"] == "CIP_ERR_PUBLISHER_GONE", report
    # the end is reported once the producer has exited, and by then the flag is set:
    # a stream synchronised right after the end finishes (no later call needed)
    assert report["forced_at_end"] == 1, report
    assert report["sync_rc"] == 0, report
    assert report["sync_s"] < 10.0, report  # not the 30 s kernel, and not forever
    assert report["complete"] == 0 and report["forced"] == 1, report  # the library set the flag
    assert report["release"] == "CIP_OK", report  # a release after the end only forgets
    # the library's own fds (its socket, the pidfd, the sync page's memfd) are all
    # closed; the driver may keep fds it opened for the first import in this process
    new = [fd.split("=", 1)[1] for fd in report["new_fds"]]
    assert not [t for t in new if t.startswith(LIBRARY_FD_KINDS) or "pidfd" in t], report
    assert elapsed < 30.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["pidfd", "socket"])
def test_c_attach_and_array_from_handle(consumer_exe: Path, transport: str) -> None:
    import cupy as cp
    from gpu_helpers import fill

    import cupy_ipcpool as cip

    with cip.IpcPool(3, MiB) as pool:
        token = pool.acquire()
        try:
            a = token.array((MiB // 8,), "uint32")  # half the slot
            fill(a, 1)
            cp.cuda.get_current_stream().synchronize()
            handle = pool.handle(a).pack()
            desc = pool.descriptor(transport="socket" if transport == "socket" else "pidfd")
            done = subprocess.run(
                [str(consumer_exe), "attach", desc.to_bytes().hex(), handle.hex(), transport],
                capture_output=True,
                text=True,
                timeout=60,
            )
            del a
        finally:
            token.release()
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    assert lines, done.stdout + done.stderr
    report = json.loads(lines[-1])
    assert "error" not in report, report
    assert report["num_slots"] == 3 and report["nbytes"] == MiB // 2, report
    assert report["mismatches"] == 0, report
    assert report["older_generation"] in ("CIP_ERR_STALE", "-"), report
