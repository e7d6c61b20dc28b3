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
  after the end, finishes; ``cip_frame_complete`` then says 0 (also after the
  frame's release), ``cip_sub_incomplete_frames`` lists it, one flag was
  forced, and every fd the library took is closed.
* ``test_c_attach_and_array_from_handle``: ``cip_pool_attach`` of an
  ``IpcPool``'s descriptor bytes (pidfd and the fd server) and
  ``cip_array_from_handle`` of an ``ArrayHandle``'s bytes read every element.
* ``test_c_pool_close_waits_for_queued_work`` and
  ``test_c_subscriber_close_waits_for_queued_work``: in a child process that
  drives the library through ctypes, a CuPy kernel that writes into a mapped
  slot only after ~200 ms is queued, the pool (or the subscription) is closed
  at once, and then a synchronize must succeed: the close waited for the
  kernel (``cuCtxSynchronize``) instead of unmapping under it.
* ``test_c_complete_matches_the_gpu_check_of_every_frame_after_a_sigkill``: the
  C library's answers after a producer's death, frame by frame against a GPU
  check of the data (block mode, 8 slots of 1 MiB, a check slower than the
  producer's fill, the producer SIGKILLed after 1,500 frames with hundreds in
  flight): ``cip_frame_complete`` calls no bad frame complete and no good one
  incomplete, and ``cip_sub_incomplete_frames`` lists exactly the bad ones.
* ``test_c_block_subscriber_of_an_ahead_publisher_calls_a_void_frame_incomplete``: a
  ``Publisher(ahead=True)``'s frame taken and not published reaches the C block
  subscriber as a void frame (marked in its FRAME payload): taken, with no arrays,
  ``cip_frame_complete`` 0 for it and 1 for the frames around it, not in
  ``cip_sub_incomplete_frames``.

Run: ``python -m pytest -q -p no:cacheprovider tests/test_c_library_gpu.py``.
"""

from __future__ import annotations

import ctypes
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
from gpu_helpers import (
    DEATH_CAP,
    DEATH_KILL_AT,
    DEATH_N,
    DELAY_NS,
    LATE_SRC,
    death_producer,
    publish_41s_to_first_subscriber,
    run_child_for_result,
    slow_check_kernel,
)
from test_c_library import C_DIR, build_c_library, build_c_program

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


@pytest.fixture(scope="module")
def clib_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The library as a shared object, for the children that drive it through ctypes."""
    return build_c_library(tmp_path_factory.mktemp("clib"))


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
    # the answer stays once the frame is released, and the end-of-stream report has it
    assert report["complete_released"] == 0, report
    assert report["listed"] == "CIP_OK" and report["incomplete"] == [report["seq"]], report
    assert report["close"] == "CIP_OK", report
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


# ---------------------------------------------------------------- close under queued work


def _late_kernel() -> Any:
    """The late kernel (LATE_SRC), loaded (a module load waits for queued work: do it first)."""
    import cupy as cp

    kernel = cp.RawKernel(LATE_SRC, "late")
    scratch = cp.zeros(2, cp.uint32)
    kernel((1,), (1,), (scratch, scratch[1:], cp.uint64(0)))
    cp.cuda.Device(0).synchronize()
    return kernel


def _late_case_start(lib_path: str) -> tuple[Any, Any, Any]:
    """In a case's child: device 0 in use; ``(C library, late kernel, its output buffer)``."""
    import cupy as cp
    from test_c_library import CLib

    cp.cuda.Device(0).use()
    lib = CLib(lib_path)
    kernel = _late_kernel()
    out = cp.zeros(1, cp.uint32)
    cp.cuda.Device(0).synchronize()
    return lib, kernel, out


def _c_pool_case(lib_path: str, desc: bytes, where: str, queue: Any) -> None:
    """Attach with cip_pool_attach, queue the late kernel on slot 0, cip_pool_close at once."""
    try:
        import cupy as cp
        from test_c_library import CIP_TRANSPORT_AUTO

        lib, kernel, out = _late_case_start(lib_path)
        pool = ctypes.c_void_p()
        lib.check(
            lib.cip_pool_attach(desc, len(desc), -1, CIP_TRANSPORT_AUTO, ctypes.byref(pool)),
            "cip_pool_attach",
        )
        ptr = ctypes.c_uint64()
        lib.check(lib.cip_pool_slot_ptr(pool, 0, ctypes.byref(ptr)), "cip_pool_slot_ptr")
        stream = cp.cuda.Stream(non_blocking=True) if where == "side" else cp.cuda.Stream.null
        t0 = time.monotonic()
        with stream:
            kernel((1,), (1,), (cp.uint64(ptr.value), out, cp.uint64(DELAY_NS)))
        st = lib.cip_pool_close(pool)
        t1 = time.monotonic()
        cp.cuda.Device(0).synchronize()  # CUDA_ERROR_ILLEGAL_ADDRESS if the slot went first
        queue.put(("ok", lib.why(st), int(out.get()[0]), t1 - t0))
    except BaseException:
        from gpu_helpers import report_exception

        report_exception(queue)


def _c_subscriber_case(lib_path: str, address: str, where: str, queue: Any) -> None:
    """Receive a frame with the C library, queue the late kernel on it, release, close."""
    try:
        import cupy as cp
        from test_c_library import CipFrame

        lib, kernel, out = _late_case_start(lib_path)
        sub = lib.subscribe(address)
        stream = cp.cuda.Stream(non_blocking=True)
        f = CipFrame()
        lib.check(lib.cip_sub_recv(sub, 30000, ctypes.byref(f)), "cip_sub_recv")
        lib.check(lib.cip_frame_wait(sub, ctypes.byref(f), stream.ptr), "cip_frame_wait")
        # "current": the kernel on the stream that releases (the read-flag write waits
        # for it); "side": on another stream, ordered after the wait but not before the
        # release, so only the pool's close can wait for it
        other = stream if where == "current" else cp.cuda.Stream(non_blocking=True)
        if other is not stream:
            other.wait_event(stream.record())
        t0 = time.monotonic()
        with other:
            kernel((1,), (1,), (cp.uint64(f.arrays[0].data), out, cp.uint64(DELAY_NS)))
        lib.check(lib.cip_sub_release(sub, ctypes.byref(f), stream.ptr), "cip_sub_release")
        st = lib.cip_sub_close(sub)
        t1 = time.monotonic()
        lib.cip_sub_free(sub)
        cp.cuda.Device(0).synchronize()  # CUDA_ERROR_ILLEGAL_ADDRESS if the slot went first
        queue.put(("ok", lib.why(st), int(out.get()[0]), t1 - t0))
    except BaseException:
        from gpu_helpers import report_exception

        report_exception(queue)


def _check_waited(result: tuple[Any, ...]) -> None:
    assert result[0] == "ok", result
    _, closed, value, closed_after = result
    assert closed.startswith("CIP_OK"), closed
    assert value == 42, f"the late kernel read {value}, not 42"
    # the close waited for the kernel rather than unmapping under it
    assert closed_after >= DELAY_NS / 1e9 * 0.9, closed_after


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["null", "side"])
def test_c_pool_close_waits_for_queued_work(clib_path: Path, where: str) -> None:
    import cupy as cp

    import cupy_ipcpool as cip

    with cip.IpcPool(2, 4 * MiB) as pool:
        a = pool.array((1024,), cp.uint32, slot=0)
        a.fill(41)
        cp.cuda.Device(0).synchronize()
        del a
        desc = pool.descriptor(transport="auto").to_bytes()
        result, exitcode = run_child_for_result(_c_pool_case, str(clib_path), desc, where)
    assert exitcode == 0, (exitcode, result)
    _check_waited(result)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["current", "side"])
