"""GPU tier: publish/subscribe frames between real processes."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import random
import signal
import struct
import time

import numpy as np
import pytest

import cupy_ipcpool as cip
from tests._fds import fd_count
from tests.gpu_helpers import (
    child_message,
    device_free,
    fill,
    report_exception,
    spin_kernel,
    start_child,
    wait_subscribers,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(150)]

SPAWN = mp.get_context("spawn")
SEQ = struct.Struct("<Q")


@pytest.fixture
def address(tmp_path):
    return str(tmp_path / "chan.sock")


# --------------------------------------------------------------------- ordering


def _ordering_consumer(address, q):
    try:
        import cupy as cp

        # load the kernel module first: CuPy loads modules lazily, and loading one
        # waits for the context's queued work (it would wait for the producer here)
        (cp.arange(4, dtype=cp.uint32) * 2).get()
        with cip.subscribe(address) as sub:
            q.put(("ready",))
            frame = sub.recv(timeout=60)
            t_recv = time.monotonic()
            doubled = frame.array * 2  # a kernel on the frame, ordered after the producer's
            t_launch = time.monotonic()
            values = cp.asnumpy(frame.array)
            twice = cp.asnumpy(doubled)
            frame.release()
            q.put(
                (
                    "result",
                    t_recv,
                    t_launch,
                    int(values.min()),
                    int(values.max()),
                    bool((twice == 2 * values).all()),
                )
            )
    except BaseException:
        report_exception(q)


def test_consumer_sees_final_values_without_blocking_its_host(address):
    import cupy as cp

    spin = spin_kernel("spin_fill")
    with cip.IpcPool(2, 1 << 22) as pool, cip.Publisher(pool, address) as pub:
        proc, q = start_child(_ordering_consumer, address)
        assert child_message(q)[0] == "ready"
        wait_subscribers(pub, 1)
        with pub.frame() as f:
            a = f.array((1 << 20,), cp.uint32)
            a.fill(1)
            clock_hz = cp.cuda.Device(0).attributes["ClockRate"] * 1000
            spin(
                (132,),
                (256,),
                (a, cp.uint64(a.size), cp.uint32(0xC0FFEE), cp.int64(int(0.5 * clock_hz))),
            )
            f.publish(a)
        del a
        cp.cuda.Device(0).synchronize()
        t_producer_done = time.monotonic()
        _, t_recv, t_launch, lo, hi, doubled_ok = child_message(q)
        proc.join(30)
    # the consumer received the frame and launched work on it while the producer's
    # kernel was still running: neither recv() nor the launch waited on the host
    assert t_recv < t_producer_done
    assert t_launch < t_producer_done
    # and its GPU work saw only the final values
    assert lo == hi == 0xC0FFEE
    assert doubled_ok


# ------------------------------------------------------------- content under load


def _checking_consumer(address, mode, frames_wanted, slow, q, device=None):
    try:
        import cupy as cp

        if device is not None:
            cp.cuda.Device(device).use()  # the current stream (recv's default) is this device's
        rng = random.Random(os.getpid())
        got, bad, seqs = 0, [], []
        with cip.subscribe(address, mode=mode, device=device) as sub:
            q.put(("ready",))
            for frame in sub:
                (seq,) = SEQ.unpack(frame.metadata)
                a = frame.array
                first = cp.asnumpy(a)
                if slow and rng.random() < 0.05:
                    time.sleep(rng.random() * 0.004)
                second = cp.asnumpy(a)
                want = np.uint32(seq & 0xFFFFFFFF)
                if not ((first == want).all() and (second == want).all()):
                    bad.append(seq)
                frame.release()
                seqs.append(seq)
                got += 1
                if frames_wanted and got >= frames_wanted:
                    break
        q.put(("done", got, bad[:10], seqs))
    except BaseException:
        report_exception(q)


def _produce(pub, count, *, start=0, nbytes=1 << 16, timeout=30.0):
    """Publish frames ``start .. start + count - 1``, each filled with its sequence number."""
    import cupy as cp

    for seq in range(start, start + count):
        with pub.frame(timeout=timeout) as f:
            a = f.array((nbytes // 4,), cp.uint32)
            a.fill(seq & 0xFFFFFFFF)
            f.publish(a, metadata=SEQ.pack(seq))
        del a


@pytest.mark.parametrize("mode", ["block", "latest"])
def test_held_slots_are_never_overwritten_under_load(address, mode):
    n = 10_000
    with cip.IpcPool(4, 1 << 16) as pool, cip.Publisher(pool, address) as pub:
        proc, q = start_child(_checking_consumer, address, mode, 0, True)
        assert child_message(q)[0] == "ready"
        wait_subscribers(pub, 1)
        t0 = time.monotonic()
        _produce(pub, n, timeout=30.0 if mode == "block" else 0.5)
        producer_s = time.monotonic() - t0
        pub.close()
        _, got, bad, seqs = child_message(q)
        proc.join(30)
    assert bad == [], f"frames overwritten while held: {bad}"
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    if mode == "block":
        assert got == n and seqs == list(range(n))
    else:
        assert 0 < got < n  # a slow latest subscriber skips frames
        assert producer_s < 60


@pytest.mark.multigpu
def test_subscriber_on_a_second_gpu_reads_every_frame_intact(address):
    """Publisher on GPU 0, subscriber on GPU 1: the slots mapped for GPU 1, the sync page
    registered by each process for its own device (``PORTABLE``), both directions of
    ordering across the two devices (held frames never overwritten, every frame complete)."""
    from cupy_ipcpool import _driver

    if _driver.device_count() < 2:
        pytest.skip("needs two GPUs (run on the two-GPU machine)")
    if not _driver.can_access_peer(1, 0):
        pytest.skip("device 1 has no peer access to device 0")
    n = 2_000
    with cip.IpcPool(3, 1 << 20, device=0) as pool, cip.Publisher(pool, address) as pub:
        q = SPAWN.Queue()
        proc = SPAWN.Process(target=_checking_consumer, args=(address, "block", 0, True, q, 1))
        proc.start()
        assert child_message(q)[0] == "ready"
        wait_subscribers(pub, 1)
        _produce(pub, n, nbytes=1 << 20)
        pub.close()
        _, got, bad, seqs = child_message(q)
        proc.join(30)
    assert bad == [], f"frames overwritten or incomplete on GPU 1: {bad}"
    assert got == n and seqs == list(range(n))


def _holding_consumer(address, hold, q):
    try:
        with cip.subscribe(address) as sub:
            q.put(("ready",))
            frames = [sub.recv(timeout=60) for _ in range(hold)]
            q.put(("holding", [f.seq for f in frames]))
            time.sleep(3600)
    except BaseException:
        report_exception(q)


def _start_holding_both(pub, address):
    """Start a subscriber holding 2 frames, publish 2 to it; ``(process, queue)`` once it does."""
    proc, q = start_child(_holding_consumer, address, 2)
    assert child_message(q)[0] == "ready"
    wait_subscribers(pub, 1)
    _produce(pub, 2)
    assert child_message(q)[0] == "holding"
    return proc, q


def test_block_mode_backpressure_times_out_clearly(address):
    with cip.IpcPool(2, 1 << 16) as pool, cip.Publisher(pool, address) as pub:
        proc, _q = _start_holding_both(pub, address)
        with pytest.raises(cip.SlotBusyError, match=r"1 peer lease\(s\) \(subscriber \d+, pid"):
            pub.acquire(timeout=0.3)
        proc.kill()
        proc.join(30)


def test_subscriber_sigkill_returns_its_leases_within_a_second(address):
    with cip.IpcPool(2, 1 << 16) as pool, cip.Publisher(pool, address) as pub:
        proc, _q = _start_holding_both(pub, address)
        assert pub.leases(0) == pub.leases(1) == 1
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        slot = pub.acquire(timeout=1.0)  # the dead subscriber's leases come back
        assert time.monotonic() - t0 < 1.0
        assert pub.leases(slot) == 0 and not pub.subscribers
        proc.join(30)
        _produce(pub, 5)  # and the producer goes on


def test_fan_out_to_four_and_late_subscriber(address):
    n = 500
    with cip.IpcPool(4, 1 << 16) as pool, cip.Publisher(pool, address) as pub:
        children = [start_child(_checking_consumer, address, "block", 0, False) for _ in range(4)]
        for _, q in children:
            assert child_message(q)[0] == "ready"
        wait_subscribers(pub, 4)
        _produce(pub, n)
        late = start_child(_checking_consumer, address, "block", 0, False)
        assert child_message(late[1])[0] == "ready"
        wait_subscribers(pub, 5)
        _produce(pub, 10, start=n)
        pub.close()
        for proc, q in children:
            _, got, bad, seqs = child_message(q)
            proc.join(30)
            assert got == n + 10 and bad == [] and seqs == list(range(n + 10))
        _, got, bad, seqs = child_message(late[1])
        late[0].join(30)
        assert bad == [] and got == 10 and seqs == list(range(n, n + 10))


# ------------------------------------------------- one slot, several slow readers

CHECK_SRC = r"""
extern "C" __global__ void spin_then_check(const unsigned int* a, unsigned long long n,
                                           unsigned int value, long long cycles,
                                           unsigned long long* bad) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i < n; i += (unsigned long long)gridDim.x * blockDim.x)
        if (a[i] != value) atomicAdd(bad, 1ULL);
}
"""


def _slow_gpu_reader(address, frames, q):
    """Per frame: a kernel that spins ~2 ms, then compares the whole frame with its
    sequence number; the frame is released at once, before that kernel has run."""
    try:
        import cupy as cp

        check = cp.RawKernel(CHECK_SRC, "spin_then_check")
        stream = cp.cuda.Stream(non_blocking=True)
        bad = cp.zeros(1, dtype=cp.uint64)
        cycles = cp.int64(int(0.002 * cp.cuda.Device(0).attributes["ClockRate"] * 1000))
        dummy = cp.zeros(4, dtype=cp.uint32)
        check((1,), (32,), (dummy, cp.uint64(4), cp.uint32(0), cp.int64(0), bad))  # load it now
        cp.cuda.Device(0).synchronize()
        bad.fill(0)
        with cip.subscribe(address) as sub:
            q.put(("ready",))
            for _ in range(frames):
                frame = sub.recv(timeout=60, stream=stream)
                (seq,) = SEQ.unpack(frame.metadata)
                a = frame.array
                check(
                    (8,), (256,), (a, cp.uint64(a.size), cp.uint32(seq), cycles, bad), stream=stream
                )
                frame.release(stream=stream)
                del a, frame
            stream.synchronize()
        q.put(("done", int(bad.get()[0])))
    except BaseException:
        report_exception(q)


def test_slot_reuse_waits_for_every_subscribers_gpu_reads(address):
    """Three subscribers release each frame before their GPU reads of it have run; the
    producer rewrites the slot a frame later. Its stream must wait on all three read
    flags (one batched driver call when more than one is still unset), or a reader
    sees the next frame's values."""
    n = 40
    with cip.IpcPool(1, 1 << 16) as pool, cip.Publisher(pool, address) as pub:
        children = [start_child(_slow_gpu_reader, address, n) for _ in range(3)]
        for _, q in children:
            assert child_message(q)[0] == "ready"
        wait_subscribers(pub, 3)
        batched = []
        order_all = pub._leases._order_all

        def counting(stream, addrs, value):
            waited = order_all(stream, addrs, value)
            batched.append(waited)
            return waited

        pub._leases._order_all = counting
        _produce(pub, n)
        results = [child_message(q) for _, q in children]
        for proc, _ in children:
            proc.join(30)
    assert [r[1] for r in results] == [0, 0, 0], "a reader saw a slot rewritten under it"
    # the readers' kernels were still pending when the slot came round: the producer's
    # stream waited on several flags in one call (not on host-visible ones only)
    assert len(batched) == n - 1
    assert sum(w >= 2 for w in batched) >= (n - 1) // 2, batched


