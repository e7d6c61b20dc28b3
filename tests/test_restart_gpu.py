"""GPU tier: consumers outlive their producers, and producers their consumers.

* One consumer process; for each of 100 producer processes it attaches the
  pool, subscribes, holds 4 frames (two complete, two whose frame flags the
  producer's stream never reaches: it is held by a spinning kernel), and the
  producer is SIGKILLed.  The consumer gets ``EndOfStream(clean=False)``, its
  stream's waits on the two flags are released by the subscriber itself
  (``Frame.complete`` is False for those), the complete frames' bytes are
  verified, and after closing everything its fds, sync-page mappings, host
  registrations, pool imports and device memory are where they were: the
  third (and hundredth) ``subscribe`` works.
* ``cip.follow`` across producer restarts and ``subscribe(wait=)``.
* A subscriber killed after its release was sent but before its stream wrote
  the read flag: the producer's stream, waiting on that flag, goes on.
* A publisher closed with a subscriber still connected frees its page.
* A 100,000-frame soak: a ``block`` and a ``latest`` subscriber together, the
  latter closing and subscribing again every 10,000 frames.

Producers are forked from a "zygote" process that has imported CuPy and the
library without initialising CUDA, so each restart costs a CUDA context, not
an interpreter start.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import select
import signal
import time
import warnings
from collections.abc import Iterator
from multiprocessing.connection import Client, Listener
from typing import Any

import numpy as np
import pytest

import cupy_ipcpool as cip
from tests._fds import fd_count
from tests.gpu_helpers import device_free, expected, fill, report_exception

pytestmark = [pytest.mark.gpu]

SPAWN = mp.get_context("spawn")

N = 1 << 16  # uint32 elements per frame (256 KiB)
HOLD, COMPLETE = 4, 2
CYCLES = int(os.environ.get("CUPY_IPCPOOL_RESTART_CYCLES", "100"))

SPIN_SRC = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""

CHECK_SRC = r"""
extern "C" __global__ void check(const unsigned int* a, unsigned long long n,
                                 unsigned int value, unsigned int* bad) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i < n; i += (unsigned long long)gridDim.x * blockDim.x)
        if (a[i] != value) { atomicAdd(bad, 1u); return; }
}
"""


@pytest.fixture
def address(tmp_path):
    return str(tmp_path / "chan.sock")


def _sync_pages() -> list[int]:
    """Start addresses of this process's sync page mappings."""
    with open("/proc/self/maps") as f:
        return [int(line.split("-")[0], 16) for line in f if "cupy_ipcpool-sync" in line]


def _registered(addr: int) -> bool:
    """True while host memory at ``addr`` is registered with CUDA."""
    from cupy_ipcpool import _driver

    try:
        _driver.call("cuMemHostGetFlags", addr)
    except cip.CudaError:
        return False
    return True


def _expect(conn: Any, timeout: float = 60.0) -> Any:
    assert conn.poll(timeout), f"nothing within {timeout} s"
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        pytest.fail(f"child raised {msg[1]}: {msg[2]}\n{msg[3]}")
    return msg


class _Pipe:
    """The child's end of a pipe, with report_exception's interface."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def put(self, msg: Any) -> None:
        self.conn.send(msg)


# -- producers (forked from the forkserver) ----------------------------------------


def _stalling_producer(address: str, seed: int, ctrl: str) -> None:
    """Publish 6 frames; the stream stalls (a spinning kernel) before the third's flag."""
    conn = Client(ctrl)
    try:
        import cupy as cp

        spin = cp.RawKernel(SPIN_SRC, "spin")
        with cip.IpcPool(8, N * 4) as pool:
            pub = cip.Publisher(pool, address)
            # load both kernels now: a first launch behind the spin would wait for it
            warm = cp.zeros(N, cp.uint32)
            fill(warm, 0)
            spin((1,), (1,), (cp.int64(0),))
            cp.cuda.Device(0).synchronize()
            del warm
            conn.send(("desc", pool.descriptor().to_bytes()))
            deadline = time.monotonic() + 60
            while not pub.subscribers:
                pub.poll(0.01)
                assert time.monotonic() < deadline, "no subscriber"
            hz = cp.cuda.Device(0).attributes["ClockRate"] * 1000
            for i in range(HOLD + 2):
                with pub.frame(timeout=30) as f:
                    a = f.array((N,), cp.uint32)
                    if i == COMPLETE:  # later flags wait behind 20 s of spinning
                        spin((1,), (1,), (cp.int64(20 * hz),))
                    fill(a, seed + i)
                    f.publish(a)
                del a
            conn.send(("published",))
            conn.recv()  # SIGKILLed here
    except BaseException:
        report_exception(_Pipe(conn))


