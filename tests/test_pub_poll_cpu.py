"""The publisher's wait for a lease to end (``PublisherSession.poll``, ``c/src/pub_poll.c``).

One engine call per wait: the sockets' messages, the read flags
(``Publisher(ahead=True)``), a spin before the sleep (``spin_us``), the
evictions past ``lease_timeout`` and the eviction notices that wait for room.
Real socket pairs stand for the subscribers (``test_pub_session_cpu.Subs``);
a read flag is written from another process into a shared page, as a GPU
would write it.  Through ``PublisherCore.poll`` the flag-lease, departure and
ahead-stream tests drive the same call with real subscriber processes; the
probe comparison is ``test_c_library.test_the_publishers_wait_answers_alike_both_ways_in``.
"""

from __future__ import annotations

import mmap
import os
import select
import signal
import struct
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from _gil import assert_gil_released
from test_pub_session_cpu import SLOTS, Subs

from cupy_ipcpool.channel import _protocol as proto


@pytest.fixture
def subs() -> Iterator[Subs]:
    made = Subs(["block", "block"])
    yield made
    made.close()


def test_a_wait_ends_at_a_release_and_lets_other_threads_run(subs: Subs) -> None:
    subs.session.publish(1, 5, True, b"", 0)

    def release() -> None:
        subs.theirs[1].send(proto.encode_release(5, 1))

    got = assert_gil_released(lambda: subs.session.poll(30_000_000, 0, False), ("ppoll",), release)
    assert got is None
    assert subs.book.leases(1) == [(2, 5)]  # subscriber 1's lease ended; 2 holds its own


def test_a_wait_that_nothing_ends_lasts_its_timeout(subs: Subs) -> None:
    subs.session.publish(0, 1, True, b"", 0)
    start = time.monotonic()
    assert subs.session.poll(50_000, 0, True) is None  # settling, without a page: no flag
    assert time.monotonic() - start >= 0.05
    assert subs.book.lease_count(0) == 2 and subs.session.flag_looks > 0


def test_a_departure_during_the_wait_is_answered_by_that_wait(subs: Subs) -> None:
    subs.session.publish(0, 1, True, b"", 0)

    def leave() -> None:
        subs.theirs[2].send(proto.encode_bye())

    got = assert_gil_released(lambda: subs.session.poll(-1, 0, False), ("ppoll",), leave)
    assert got == [(2, "said BYE")]
    assert subs.book.leases(0) == [(1, 1)] and subs.session.ids() == [1]


def test_a_spin_sees_a_flag_another_process_sets() -> None:
    """The spin holds the thread (and the GIL) and looks at the flags in every round: a
    flag set by another process -- a GPU writes it so -- ends it without a message."""
    subs = Subs(["ahead"])
    page = mmap.mmap(-1, SLOTS * 4)  # shared with the child: MAP_SHARED | MAP_ANONYMOUS
    try:
        subs.session.flags(page, 0, 1)
        subs.session.set_row(1, 0)
        subs.session.publish(2, 9, True, b"", 9)
        looks = subs.session.flag_looks
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            time.sleep(0.05)
            struct.pack_into("<I", page, 2 * 4, 9)  # subscriber 1 is done with slot 2
            os._exit(0)
        start = time.monotonic()
        got = subs.session.poll(10_000_000, 2_000_000_000, True)  # a spin of up to 2 s
        took = time.monotonic() - start
        os.waitpid(pid, 0)
        assert got is None and subs.book.lease_count(2) == 0
        assert took < 2.0, f"the spin did not see the flag: it ended after {took:.3f} s"
        assert subs.session.flag_looks - looks > 1  # looked again and again
    finally:
        subs.close()
        page.close()  # the session let go of it at close


def test_the_wait_refuses_bad_arguments_and_a_second_caller(subs: Subs) -> None:
    with pytest.raises(ValueError, match="timeout_us"):
        subs.session.poll(-2, 0, False)
    with pytest.raises(ValueError, match="spin_ns"):
        subs.session.poll(0, -1, False)
    with pytest.raises(TypeError, match="poll"):
        subs.session.poll(0, 0)  # type: ignore[call-arg]
    subs.session.publish(3, 4, True, b"", 0)
    refused: list[BaseException] = []

    def second() -> None:
        try:
            subs.session.poll(0, 0, False)
        except RuntimeError as exc:
            refused.append(exc)
        subs.theirs[1].send(proto.encode_release(4, 3))

    assert assert_gil_released(lambda: subs.session.poll(-1, 0, False), ("ppoll",), second) is None
    assert len(refused) == 1 and "waiting on another thread" in str(refused[0])


def test_an_expiry_ends_the_wait_and_evicts_the_holder() -> None:
    subs = Subs(["block", "block"], lease_timeout=0.05)
    try:
        subs.session.publish(0, 3, True, b"", 0)
        subs.theirs[1].send(proto.encode_release(3, 0))
        assert subs.session.poll(0, 0, False) is None  # the release: not the wait's end
        got = subs.session.poll(-1, 0, False)  # without limit: until the lease is overdue
        assert got == [(2, "evicted: held frame 3 for more than lease_timeout=0.05 s")]
        assert subs.session.evictions == 1 and not subs.book.any_leased()
    finally:
        subs.close()


def test_a_look_at_the_flags_from_another_thread_is_allowed_during_the_wait(subs: Subs) -> None:
    """``settle`` (a look at a slot's leases from the allocator's thread) runs while another
    thread waits in ``poll``: both change the lease book only under the GIL."""
    page = bytearray(SLOTS * 4 * 2)
    subs.session.flags(page, 0, 2)
    subs.session.set_row(1, 0)
    subs.session.set_row(2, 1)
    subs.session.publish(1, 6, True, b"", 6)
    struct.pack_into("<I", page, 1 * 4, 6)  # subscriber 1's flag of slot 1
    ended: list[int] = []

    def settle_then_release() -> None:
        ended.append(subs.session.settle(1))
        subs.theirs[2].send(proto.encode_release(6, 1))  # ends the wait

    got = assert_gil_released(
        lambda: subs.session.poll(5_000_000, 0, False), ("ppoll",), settle_then_release
    )
    assert got is None and ended == [1] and subs.book.lease_count(1) == 0
    subs.session.close(0.0)  # lets go of the page


def _overrun_run() -> None:
    """In a child: a settling wait of 20 ms whose first round ends ~50 ms later (the GIL,
    wanted back while another thread holds it for a whole switch interval)."""
    subs = Subs(["ahead"])
    page = bytearray(SLOTS * 4)
    subs.session.flags(page, 0, 1)
    subs.session.set_row(1, 0)
    subs.session.publish(0, 1, True, b"", 1)
    stop = threading.Event()

    def hog() -> None:
        while not stop.is_set():
            pass

    sys.setswitchinterval(0.05)
    hogger = threading.Thread(target=hog)
    hogger.start()
    try:
        assert subs.session.poll(20_000, 0, True) is None
    finally:
        stop.set()
        hogger.join()
    assert subs.book.lease_count(0) == 1


def test_a_wait_whose_round_ends_past_its_deadline_still_ends() -> None:
    """A round may end past the wait's deadline (here the GIL comes back late): the wait
    ends then.  Before, a deadline already passed read as "no limit", and the wait went on
    forever, in rounds of no wait that never let the GIL go."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            _overrun_run()
            code = 0
        finally:
            os._exit(code)
    pidfd = os.pidfd_open(pid)
    try:
        ended = select.select([pidfd], [], [], 20.0)[0]
        if not ended:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(pidfd)
    assert ended, "the wait never ended"
    assert os.waitstatus_to_exitcode(status) == 0