def test_c_subscriber_close_waits_for_queued_work(
    clib_path: Path, address: str, where: str
) -> None:
    import queue as queue_mod

    import cupy_ipcpool as cip

    with cip.IpcPool(4, 4 * MiB) as pool, cip.Publisher(pool, address) as pub:
        queue = SPAWN.Queue()
        proc = SPAWN.Process(
            target=_c_subscriber_case, args=(str(clib_path), address, where, queue)
        )
        proc.start()
        try:
            publish_41s_to_first_subscriber(pub, "the C subscriber")
            result = None
            deadline = time.monotonic() + 90
            while result is None:
                pub.poll(0.01)  # takes the RELEASE and the BYE
                try:
                    result = queue.get(timeout=0.05)
                except queue_mod.Empty:
                    assert proc.is_alive() or not queue.empty(), f"child exit {proc.exitcode}"
                    assert time.monotonic() < deadline, "no result from the C subscriber"
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    _check_waited(result)


# ---------------------------------------------------------------- exact answers after a death

KILL_AT, CAP = DEATH_KILL_AT, DEATH_CAP  # the death case of gpu_helpers.py


def _death_consumer(lib_path: str, address: str, producer_pid: int, queue: Any) -> None:
    """The C library's subscriber (through ctypes) with a slow CuPy check per frame.

    Per frame: cip_sub_recv, cip_frame_wait on the stream, the check kernel on the
    frame's pointer, cip_sub_release on the stream at once, cip_frame_complete; the
    producer is SIGKILLed after KILL_AT frames.  Then, with every check done, what the
    checks found beside what the library answers.
    """
    try:
        import cupy as cp
        from test_c_library import CIP_MODE_BLOCK, CipFrame, CLib

        dev = cp.cuda.Device(0)
        dev.use()
        lib = CLib(lib_path)
        check, grid, cycles, result = slow_check_kernel(dev)
        sub = lib.subscribe(address, CIP_MODE_BLOCK)
        stream = cp.cuda.Stream(non_blocking=True)
        frames: list[tuple[int, int, int]] = []  # (seq, slot, generation)
        at_release: dict[int, int] = {}
        killed_at = None
        while True:
            f = CipFrame()
            st = lib.cip_sub_recv(sub, 60000, ctypes.byref(f))
            if st != 0:
                end = lib.why(st)
                break
            (seed,) = struct.unpack("<I", ctypes.string_at(f.metadata, f.metadata_len))
            assert f.seq < CAP and f.num_arrays == 1
            lib.check(lib.cip_frame_wait(sub, ctypes.byref(f), stream.ptr), "cip_frame_wait")
            with stream:
                check(
                    (grid,),
                    (256,),
                    (
                        cp.uint64(f.arrays[0].data),
                        cp.uint64(DEATH_N),
                        cp.uint32(seed),
                        cp.int64(cycles),
                        result,
                        cp.uint64(f.seq),
                        cp.uint64(CAP),
                    ),
                )
            # at once: the read flag is written after the check
            lib.check(lib.cip_sub_release(sub, ctypes.byref(f), stream.ptr), "cip_sub_release")
            at_release[f.seq] = lib.cip_frame_complete(sub, ctypes.byref(f))
            frames.append((f.seq, f.slot, f.generation))
            if len(frames) == KILL_AT:
                os.kill(producer_pid, signal.SIGKILL)
                killed_at = len(frames)
        # every wait of ours ends (the flags the producer never set were forced)
        deadline = time.monotonic() + 60
        while not stream.done:
            if time.monotonic() > deadline:
                raise AssertionError(f"the consumer's stream still waits after the end ({end})")
            time.sleep(0.01)
        got = cp.asnumpy(result)
        complete = {
            seq: lib.cip_frame_complete(sub, ctypes.byref(lib.frame(seq, slot, gen)))
            for seq, slot, gen in frames
        }
        report = {
            "end": end,
            "killed_at": killed_at,
            "frames": frames,
            "checks": {seq: int(got[seq]) for seq, _, _ in frames},
            "complete": complete,
            "at_release": at_release,
            "incomplete": lib.incomplete(sub),
            "untracked": int(lib.cip_sub_untracked_frames(sub)),
            "forced": int(lib.cip_sub_forced_flags(sub)),
        }
        report["close"] = lib.why(lib.cip_sub_close(sub))
        # protocol.md: the answers stay readable after close (until cip_sub_free)
        report["complete_after_close"] = {
            seq: lib.cip_frame_complete(sub, ctypes.byref(lib.frame(seq, slot, gen)))
            for seq, slot, gen in frames
        }
        report["incomplete_after_close"] = lib.incomplete(sub)
        lib.cip_sub_free(sub)
        dev.synchronize()
        queue.put(("ok", report))
    except BaseException:
        from gpu_helpers import report_exception

        report_exception(queue)