def _frames_producer(address: str, seed: int, frames: int, ctrl: str) -> None:
    """Publish ``frames`` complete frames (seed + seq), then wait; close cleanly if told."""
    conn = Client(ctrl)
    try:
        import cupy as cp

        with cip.IpcPool(4, N * 4) as pool:
            pub = cip.Publisher(pool, address)
            deadline = time.monotonic() + 60
            while not pub.subscribers:
                pub.poll(0.01)
                assert time.monotonic() < deadline, "no subscriber"
            for i in range(frames):
                with pub.frame(timeout=30) as f:
                    a = f.array((N,), cp.uint32)
                    fill(a, seed + i)
                    f.publish(a)
                del a
            conn.send(("published",))
            if conn.recv() == "close":
                pub.close()
                conn.send(("closed",))
    except BaseException:
        report_exception(_Pipe(conn))


def _start(ctx: Any, target: Any, *args: Any) -> tuple[Any, Any]:
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def _kill(proc: Any) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    assert not proc.is_alive()


def _zygote(conn: Any) -> None:
    """Import what producers need (no CUDA), then fork one per request."""
    import cupy  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    while True:
        msg = conn.recv()
        if msg is None:
            return
        name, args = msg
        pid = os.fork()
        if pid == 0:
            conn.close()
            code = 1
            try:
                globals()[name](*args)
                code = 0
            finally:
                os._exit(code)
        conn.send(pid)


class Forked:
    """A producer forked by the zygote: its pid, a pidfd, and the connection to it."""

    def __init__(self, pid: int, conn: Any) -> None:
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        self.conn = conn

    def alive(self) -> bool:
        return not select.select([self.pidfd], [], [], 0)[0]

    def kill(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        assert select.select([self.pidfd], [], [], 30)[0], f"producer {self.pid} did not exit"

    def join(self, timeout: float) -> None:
        assert select.select([self.pidfd], [], [], timeout)[0], f"producer {self.pid} lives on"

    def close(self) -> None:
        if self.alive():
            self.kill()
        self.conn.close()
        os.close(self.pidfd)


class Zygote:
    def __init__(self, ctrl: str) -> None:
        self.ctrl = ctrl
        self.listener = Listener(ctrl, family="AF_UNIX")
        self.proc, self.conn = _start(SPAWN, _zygote)

    def start(self, target: Any, *args: Any) -> Forked:
        self.conn.send((target.__name__, (*args, self.ctrl)))
        assert self.conn.poll(60), "the zygote did not fork"
        pid = self.conn.recv()
        return Forked(pid, self.listener.accept())

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        self.listener.close()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: Any) -> Iterator[Zygote]:
    z = Zygote(str(tmp_path_factory.mktemp("zygote") / "ctrl.sock"))
    yield z
    z.close()


# -- one consumer, 100 producer deaths ---------------------------------------------