# --------------------------------------------------------------- producer death


def _dying_producer(address, q):
    try:
        import cupy as cp

        pool = cip.IpcPool(3, 1 << 20)
        pub = cip.Publisher(pool, address)
        q.put(("ready",))
        while not pub.subscribers:
            pub.poll(0.05)
        for seq in range(2):
            with pub.frame() as f:
                a = f.array((1 << 18,), cp.uint32)
                fill(a, seq + 1)
                f.publish(a, metadata=SEQ.pack(seq))
            del a
        cp.cuda.Device(0).synchronize()
        q.put(("published",))
        time.sleep(3600)
    except BaseException:
        report_exception(q)


def test_producer_sigkill_ends_the_stream_and_held_frames_stay_readable(address):
    import cupy as cp

    from tests.gpu_helpers import expected

    proc, q = start_child(_dying_producer, address)
    assert child_message(q)[0] == "ready"
    sub = cip.subscribe(address)
    frames = [sub.recv(timeout=60), sub.recv(timeout=60)]
    assert child_message(q)[0] == "published"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    with pytest.raises(cip.EndOfStream) as info:
        sub.recv(timeout=10)
    assert not info.value.clean
    for seq, frame in enumerate(frames):
        np.testing.assert_array_equal(cp.asnumpy(frame.array), expected(1 << 18, seq + 1))
        assert frame.complete  # its flag was the producer's own
        frame.release()  # no one to return it to: must not raise
    forced = sub.forced_flags
    sub.close()
    assert forced == 0 and all(f.complete for f in frames)