@pytest.mark.timeout(300)
def test_c_complete_matches_the_gpu_check_of_every_frame_after_a_sigkill(
    clib_path: Path, address: str
) -> None:
    import queue as queue_mod

    pq, cq = SPAWN.Queue(), SPAWN.Queue()
    producer = SPAWN.Process(target=death_producer, args=(address, pq), daemon=True)
    producer.start()
    consumer = None
    try:
        msg = pq.get(timeout=120)
        assert msg == ("ready",), msg
        assert producer.pid is not None
        consumer = SPAWN.Process(
            target=_death_consumer, args=(str(clib_path), address, producer.pid, cq), daemon=True
        )
        consumer.start()
        try:
            msg = cq.get(timeout=240)
        except queue_mod.Empty:
            extra = pq.get_nowait() if not pq.empty() else None
            pytest.fail(f"no report from the C consumer (producer said {extra})")
        assert msg[0] == "ok", msg
        report = msg[1]
        consumer.join(60)
        assert consumer.exitcode == 0, consumer.exitcode
    finally:
        for proc in (producer, consumer):
            if proc is not None and proc.is_alive():
                proc.kill()
                proc.join(10)
    assert report["killed_at"] == KILL_AT, f"the stream ended early: {report['end']}"
    assert report["end"].startswith("CIP_ERR_PUBLISHER_GONE"), report["end"]
    frames = report["frames"]
    seqs = [seq for seq, _, _ in frames]
    assert seqs == list(range(len(frames))), "block mode: every frame, in order"
    checks, complete = report["checks"], report["complete"]
    assert all(checks[s] & 1 for s in seqs), "a check never ran"
    bad = [s for s in seqs if checks[s] & 2]
    good = set(seqs) - set(bad)
    assert -1 not in complete.values(), "a frame left unanswered after the death"
    assert report["complete_after_close"] == complete, "the answers changed at close"
    assert report["incomplete_after_close"] == report["incomplete"]
    called_incomplete = [s for s in seqs if complete[s] == 0]
    # The one frame the producer's GPU was on when it died may have been filled
    # completely with its flag write not yet run: its data is right, and it is
    # (conservatively) called incomplete.  Any other disagreement is wrong.
    in_flight = called_incomplete[:1]
    wrong = [
        (s, complete[s], s in good)
        for s in seqs
        if (complete[s] == 1) != (s in good) and s not in in_flight
    ]
    assert not wrong, f"{len(wrong)} frames answered wrongly, e.g. {wrong[:10]}"
    assert all(complete[s] == 0 for s in bad)
    assert bad, (
        "no frame was unwritten at the death: the hosts did not run ahead of the GPUs, "
        "so this test proves nothing (make the check slower)"
    )
    assert called_incomplete in (bad, in_flight + bad)
    # answered at release: -1 or 1 before the kill (the producer alive), 1 only if good
    at_release = report["at_release"]
    assert all(at_release[s] != 0 for s in seqs if s < KILL_AT)
    assert all(s in good for s in seqs if at_release[s] == 1)
    assert report["incomplete"] == called_incomplete and report["untracked"] == 0, report
    # frames written before the death in slots that were forced (the old rule called
    # them incomplete): there are some, and they are complete
    forced_slots = {slot for seq, slot, _ in frames if seq in set(bad)}
    assert any(seq in good and slot in forced_slots for seq, slot, _ in frames)
    assert report["forced"] >= 1 and report["close"].startswith("CIP_OK"), report
    print(
        f"{len(frames)} frames received, {len(bad)} unwritten at the death (kill at "
        f"{KILL_AT}), {len(called_incomplete)} called incomplete; {report['forced']} flags "
        "forced"
    )