def _outliving_consumer(address: str, cycles: int, conn: Any) -> None:
    try:
        import cupy as cp

        from cupy_ipcpool._peer import cached_imports

        (cp.arange(4, dtype=cp.uint32) * 2).get()  # load CuPy's kernels before any wait
        for cycle in range(cycles):
            desc = cip.PoolDescriptor.from_bytes(conn.recv())
            peer = cip.attach(desc)  # as a user would, beside the subscription
            sub = cip.subscribe(address, wait=30)
            pages = _sync_pages()
            held = [sub.recv(timeout=30) for _ in range(HOLD)]
            deadline = time.monotonic() + 20
            while not all(f.complete for f in held[:COMPLETE]):
                assert time.monotonic() < deadline, "the complete frames' flags never came"
                time.sleep(0.001)
            assert [f.complete for f in held[COMPLETE:]] == [None] * (HOLD - COMPLETE)
            conn.send(("holding",))
            assert conn.recv() == "killed"
            t0 = time.monotonic()
            try:
                sub.recv(timeout=30)
                raise AssertionError("a frame queued when the producer died was handed out")
            except cip.EndOfStream as exc:
                assert not exc.clean, exc
            eos = time.monotonic() - t0
            complete = [f.complete for f in held]
            assert complete == [True] * COMPLETE + [False] * (HOLD - COMPLETE), complete
            seed = 1000 * cycle
            for i, f in enumerate(held[:COMPLETE]):
                np.testing.assert_array_equal(cp.asnumpy(f.array), expected(N, seed + i))
            for f in held[COMPLETE:]:
                cp.asnumpy(f.array)  # its stream's wait was released: this returns
            for f in held:
                f.release()
            del held, f
            sub.close()
            peer.close()
            gc.collect()
            conn.send(
                (
                    "closed",
                    fd_count(),
                    len(_sync_pages()),
                    any(_registered(p) for p in pages),
                    cached_imports(),
                    device_free(),
                    eos,
                )
            )
    except BaseException:
        report_exception(_Pipe(conn))


@pytest.mark.timeout(300)
@pytest.mark.device_memory
def test_one_consumer_outlives_100_sigkilled_producers(address, zygote):
    consumer, cconn = _start(SPAWN, _outliving_consumer, address, CYCLES)
    reports = []
    try:
        for cycle in range(CYCLES):
            producer = zygote.start(_stalling_producer, address, 1000 * cycle)
            try:
                kind, desc = _expect(producer.conn)
                assert kind == "desc"
                cconn.send(desc)
                assert _expect(producer.conn) == ("published",)
                assert _expect(cconn) == ("holding",)
                producer.kill()
                cconn.send("killed")
                reports.append(_expect(cconn))
            finally:
                producer.close()
        consumer.join(30)
        assert consumer.exitcode == 0
    finally:
        if consumer.is_alive():
            consumer.kill()
    fds = [r[1] for r in reports]
    assert len(set(fds[1:])) == 1, f"fds after each close: {fds}"
    assert {r[2] for r in reports} == {0}, "sync pages left mapped"
    assert not any(r[3] for r in reports), "sync pages left registered"
    assert {r[4] for r in reports} == {0}, "pool imports left"
    free = [r[5] for r in reports]
    assert free[-1] >= free[1] - (64 << 20), f"device memory shrank: {free[1]} -> {free[-1]}"
    assert max(r[6] for r in reports) < 5.0  # the end is seen at once


# -- follow() and subscribe(wait=) --------------------------------------------------


def _following_consumer(address: str, sessions: int, frames: int, conn: Any) -> None:
    try:
        import cupy as cp

        seen = []
        old = []
        with cip.follow(address, wait=30) as follower:
            for frame in follower:  # ends at the last producer's clean close
                session = follower.reconnects
                seen.append((session, frame.seq))
                np.testing.assert_array_equal(
                    cp.asnumpy(frame.array), expected(N, 1000 * session + frame.seq)
                )
                if frame.seq == frames - 1:
                    old.append(frame)  # an old publisher's last frame stays readable
                    conn.send(("session", session, fd_count()))
                else:
                    frame.release()  # the ring has fewer slots than a session's frames
            for f in old:
                assert f.complete
                cp.asnumpy(f.array)
                f.release()
            assert follower.last_end is not None and follower.last_end.clean
        conn.send(("done", seen))
    except BaseException:
        report_exception(_Pipe(conn))


