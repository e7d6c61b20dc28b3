"""GPU tier: frames handed out ahead of their messages (``Publisher(ahead=True)``,
``subscribe(mode="ahead")``), between real processes.

Every frame's contents are checked on the consumer's GPU, on the stream that
``recv`` made wait, without a host synchronisation per frame: a check kernel
adds the frame's mismatching words into ``bad[seq]``.  So a frame read before
the producer wrote it, or after the producer reused its slot, shows as a
count, whichever of the two processes runs ahead.
"""

from __future__ import annotations

import os
import signal
import struct

import pytest

import cupy_ipcpool as cip
from cupy_ipcpool.channel._payload import FRAME_HEAD
from tests.gpu_helpers import (
    child_message,
    report_exception,
    spin_kernel,
    start_child,
    wait_subscribers,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(150)]

SEQ = struct.Struct("<Q")
WORDS = 1 << 16  # 256 KiB frames


def _check(frame, bad, cycles=0):
    """Queue the check of ``frame`` (its words all its seq) on the current stream: the
    mismatching words are added into ``bad[seq % bad.size]``."""
    import cupy as cp

    spin_kernel("spin_check")(
        (64,),
        (256,),
        (
            frame.array,
            cp.uint64(WORDS),
            cp.uint32(frame.seq),
            cp.int64(cycles),
            bad[frame.seq % bad.size :],
        ),
    )


def _produce(pub, start, count, cycles=0, abandon=(), paced=False):
    """Frames ``start .. start + count - 1``, frame ``seq`` filled with ``seq`` after
    ``cycles`` of spinning; the seqs in ``abandon`` are taken and not published.
    ``paced``: the host waits for each frame's fill before the next (a camera-like
    producer, whose messages come no faster than its GPU work)."""
    import cupy as cp

    fill = spin_kernel("spin_fill")
    stream = cp.cuda.get_current_stream()
    for seq in range(start, start + count):
        with pub.frame(timeout=60) as f:
            a = f.array((WORDS,), cp.uint32)
            if seq in abandon:
                continue  # leaving the block unpublished: a void frame
            fill((64,), (256,), (a, cp.uint64(WORDS), cp.uint32(seq), cp.int64(cycles)))
            f.publish(a, metadata=SEQ.pack(seq))
        del a
        if paced:
            stream.synchronize()


def _ahead_consumer(address, depth, cycles, q, progress_at=0, mode="ahead"):
    """Receive every frame until the end; check each on the GPU; report per frame (and
    say "progress" once ``progress_at`` frames were handed out).  ``mode="block"``
    (``depth`` None): the same as a block subscriber."""
    try:
        import cupy as cp

        spin_kernel("spin_check")
        bad = cp.zeros(1 << 16, dtype=cp.uint32)
        seen = []  # (seq, confirmed when handed out, frame)
        with cip.subscribe(address, mode=mode, depth=depth, timeout=30) as sub:
            q.put(("ready",))
            try:
                while True:
                    frame = sub.recv(timeout=60)
                    seen.append((frame.seq, frame.confirmed, frame))
                    if frame.arrays:
                        _check(frame, bad, cycles)
                    frame.release()
                    if len(seen) == progress_at:
                        q.put(("progress",))
            except cip.EndOfStream as end:
                clean, incomplete = end.clean, set(end.incomplete)
                if clean:  # protocol.md: the same frames, asked of the subscriber
                    assert set(sub.incomplete_frames) == incomplete, sub.incomplete_frames
            cp.cuda.get_current_stream().synchronize()
            counts = cp.asnumpy(bad)
            report = [
                (
                    seq,
                    ahead,
                    f.complete,
                    f.confirmed,
                    bytes(f.metadata),
                    int(counts[seq % counts.size]),
                )
                for seq, ahead, f in seen
            ]
        q.put(("done", clean, sorted(incomplete), report))
    except BaseException:
        report_exception(q)