# ---------------------------------------------------------------- void frames of an ahead publisher


def _c_void_case(lib_path: str, address: str, frames: int, queue: Any) -> None:
    """The C library's block subscriber (through ctypes): per frame, its seq, number of
    arrays and cip_frame_complete (waited for while -1: the producer's stream has not set
    the flag yet), then cip_frame_complete again after its release; and the
    incomplete frames after the last one."""
    try:
        import cupy as cp
        from test_c_library import CIP_MODE_BLOCK, CipFrame, CLib

        cp.cuda.Device(0).use()
        lib = CLib(lib_path)
        sub = lib.subscribe(address, CIP_MODE_BLOCK)
        stream = cp.cuda.Stream(non_blocking=True)
        got = []
        for _ in range(frames):
            f = CipFrame()
            lib.check(lib.cip_sub_recv(sub, 30000, ctypes.byref(f)), "cip_sub_recv")
            deadline = time.monotonic() + 30
            while (complete := lib.cip_frame_complete(sub, ctypes.byref(f))) < 0:
                assert time.monotonic() < deadline, f"frame {f.seq}'s flag was never set"
                time.sleep(0.01)
            lib.check(lib.cip_sub_release(sub, ctypes.byref(f), stream.ptr), "cip_sub_release")
            again = lib.cip_frame_complete(sub, ctypes.byref(f))
            got.append((int(f.seq), int(f.num_arrays), complete, again))
        incomplete = lib.incomplete(sub)
        stream.synchronize()
        lib.check(lib.cip_sub_close(sub), "cip_sub_close")
        lib.cip_sub_free(sub)
        queue.put(("ok", got, incomplete))
    except BaseException:
        from gpu_helpers import report_exception

        report_exception(queue)