def test_clean_close_ends_iteration(address):
    with cip.IpcPool(2, 1 << 16) as pool:
        pub = cip.Publisher(pool, address)
        proc, q = start_child(_checking_consumer, address, "block", 0, False)
        assert child_message(q)[0] == "ready"
        wait_subscribers(pub, 1)
        _produce(pub, 20)
        pub.close()
        _, got, bad, _ = child_message(q)
        proc.join(30)
        assert got == 20 and bad == []


# --------------------------------------------------------- a cupy.cuda.Device as device


def _device_object_consumer(address, q):
    try:
        import cupy as cp

        with cip.subscribe(address, device=cp.cuda.Device(0)) as sub:
            assert sub.peer.device == 0
            q.put(("ready",))
            frame = sub.recv(timeout=60)
            value = int(cp.asnumpy(frame.array)[0])
            frame.release()
        q.put(("done", value))
    except BaseException:
        report_exception(q)


def test_a_subscriber_takes_a_cupy_device(address):
    """``subscribe(..., device=cupy.cuda.Device(0))`` as CuPy users write it (issue 45)."""
    import cupy as cp

    with cip.IpcPool(2, 1 << 16, device=cp.cuda.Device(0)) as pool:
        pub = cip.Publisher(pool, address)
        proc, q = start_child(_device_object_consumer, address)
        assert child_message(q)[0] == "ready"
        wait_subscribers(pub, 1)
        _produce(pub, 1, start=41)
        assert child_message(q) == ("done", 41)
        proc.join(30)
        pub.close()