@pytest.mark.parametrize(
    ("producer_cycles", "consumer_cycles"),
    [(200_000, 0), (0, 200_000)],
    ids=["slow-producer", "slow-consumer"],
)
def test_every_frame_handed_out_ahead_holds_its_own_data(
    tmp_path, producer_cycles, consumer_cycles
):
    """Whichever side is slower on the GPU, every frame reads exactly its own data: the
    consumer's wait ends at that frame's write (slow producer) and the producer never
    reuses a slot under the consumer's check (slow consumer); frames are handed out
    ahead of their messages, confirmed later with their metadata; the frames handed
    out past the last one published end with complete False, named by the EndOfStream."""
    address = str(tmp_path / "ahead.sock")
    n = 3000
    with cip.IpcPool(4, WORDS * 4) as pool, cip.Publisher(pool, address, ahead=True) as pub:
        spin_kernel("spin_fill")
        proc, q = start_child(_ahead_consumer, address, 4, consumer_cycles)
        assert child_message(q)[0] == "ready"
        wait_subscribers(pub, 1)
        _produce(pub, 0, n, producer_cycles, paced=producer_cycles > 0)
        pub.close()
        _, clean, incomplete, report = child_message(q)
        proc.join(30)
    assert clean
    published = [r for r in report if r[0] < n]
    beyond = [r for r in report if r[0] >= n]
    assert [r[0] for r in report] == list(range(len(report)))  # every frame, in order
    assert len(published) == n
    wrong = [(seq, count) for seq, _a, _c, _f, _m, count in published if count]
    assert wrong == [], f"frames read with other data: {wrong[:10]}"
    assert all(c is True and f for _s, _a, c, f, _m, _n in published)
    assert all(m == SEQ.pack(s) for s, _a, _c, _f, m, _n in published)
    # a frame comes by message when its message is already here; ahead when it is not yet
    handed_out_ahead = sum(1 for r in published if not r[1])
    print(f"{handed_out_ahead} of {n} frames handed out ahead of their messages")
    if producer_cycles:  # its messages come no faster than its GPU: the consumer is ahead
        assert handed_out_ahead > n // 2, f"only {handed_out_ahead} of {n} handed out ahead"
    # frames handed out past the end: never written, and said so
    assert all(c is False for _s, _a, c, _f, _m, _n in beyond)
    assert {r[0] for r in beyond} <= set(incomplete)
    assert not set(incomplete) & set(range(n))


def _lockstep_consumer(address, frames, q):
    """Take frames two at a time, ahead of their messages where it can, check and release
    both, then wait on the host for the stream (so for the producer's writes of both)."""
    try:
        import cupy as cp

        spin_kernel("spin_check")
        bad = cp.zeros(1 << 16, dtype=cp.uint32)
        stream = cp.cuda.get_current_stream()
        seen = []
        with cip.subscribe(address, mode="ahead", depth=4, timeout=30) as sub:
            q.put(("ready",))
            while len(seen) < frames:
                for _ in range(2):
                    frame = sub.recv(timeout=60)
                    seen.append((frame.seq, frame.confirmed))
                    _check(frame, bad)
                    frame.release()
                stream.synchronize()
            counts = cp.asnumpy(bad)
        q.put(("done", [(seq, ahead, int(counts[seq])) for seq, ahead in seen]))
    except BaseException:
        report_exception(q)