@pytest.mark.timeout(120)
def test_follow_carries_on_across_producer_restarts_until_a_clean_close(address, zygote):
    sessions, frames = 5, 5
    consumer, cconn = _start(SPAWN, _following_consumer, address, sessions, frames)
    fds = []
    try:
        for s in range(sessions):
            producer = zygote.start(_frames_producer, address, 1000 * s, frames)
            assert _expect(producer.conn) == ("published",)
            kind, session, n = _expect(cconn)
            assert (kind, session) == ("session", s)
            fds.append(n)
            if s < sessions - 1:
                producer.kill()
            else:
                producer.conn.send("close")
                assert _expect(producer.conn) == ("closed",)
                producer.join(30)
            producer.close()
        kind, seen = _expect(cconn)
        assert seen == [(s, q) for s in range(sessions) for q in range(frames)]
        assert len(set(fds[1:])) == 1, fds
        consumer.join(30)
        assert consumer.exitcode == 0
    finally:
        if consumer.is_alive():
            consumer.kill()


def _early_consumer(address: str, conn: Any) -> None:
    try:
        import cupy as cp

        conn.send(("waiting",))
        t0 = time.monotonic()
        with cip.subscribe(address, wait=30) as sub:
            waited = time.monotonic() - t0
            values = [int(cp.asnumpy(sub.recv(timeout=30).array)[5]) for _ in range(3)]
        conn.send(("done", waited, values))
    except BaseException:
        report_exception(_Pipe(conn))


@pytest.mark.timeout(120)
def test_subscribe_waits_for_a_producer_that_starts_later(address, zygote):
    consumer, cconn = _start(SPAWN, _early_consumer, address)
    try:
        assert _expect(cconn) == ("waiting",)
        time.sleep(1.0)  # no socket at the address meanwhile
        producer = zygote.start(_frames_producer, address, 7, 3)
        assert _expect(producer.conn) == ("published",)
        _kind, waited, values = _expect(cconn)
        assert waited > 0.9
        assert values == [int(expected(N, 7 + i)[5]) for i in range(3)]
        producer.close()
    finally:
        if consumer.is_alive():
            consumer.kill()
    with pytest.raises(cip.UsageError, match="local publishers"):
        cip.subscribe("ucx://127.0.0.1:1", wait=1.0)
    with pytest.raises(cip.UsageError, match="ucx"):
        cip.follow("ucx://127.0.0.1:1")


# -- the producer outlives a consumer killed before its release landed ------------


def _slow_releaser(address: str, conn: Any) -> None:
    try:
        import cupy as cp

        spin = cp.RawKernel(SPIN_SRC, "spin")
        spin((1,), (1,), (cp.int64(0),))
        cp.cuda.Device(0).synchronize()
        hz = cp.cuda.Device(0).attributes["ClockRate"] * 1000
        sub = cip.subscribe(address)
        conn.send(("ready",))
        frame = sub.recv(timeout=30)
        spin((1,), (1,), (cp.int64(20 * hz),))  # "reads" the frame for 20 s
        t0 = time.monotonic()
        frame.release()  # the RELEASE goes now; the read-flag write after the spin
        conn.send(("released", time.monotonic() - t0))
        conn.recv()  # SIGKILLed here: the write dies with the context
    except BaseException:
        report_exception(_Pipe(conn))