# ------------------------------------------------------------------- no growth


def _counting_consumer(address, mode, q):
    try:
        with cip.subscribe(address, mode=mode) as sub:
            q.put(("ready",))
            n = 0
            for frame in sub:
                frame.release()
                n += 1
                if n == 1000:
                    gc.collect()
                    fds0 = fd_count()
                elif n == 99_999:
                    gc.collect()
                    fds1 = fd_count()
        q.put(("done", n, fds0, fds1))
    except BaseException:
        report_exception(q)


@pytest.mark.device_memory
@pytest.mark.parametrize("mode", ["block", "ahead"])
def test_100k_frames_without_growth(address, mode):
    """fds in both processes and device memory flat over 100,000 frames; in "ahead" mode
    (frames handed out ahead of their messages) too, every frame published handed out."""
    import cupy as cp

    n = 100_000
    with cip.IpcPool(8, 1 << 20) as pool:
        pub = cip.Publisher(pool, address, ahead=mode == "ahead")
        proc, q = start_child(_counting_consumer, address, mode)
        assert child_message(q)[0] == "ready"
        wait_subscribers(pub, 1)
        marker = cp.zeros(1, dtype=cp.uint32)
        for seq in range(n):
            if seq == 1000:
                cp.cuda.Device(0).synchronize()
                gc.collect()
                fds0, free0 = fd_count(), device_free()
            with pub.frame(timeout=30) as f:
                a = f.array((16,), cp.uint32)
                a[:1] = marker
                f.publish(a)
            del a
        cp.cuda.Device(0).synchronize()
        gc.collect()
        fds1, free1 = fd_count(), device_free()
        pub.close()
        _, got, c_fds0, c_fds1 = child_message(q)
        proc.join(30)
    # "ahead": also the frames handed out ahead past the last one published (one per slot
    # at most; tests/test_ahead_gpu.py checks what they say)
    assert got == n if mode == "block" else n <= got <= n + 8
    assert fds1 == fds0 and c_fds1 == c_fds0  # while streaming, in both processes
    assert free0 - free1 < (2 << 20)  # less than one granule over 99,000 frames


def test_publish_rejects_arrays_outside_the_slot(address):
    import cupy as cp

    with cip.IpcPool(2, 1 << 16) as pool, cip.Publisher(pool, address) as pub:
        with pytest.raises(cip.UsageError, match="acquire"):
            pub.publish(pool.array(slot=0))
        with pub.frame() as f:
            with pytest.raises(cip.NotShareableError):
                f.publish(cp.zeros(4))
            other = pool.array(slot=1 - f.slot)
            with pytest.raises(cip.NotShareableError, match="slot"):
                f.publish(other)
            del other