@pytest.mark.timeout(120)
def test_c_block_subscriber_of_an_ahead_publisher_calls_a_void_frame_incomplete(
    clib_path: Path, address: str
) -> None:
    """A Publisher(ahead=True) sends a frame taken and not published as a void frame (its
    FRAME payload marked): the C library's block subscriber takes it (no arrays) and goes
    on, cip_frame_complete says 0 for it (held and released) and 1 for the frames around
    it, and cip_sub_incomplete_frames does not list it (the producer's stream set its
    flag)."""
    import queue as queue_mod

    import cupy as cp

    import cupy_ipcpool as cip

    with cip.IpcPool(4, 4 * MiB) as pool, cip.Publisher(pool, address, ahead=True) as pub:
        result = None
        queue = SPAWN.Queue()
        proc = SPAWN.Process(target=_c_void_case, args=(str(clib_path), address, 3, queue))
        proc.start()
        try:
            deadline = time.monotonic() + 60
            while not pub.subscribers:
                pub.poll(0.01)
                assert time.monotonic() < deadline, "the C subscriber never joined"
            for seq in range(3):
                with pub.frame(timeout=30) as f:
                    a = f.array((1024,), cp.uint32)
                    if seq != 1:  # frame 1: taken and not published
                        a.fill(seq)
                        f.publish(a)
                    del a
            deadline = time.monotonic() + 60
            while result is None:
                pub.poll(0.01)  # takes the RELEASEs and the BYE
                try:
                    result = queue.get(timeout=0.05)
                except queue_mod.Empty:
                    assert proc.is_alive() or not queue.empty(), f"child exit {proc.exitcode}"
                    assert time.monotonic() < deadline, "no result from the C subscriber"
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
            exitcode = proc.exitcode
    assert result is not None and result[0] == "ok", result
    _, got, incomplete = result
    assert got == [(0, 1, 1, 1), (1, 0, 0, 0), (2, 1, 1, 1)]
    assert incomplete == []
    assert exitcode == 0