@pytest.mark.timeout(120)
def test_a_consumer_killed_before_its_read_flag_landed_does_not_stall_the_producer(address):
    import cupy as cp

    before = _sync_pages()
    # Load the fill kernel before the reader's 20 s kernel takes the GPU: a first launch
    # loads its module, and without MPS that load waits behind the other context's kernel,
    # so the host would look at the read flag only after the reader's write had landed.
    warm = cp.zeros(N, cp.uint32)
    fill(warm, 0)
    cp.cuda.Device(0).synchronize()
    del warm
    with cip.IpcPool(2, N * 4) as pool:
        pub = cip.Publisher(pool, address)
        consumer, cconn = _start(SPAWN, _slow_releaser, address)
        try:
            assert _expect(cconn) == ("ready",)
            deadline = time.monotonic() + 60
            while not pub.subscribers:
                pub.poll(0.01)
                assert time.monotonic() < deadline
            with pub.frame(timeout=10) as f:
                f.publish(f.array((N,), cp.uint32))
                first = f.slot
            read = pub._published[first]  # what the reader writes into its read flag
            kind, release_s = _expect(cconn)
            assert kind == "released"
            # the release queues the read-flag write behind the reader's kernel: no host wait
            assert release_s < 5.0, f"release() blocked the host for {release_s:.1f} s"
            while pub.leases(first):
                pub.poll(0.01)
            with pub.frame(timeout=10) as f:  # the other slot
                f.publish(f.array((N,), cp.uint32))
            # (no synchronize here: without MPS the GPU may not give this context a turn
            # while the reader's 20 s kernel runs)
            stream = cp.cuda.get_current_stream()
            sync = pub._sync
            with pub.frame(timeout=10) as f:  # the first slot again: waits on the read flag
                assert f.slot == first
                # frame() looked at the read flag on the host before it returned: still
                # unset now, so it queued a wait for it on the producer's stream
                rows = [pub._rows.index(info.sub_id) for info in pub.subscribers]
                flags = [
                    int(sync._words[(sync.read_flag(row, first) - sync._base) >> 2])
                    for row in rows
                    if row is not None
                ]
                assert flags and read not in flags, (read, flags)
                a = f.array((N,), cp.uint32)
                fill(a, 3)
                f.publish(a)
                del a
            assert not stream.done
            _kill(consumer)
            t0 = time.monotonic()
            while not stream.done:
                pub.poll(0.01)  # notices the departure; its flags are written here
                assert time.monotonic() - t0 < 10, "the producer's stream stays stalled"
            stream.synchronize()
        finally:
            if consumer.is_alive():
                consumer.kill()
        pub.close()
    assert _sync_pages() == before


def _idle_subscriber(address: str, conn: Any) -> None:
    try:
        with cip.subscribe(address, mode="latest") as sub:  # the producer never waits for it
            conn.send(("ready",))
            frame = sub.recv(timeout=30)
            frame.release()
            conn.recv()  # stays connected past the publisher's close
    except BaseException:
        report_exception(_Pipe(conn))


@pytest.mark.timeout(120)
def test_close_with_a_subscriber_still_connected_frees_the_page(address):
    import cupy as cp

    before = _sync_pages()
    consumer, cconn = _start(SPAWN, _idle_subscriber, address)
    try:
        with cip.IpcPool(4, N * 4) as pool:
            pub = cip.Publisher(pool, address)
            assert _expect(cconn) == ("ready",)
            while not pub.subscribers:
                pub.poll(0.01)
            for _ in range(6):  # reuses the slot it read (and holds one more)
                with pub.frame(timeout=10) as f:
                    f.publish(f.array((N,), cp.uint32))
            pages = [p for p in _sync_pages() if p not in before]
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no "kept mapped (leaked)" warning
                pub.close(timeout=0.5)
            assert _sync_pages() == before and not any(_registered(p) for p in pages)
        cconn.send("go")
        consumer.join(30)
    finally:
        if consumer.is_alive():
            consumer.kill()


# -- soak: 100,000 frames, block and latest, one restarting every 10,000 -----------

SOAK_FRAMES, SOAK_EVERY, SOAK_N = 100_000, 10_000, 1024