def test_a_producer_waiting_for_each_lease_sees_it_at_the_read_flag(tmp_path):
    """Lock step with frames handed out ahead: the consumer waits on its host for frame
    k + 1's write, after releasing frame k (its RELEASE goes at release(), often before
    frame k is published); the producer waits for frame k's lease before it writes frame
    k + 1.  The lease ends as frame k is published or at its read flag, which the
    consumer's stream wrote after its check, so neither waits for the other's host.
    The producer paces its frames (a camera's), so the consumer asks for each frame
    before it is published: ahead."""
    import time

    address = str(tmp_path / "lockstep.sock")
    n = 400
    with cip.IpcPool(4, WORDS * 4) as pool, cip.Publisher(pool, address, ahead=True) as pub:
        spin_kernel("spin_fill")
        proc, q = start_child(_lockstep_consumer, address, n)
        assert child_message(q)[0] == "ready"
        wait_subscribers(pub, 1)
        for seq in range(n):
            time.sleep(0.002)
            _produce(pub, seq, 1)
            deadline = time.monotonic() + 10
            while pub.leases(seq % 4):
                assert time.monotonic() < deadline, f"frame {seq}'s lease did not come back"
                pub.poll(timeout=1.0)
        _, report = child_message(q)
        proc.join(30)
    assert [r[0] for r in report] == list(range(n))
    assert [(s, c) for s, _a, c in report if c] == []
    ahead = sum(1 for r in report if not r[1])
    print(f"{ahead} of {n} frames handed out ahead of their messages")
    assert ahead >= n // 2, f"only {ahead} of {n} handed out ahead: the case is not tested"


def test_a_killed_subscriber_never_stalls_the_producer_nor_one_joining_mid_stream(tmp_path):
    """An "ahead" subscriber slow on the GPU is SIGKILLed with frames out ahead; another
    joins mid-stream.  The producer goes on (its stream does not wait for the dead one's
    read flags for good) and the one that joined reads every frame it is handed out with
    its own data, from its first frame on."""
    import cupy as cp

    address = str(tmp_path / "kill.sock")
    with cip.IpcPool(4, WORDS * 4) as pool, cip.Publisher(pool, address, ahead=True) as pub:
        spin_kernel("spin_fill")
        victim, vq = start_child(_ahead_consumer, address, 4, 400_000)
        assert child_message(vq)[0] == "ready"
        wait_subscribers(pub, 1)
        _produce(pub, 0, 200)
        os.kill(victim.pid, signal.SIGKILL)  # with frames out ahead, its checks queued
        victim.join(30)
        late, lq = start_child(_ahead_consumer, address, 2, 0)
        assert child_message(lq)[0] == "ready"
        wait_subscribers(pub, 1)
        _produce(pub, 200, 1000, 20_000, paced=True)
        pub.close()
        _, clean, incomplete, report = child_message(lq)
        late.join(30)
        done = cp.cuda.get_current_stream().done  # the producer's stream got through
    assert done
    assert clean
    first = report[0][0]
    published = [r for r in report if r[0] < 1200]
    assert [r[0] for r in report] == list(range(first, first + len(report)))
    assert first >= 200 and published[-1][0] == 1199
    assert [(s, n) for s, _a, _c, _f, _m, n in published if n] == []
    assert all(c is True and m == SEQ.pack(s) for s, _a, c, _f, m, _n in published)
    print(f"{sum(1 for r in published if not r[1])} of {len(published)} handed out ahead")
    assert not set(incomplete) & set(range(1200))


def _block_consumer(address, q):
    """:func:`_ahead_consumer` as a ``"block"`` subscriber."""
    _ahead_consumer(address, None, 0, q, mode="block")


@pytest.mark.parametrize("consumer", [_ahead_consumer, _block_consumer], ids=["ahead", "block"])
def test_a_frame_taken_and_not_published_is_void(tmp_path, consumer):
    """Under ahead=True a frame left unpublished is sent void (marked so in its FRAME
    payload): every kind of consumer knows (complete False, no arrays, no metadata)
    and the frames around it are intact.  A void frame is not in the EndOfStream's
    incomplete: the producer's stream set its flag."""
    address = str(tmp_path / "void.sock")
    n, void = 40, {9, 22}
    args = (4, 0) if consumer is _ahead_consumer else ()
    with cip.IpcPool(4, WORDS * 4) as pool, cip.Publisher(pool, address, ahead=True) as pub:
        spin_kernel("spin_fill")
        proc, q = start_child(consumer, address, *args)
        assert child_message(q)[0] == "ready"
        wait_subscribers(pub, 1)
        _produce(pub, 0, n, 20_000, abandon=void)
        pub.close()
        _, clean, incomplete, report = child_message(q)
        proc.join(30)
    assert clean
    by_seq = {r[0]: r for r in report if r[0] < n}
    assert sorted(by_seq) == list(range(n))
    assert {s for s, r in by_seq.items() if r[2] is False} == void
    assert all(by_seq[s][2] is True for s in by_seq if s not in void)
    assert all(by_seq[s][5] == 0 for s in by_seq if s not in void)
    assert all(by_seq[s][4] == b"" for s in void)
    assert not set(incomplete) & set(range(n))