def _soak_consumer(address: str, mode: str, restart_every: int, conn: Any) -> None:
    try:
        import cupy as cp

        check = cp.RawKernel(CHECK_SRC, "check")
        bad = cp.zeros(1, cp.uint32)
        check((1,), (32,), (bad, cp.uint64(0), cp.uint32(0), bad))
        cp.cuda.Device(0).synchronize()
        sessions, received, fds = [], 0, []
        boundary = restart_every
        done = False
        conn.send(("ready",))
        while not done:
            sub = cip.subscribe(address, mode=mode, wait=30)
            if sessions:
                # subscribed again: the producer counts its fds only between restarts
                conn.send(("session", len(sessions)))
            got, last, frame = 0, -1, None
            while True:
                try:
                    frame = sub.recv(timeout=60)
                except cip.EndOfStream as exc:
                    assert exc.clean, exc
                    done = True
                    break
                assert frame.seq > last
                if mode == "block":
                    assert frame.seq == last + 1 or last == -1, (last, frame.seq)
                last = frame.seq
                check((4,), (256,), (frame.array, cp.uint64(SOAK_N), cp.uint32(frame.seq), bad))
                frame.release()
                got += 1
                if restart_every and frame.seq >= boundary:
                    boundary += restart_every
                    break
            sub.close()
            del frame
            gc.collect()
            sessions.append(got)
            received += got
            fds.append(fd_count())
        cp.cuda.Device(0).synchronize()
        conn.send(("done", received, sessions, fds, int(bad.get()[0])))
    except BaseException:
        report_exception(_Pipe(conn))


@pytest.mark.timeout(180)
@pytest.mark.device_memory
def test_soak_100k_frames_block_and_latest_with_restarts(address):
    import cupy as cp

    block, bconn = _start(SPAWN, _soak_consumer, address, "block", 0)
    latest, lconn = _start(SPAWN, _soak_consumer, address, "latest", SOAK_EVERY)
    try:
        with cip.IpcPool(8, SOAK_N * 4) as pool:
            pub = cip.Publisher(pool, address)
            assert _expect(bconn) == ("ready",) and _expect(lconn) == ("ready",)
            deadline = time.monotonic() + 60
            while len(pub.subscribers) < 2:
                pub.poll(0.01)
                assert time.monotonic() < deadline
            marks = []
            for seq in range(SOAK_FRAMES):
                if seq % SOAK_EVERY == SOAK_EVERY // 2 and seq > SOAK_EVERY:
                    # Halfway between two restarts of the latest subscriber: wait until it
                    # has subscribed again after the restart at the last boundary (its next
                    # restart needs a frame past the next one) and the producer has dropped
                    # its old connection, so no connection is half open or half closed
                    # when the producer's fds are counted.
                    deadline = time.monotonic() + 60
                    while not lconn.poll(0):
                        pub.poll(0.01)
                        assert time.monotonic() < deadline, "the latest subscriber never came back"
                    assert _expect(lconn) == ("session", seq // SOAK_EVERY)
                    while len(pub.subscribers) != 2:
                        pub.poll(0.01)
                        assert time.monotonic() < deadline, pub.subscribers
                    cp.cuda.Device(0).synchronize()
                    # The subscriber that left keeps its pidfd among the departed until the
                    # publisher next looks (every 10 ms, from poll and frame) and finds our
                    # streams past every wait on its row: bounded, given back, not a leak.
                    while pub._rows.departed:
                        pub.poll(0.01)
                        assert time.monotonic() < deadline, "a departed reader never settled"
                    gc.collect()
                    marks.append((fd_count(), device_free()))
                with pub.frame(timeout=30) as f:
                    a = f.array((SOAK_N,), cp.uint32)
                    a.fill(seq)
                    f.publish(a)
                del a
            cp.cuda.Device(0).synchronize()
            pub.close()
        _kind, b_got, _b_sessions, _b_fds, b_bad = _expect(bconn, 120)
        _kind, l_got, l_sessions, l_fds, l_bad = _expect(lconn, 120)
        block.join(30)
        latest.join(30)
    finally:
        for p in (block, latest):
            if p.is_alive():
                p.kill()
    assert b_got == SOAK_FRAMES and b_bad == 0
    assert l_bad == 0 and 0 < l_got <= SOAK_FRAMES
    assert len(l_sessions) >= SOAK_FRAMES // SOAK_EVERY and all(n > 0 for n in l_sessions[:-1])
    assert len(set(l_fds[1:])) == 1, f"the restarting subscriber's fds: {l_fds}"
    assert len({m[0] for m in marks[1:]}) == 1, f"the producer's fds: {marks}"
    assert max(m[1] for m in marks[1:]) - min(m[1] for m in marks[1:]) < (4 << 20), marks