def _malformed_consumer(address, before, q):
    """An "ahead" subscriber (depth 1): ``before`` frames by message, released; then
    (if ``before``) one frame handed out ahead; then two more ``recv``: the first takes
    the crafted message.  Reports the exception type of each of the two."""
    try:
        with cip.subscribe(address, mode="ahead", depth=1, timeout=30) as sub:
            q.put(("ready",))
            for _ in range(before):
                sub.recv(timeout=60).release()
            if before:
                ahead = sub.recv(timeout=60)
                q.put(("ahead", ahead.seq, ahead.confirmed))
            outcomes = []
            for _ in range(2):
                try:
                    sub.recv(timeout=60)
                    outcomes.append("a frame")
                except Exception as exc:
                    outcomes.append(type(exc).__name__)
            q.put(("done", outcomes))
    except BaseException:
        report_exception(q)


#: (frames by message before, the crafted FRAME payload of a slot): a head too short as
#: the first message; a confirmation with no arrays and 60,000 bytes of metadata.
MALFORMED = {
    "short first message": (0, lambda slot: b"\0" * 5),
    "confirmation over the metadata limit": (
        4,
        lambda slot: FRAME_HEAD.pack(slot, 0, 0, 60_000) + b"m" * 60_000,
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_frame_closes_an_ahead_subscriber(tmp_path, case):
    """A frame whose FRAME payload is malformed costs an "ahead" subscriber its
    subscription: recv raises ProtocolError, and the next recv finds it closed.  The
    publisher is real; only the one payload it sends is replaced (its stream still
    writes the frame flag, so no wait of the subscriber is left hanging)."""
    before, crafted = MALFORMED[case]
    address = str(tmp_path / "malformed.sock")
    with cip.IpcPool(4, WORDS * 4) as pool, cip.Publisher(pool, address, ahead=True) as pub:
        spin_kernel("spin_fill")
        proc, q = start_child(_malformed_consumer, address, before)
        assert child_message(q)[0] == "ready"
        wait_subscribers(pub, 1)
        _produce(pub, 0, before)
        if before:
            assert child_message(q) == ("ahead", before, False)
        send = pub._core.publish
        pub._core.publish = lambda slot, _payload, *_scheduled: send(slot, crafted(slot))
        try:
            _produce(pub, before, 1)
        finally:
            del pub._core.publish
        _, outcomes = child_message(q)
        proc.join(30)
    assert outcomes == ["ProtocolError", "PoolClosedError"]


def test_ahead_needs_a_publisher_that_keeps_the_schedule(tmp_path):
    """A publisher without ahead=True refuses an "ahead" subscriber, and one with it
    refuses a "latest" subscriber, each with a message that says what to do."""
    plain, ahead = str(tmp_path / "plain.sock"), str(tmp_path / "ahead.sock")
    with (
        cip.IpcPool(4, 1 << 16) as pool,
        cip.Publisher(pool, plain) as _pub,
        cip.IpcPool(4, 1 << 16) as pool2,
        cip.Publisher(pool2, ahead, ahead=True) as _pub2,
    ):
        with pytest.raises(cip.PeerRefusedError, match="ahead=True"):
            cip.subscribe(plain, mode="ahead", timeout=10)
        with pytest.raises(cip.PeerRefusedError, match="'latest'"):
            cip.subscribe(ahead, mode="latest", timeout=10)
    with pytest.raises(cip.UsageError, match="depth"):
        cip.subscribe(plain, mode="block", depth=2)


def test_ahead_publisher_keeps_one_layout(tmp_path):
    """A frame whose arrays differ from the first frame's is refused before anything is
    written or sent; the publisher goes on with the first layout."""
    import cupy as cp

    with (
        cip.IpcPool(4, 1 << 20) as pool,
        cip.Publisher(pool, str(tmp_path / "l.sock"), ahead=True) as pub,
    ):
        with pub.frame() as f:
            first = f.slot
            f.publish(f.array((1024,), cp.uint32))
        with pub.frame() as f:
            other = f.array((2048,), cp.uint32)
            with pytest.raises(cip.UsageError, match="layout of the first"):
                f.publish(other)
            with pytest.raises(cip.UsageError, match="arrays of the first"):
                f.publish(metadata=b"no arrays")
            del other
        slots = []
        for _ in range(4):
            with pub.frame() as f:
                slots.append(f.slot)
                f.publish(f.array((1024,), cp.uint32))
        # the refused frame went out void (the slot after the first); the schedule goes on
        assert slots == [(first + 2 + i) % 4 for i in range(4)]


def _ahead_producer(address, q):
    try:
        spin_kernel("spin_fill")
        with cip.IpcPool(8, WORDS * 4) as pool, cip.Publisher(pool, address, ahead=True) as pub:
            q.put(("ready",))
            wait_subscribers(pub, 1)
            _produce(pub, 0, 10**6, 50_000)
    except BaseException:
        report_exception(q)


def test_producer_sigkill_resolves_every_frame_handed_out_ahead(tmp_path):
    """The producer dies with frames handed out ahead: every wait ends (the stream
    synchronises), every frame says whether it was written, and those said complete
    hold their own data."""
    address = str(tmp_path / "die.sock")
    proc, q = start_child(_ahead_producer, address)
    assert child_message(q)[0] == "ready"
    import cupy as cp

    spin_kernel("spin_check")
    bad = cp.zeros(1 << 16, dtype=cp.uint32)
    frames = []
    with cip.subscribe(address, mode="ahead", timeout=30) as sub:
        with pytest.raises(cip.EndOfStream) as end:
            while True:
                frame = sub.recv(timeout=60)
                frames.append(frame)
                _check(frame, bad)
                frame.release()
                if len(frames) == 500:
                    os.kill(proc.pid, signal.SIGKILL)
        cp.cuda.get_current_stream().synchronize()  # no wait left hanging
        answers = [(f.seq, f.complete) for f in frames]
        counts = cp.asnumpy(bad)
    proc.join(30)
    assert not end.value.clean
    assert all(c is not None for _s, c in answers)
    wrong = [s for s, c in answers if c and counts[s % counts.size]]
    assert wrong == [], f"frames said complete with other data: {wrong[:10]}"
    assert {s for s, c in answers if c is False} <= set(end.value.incomplete)
    written = sum(1 for _s, c in answers if c)
    print(
        f"{len(answers)} frames handed out, {written} written before the death, "
        f"{len(answers) - written} not"
    )


def _dropping_consumer(address, frames, q):
    """An "ahead" subscriber that never calls release(): each frame is dropped (and
    collected) once the next is received."""
    try:
        seqs = []
        with cip.subscribe(address, mode="ahead", depth=2, timeout=30) as sub:
            q.put(("ready",))
            for _ in range(frames):
                frame = sub.recv(timeout=60)
                seqs.append(frame.seq)
                del frame
        q.put(("done", seqs))
    except BaseException:
        report_exception(q)


def test_frames_dropped_without_release_come_back_when_collected(tmp_path):
    """protocol.md: a frame dropped without release() is released once collected (its
    read flag, then its RELEASE), so a consumer that never releases does not stall the
    producer: three rounds of a 4-slot ring go through."""
    address = str(tmp_path / "drop.sock")
    n = 12
    with cip.IpcPool(4, WORDS * 4) as pool, cip.Publisher(pool, address, ahead=True) as pub:
        spin_kernel("spin_fill")
        proc, q = start_child(_dropping_consumer, address, n)
        assert child_message(q)[0] == "ready"
        wait_subscribers(pub, 1)
        _produce(pub, 0, n)
        _, seqs = child_message(q)
        proc.join(30)
    assert seqs == list(range(n))


def test_a_slot_taken_from_the_pool_beside_an_ahead_publisher(tmp_path):
    """protocol.md: pool.acquire() works beside an ahead publisher: the slot it takes
    gets a later generation, which the frame's message corrects; every frame handed out
    ahead still reads exactly its own data."""
    address = str(tmp_path / "beside.sock")
    n = 40
    with cip.IpcPool(4, WORDS * 4) as pool, cip.Publisher(pool, address, ahead=True) as pub:
        spin_kernel("spin_fill")
        proc, q = start_child(_ahead_consumer, address, 4, 0)
        assert child_message(q)[0] == "ready"
        wait_subscribers(pub, 1)
        _produce(pub, 0, 8, 20_000)
        token = pool.acquire(timeout=30)  # outside the publisher: its generation grows
        token.release()
        _produce(pub, 8, n - 8, 20_000)
        pub.close()
        _, clean, incomplete, report = child_message(q)
        proc.join(30)
    assert clean
    published = [r for r in report if r[0] < n]
    assert [r[0] for r in published] == list(range(n))
    wrong = [(r[0], r[5]) for r in published if r[5]]
    assert wrong == [], f"frames read with other data: {wrong[:10]}"
    assert all(r[2] is True and r[3] for r in published)
    assert not set(incomplete) & set(range(n))


def _holding_consumer(address, n, q):
    """An "ahead" consumer that holds frame 0 while asking for more: frame 4 (slot 0's
    next use) must not be handed out ahead then; after frame 0's release it comes."""
    try:
        import cupy as cp

        spin_kernel("spin_check")
        bad = cp.zeros(1 << 16, dtype=cp.uint32)
        refused = False
        seqs = []
        with cip.subscribe(address, mode="ahead", timeout=30) as sub:
            q.put(("ready",))
            frames = [sub.recv(timeout=60) for _ in range(4)]  # 0 .. 3, slots 0 .. 3
            for f in frames:
                _check(f, bad)
                seqs.append(f.seq)
            for f in frames[1:]:
                f.release()
            try:
                sub.recv(timeout=1.0)  # frame 4: slot 0, whose frame 0 is still held
            except cip.ChannelTimeoutError:
                refused = True
            frames[0].release()  # its read flag on the current stream
            for _ in range(n - 4):  # 4 .. n-1, on the same stream
                f = sub.recv(timeout=60)
                _check(f, bad)
                seqs.append(f.seq)
                f.release()
            cp.cuda.get_current_stream().synchronize()  # hangs if the streams deadlocked
            counts = cp.asnumpy(bad)
        q.put(("done", refused, seqs, int(counts[:n].sum())))
    except BaseException:
        report_exception(q)


def test_a_held_frame_keeps_its_slots_next_use_from_being_handed_out_ahead(tmp_path):
    """protocol.md: while the consumer holds frame k, recv() does not hand out frame
    k + n (the slot's next use) ahead; a stream that waited for k + n and then released k
    would queue k's read flag behind that wait, which the producer writes only after the
    flag.  Once k is released, k + n comes, with its own data, on the same stream."""
    address = str(tmp_path / "hold.sock")
    n = 12
    with cip.IpcPool(4, WORDS * 4) as pool, cip.Publisher(pool, address, ahead=True) as pub:
        spin_kernel("spin_fill")
        proc, q = start_child(_holding_consumer, address, n)
        assert child_message(q)[0] == "ready"
        wait_subscribers(pub, 1)
        _produce(pub, 0, n)
        _, refused, seqs, wrong = child_message(q)
        proc.join(30)
    assert refused, "frame 4 was handed out ahead while frame 0 was held"
    assert seqs == list(range(n))
    assert wrong == 0
