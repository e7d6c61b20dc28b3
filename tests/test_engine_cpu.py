"""The channel engine under Python (``cupy_ipcpool._engine``, built from ``c/src``).

The FRAME payload check and the message decoder are the engine's only copies
of those rules: the Python channel calls them through ``_payload.check_frame``
and ``_protocol.decode``, the C library's subscriber through the same C
functions.  These tests feed it payloads
built independently of it (``FRAME_HEAD.pack``, ``ArrayHandle.pack``, raw
bytes) and check every refusal's kind and words, that the module's C
functions stay its own (the C library, loaded beside it by ctypes, has the
same names), and that a build for other layouts is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
import struct
import subprocess
import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupy_ipcpool import _compiled, _engine
from cupy_ipcpool._errors import CompiledPartError, ProtocolError, TransportError
from cupy_ipcpool._handles import ArrayHandle
from cupy_ipcpool.channel import _protocol as proto
from cupy_ipcpool.channel._payload import FRAME_HEAD, FRAME_VOID, check_frame

SLOT_NBYTES = 4096
M = 0xFFFFFFFF


def _payload(slot: int, generation: int, handles: list[ArrayHandle], meta: bytes = b"") -> bytes:
    head = FRAME_HEAD.pack(slot, generation & M, len(handles), len(meta))
    return head + b"".join(h.pack() for h in handles) + meta


def _f32(slot: int, generation: int, offset: int, shape: tuple[int, ...], strides=None):
    strides = strides if strides is not None else tuple(4 for _ in shape)
    return ArrayHandle(slot, generation, offset, shape, strides, np.dtype("float32"))


def test_a_well_formed_frame_is_read_as_written() -> None:
    handles = [_f32(3, 7, 0, (16,)), _f32(3, 7, 64, (4, 4), (16, 4))]
    payload = _payload(3, 7, handles, b"meta")
    assert check_frame(11, 3, payload, SLOT_NBYTES) == (7, 2, 4, False)
    assert check_frame(11, 3, memoryview(payload), SLOT_NBYTES) == (7, 2, 4, False)
    # an array ending on the slot's last byte fits; the generation's high bits are the handle's
    assert check_frame(11, 3, _payload(3, 7, [_f32(3, 7 + (1 << 32), 4092, (1,))]), 4096) == (
        7,
        1,
        0,
        False,
    )
    assert check_frame(11, 3, FRAME_HEAD.pack(3 | FRAME_VOID, 9, 0, 2) + b"xy", 16) == (
        9,
        0,
        2,
        True,
    )


def _refusals() -> dict[str, tuple[bytes, str]]:
    good = _f32(3, 7, 0, (16,))
    packed = good.pack()
    return {
        "another slot's array": (_payload(3, 7, [_f32(2, 7, 0, (4,))]), "lies in slot 2"),
        "another generation": (_payload(3, 7, [_f32(3, 6, 0, (4,))]), "of generation 6"),
        "past the slot's end": (
            _payload(3, 7, [_f32(3, 7, 4064, (16,))]),
            "do not fit in a slot of 4096 bytes",
        ),
        "a negative stride before the slot": (
            _payload(3, 7, [_f32(3, 7, 0, (4,), (-4,))]),
            "do not fit",
        ),
        "an offset off the item size": (
            _payload(3, 7, [_f32(3, 7, 2, (4,))]),
            "multiple of the item size",
        ),
        "a truncated handle": (
            FRAME_HEAD.pack(3, 7, 1, 0) + packed[:-1],
            "truncated",
        ),
        "a handle missing": (FRAME_HEAD.pack(3, 7, 2, 0) + packed, "truncated"),
        "metadata shorter than said": (
            FRAME_HEAD.pack(3, 7, 1, 5) + packed + b"abc",
            "metadata length does not match",
        ),
        "bytes after the metadata": (
            FRAME_HEAD.pack(3, 7, 1, 0) + packed + b"x",
            "metadata length does not match",
        ),
        "an unknown dtype code": (
            FRAME_HEAD.pack(3, 7, 1, 0) + packed[:21] + bytes([200]) + packed[22:],
            "dtype code 200",
        ),
        "a head naming another flag": (_payload(2, 7, [good]), "in slot 3 names flag 2"),
        "a void frame with arrays": (
            FRAME_HEAD.pack(3 | FRAME_VOID, 7, 1, 0) + packed,
            "void frame with 1 arrays",
        ),
    }


@pytest.mark.parametrize("case", sorted(_refusals()))
def test_each_refusal_is_a_protocol_error_in_the_engine_s_words(case: str) -> None:
    payload, words = _refusals()[case]
    with pytest.raises(ProtocolError, match=r"^frame 11") as caught:
        check_frame(11, 3, payload, SLOT_NBYTES)
    assert words in str(caught.value)


def test_arguments_of_the_wrong_kind_are_refused_before_the_bytes_are_read() -> None:
    payload = _payload(3, 7, [_f32(3, 7, 0, (4,))])
    with pytest.raises(OverflowError):
        _engine.check_frame(payload, 1, 1 << 32, SLOT_NBYTES)
    with pytest.raises(OverflowError):
        _engine.check_frame(payload, -1, 3, SLOT_NBYTES)
    with pytest.raises(TypeError):
        _engine.check_frame("not bytes", 1, 3, SLOT_NBYTES)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="4 arguments"):
        _engine.check_frame(payload, 1, 3)  # type: ignore[call-arg]


def test_the_engine_exports_nothing_but_its_module_init() -> None:
    """Its cip_* functions are hidden: a process that also loads libcupy_ipcpool.so (by
    ctypes, as the C library's tests and users' tools do) gets two copies that do not mix."""
    nm = subprocess.run(
        ["nm", "-D", "--defined-only", _engine.__file__],
        capture_output=True,
        text=True,
        check=True,
    )
    exported = [line.split()[-1] for line in nm.stdout.splitlines() if " T " in line]
    assert exported == ["PyInit__engine"]


def test_a_build_for_other_limits_is_refused() -> None:
    with pytest.raises(CompiledPartError, match="MAX_ARRAYS: the build has 64, this code 65"):
        _compiled.load("cupy_ipcpool._engine", MAX_ARRAYS=65)
    assert _engine.FRAME_HEAD_SIZE == FRAME_HEAD.size == struct.calcsize("<IIHH")


# ------------------------------------------------------------------ channel messages
# The engine's decoder (c/src/message.c) is _protocol.decode and the C library's
# judge of every message: its refusals are checked here against references it does not
# share (Python's own UTF-8 codec, hand-packed structs).


def _refuse(raw: bytes) -> bytes:
    return struct.pack("<HBBI", proto.MAGIC, proto.VERSION, proto.REFUSE, len(raw)) + raw


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40))
def test_a_refuse_reason_is_taken_exactly_when_it_is_utf8(raw: bytes) -> None:
    try:
        expected: str | None = raw.decode("utf-8")
    except UnicodeDecodeError:
        expected = None
    try:
        got: str | None = proto.decode(_refuse(raw)).reason  # type: ignore[union-attr]
    except ProtocolError as exc:
        assert "REFUSE reason is not valid UTF-8" in str(exc)
        got = None
    assert got == expected


@pytest.mark.parametrize(
    ("raw", "valid"),
    [
        (b"lease_timeout", True),
        (b"nul\x00inside", True),  # a reason may hold any character, NUL too
        ("caf\u00e9 \u2603 \U0001f600".encode(), True),
        (b"\xc0\xaf", False),  # an overlong '/'
        (b"\xed\xa0\x80", False),  # a surrogate
        (b"\xf4\x90\x80\x80", False),  # past U+10FFFF
        (b"ok\xe2\x82", False),  # cut inside a character
    ],
)
def test_refuse_reasons_at_the_edges_of_utf8(raw: bytes, valid: bool) -> None:
    if valid:
        assert proto.decode(_refuse(raw)) == proto.Refuse(raw.decode())
    else:
        with pytest.raises(ProtocolError, match="REFUSE reason is not valid UTF-8"):
            proto.decode(_refuse(raw))


def test_a_hello_of_each_mode_is_taken_and_an_unknown_mode_refused() -> None:
    for mode in proto.MODE_NAMES:
        hello = struct.pack("<HBBBHII", proto.MAGIC, proto.VERSION, proto.HELLO, mode, 4, 99, 2)
        assert proto.decode(hello + b"hi") == proto.Hello(mode, 4, 99, b"hi")
    bad = struct.pack("<HBBBHII", proto.MAGIC, proto.VERSION, proto.HELLO, 3, 4, 99, 0)
    with pytest.raises(ProtocolError, match="HELLO has unknown mode 3"):
        proto.decode(bad)


def test_a_message_of_every_kind_comes_back_as_encoded() -> None:
    welcome = struct.pack(
        "<HBBIIQHII", proto.MAGIC, proto.VERSION, proto.WELCOME, 5, 8, 1 << 40, 3, 250, 2
    )
    assert proto.decode(welcome + b"wp") == proto.Welcome(5, 8, 1 << 40, b"wp", 3, 250)
    assert proto.decode(proto.encode_frame((1 << 64) - 1, 7, b"x" * 9)) == proto.Frame(
        (1 << 64) - 1, 7, b"x" * 9
    )
    assert proto.decode(bytearray(proto.encode_release(12, 3))) == proto.Release(12, 3)
    assert proto.decode(memoryview(proto.encode_bye())) == proto.Bye()
    with pytest.raises(ProtocolError, match="unknown message type 9"):
        proto.decode(struct.pack("<HBB", proto.MAGIC, proto.VERSION, 9))
    with pytest.raises(TypeError):
        proto.decode("not bytes")  # type: ignore[arg-type]


# ------------------------------------------------------------------ the sync page
# The flag rules (c/src/syncpage.c) against the table of docs/wire.md ("Forced flags"),
# written out here as numbers, not as the engine's arithmetic.

FORCED = 3 << 29


@pytest.mark.parametrize(
    ("word", "generation", "state"),
    [
        (5, 5, 1),  # set for this frame
        (9, 5, 1),  # set for a later one
        (4, 5, -1),  # not yet
        (5 + (1 << 31), 5, -1),  # half the ring ahead: behind, not ahead
        (4 + FORCED, 5, 0),  # forced after the death from 4: frame 5 never written
        (5 + FORCED, 5, 1),  # forced from 5: written before the death
        (5 + (1 << 29), 5, 0),  # the start of the forced-before window
        ((0xFFFFFFFF + FORCED) & 0xFFFFFFFF, 0, 0),  # across the wrap: forced from -1
        (2, (1 << 32) + 2, 1),  # generations are taken mod 2**32
    ],
)
def test_a_flag_word_says_what_the_table_says(word: int, generation: int, state: int) -> None:
    assert _engine.flag_state(word, generation) == state


def test_forcing_a_frame_flag_moves_it_past_every_wait_once() -> None:
    page = bytearray(64)
    struct.pack_into("<I", page, 8, 4)  # generation 4 written; 6 awaited
    assert _engine.flag_force(page, 8, 6) is True
    assert struct.unpack_from("<I", page, 8)[0] == 4 + FORCED
    assert _engine.flag_force(page, 8, 6) is False  # reached: another survivor forced it
    struct.pack_into("<I", page, 12, 7)
    assert _engine.flag_force(page, 12, 6) is False  # the producer got there first
    assert struct.unpack_from("<I", page, 12)[0] == 7
    assert bytes(page[:8]) == bytes(8) and bytes(page[16:]) == bytes(48)


@pytest.mark.parametrize("offset", [-4, 2, 61, 64])
def test_forcing_outside_the_page_or_off_a_word_is_refused(offset: int) -> None:
    from cupy_ipcpool._errors import UsageError

    with pytest.raises(UsageError, match=f"offset {offset} is not a flag of a page of 64 bytes"):
        _engine.flag_force(bytearray(64), offset, 1)
    with pytest.raises(BufferError):
        _engine.flag_force(bytes(64), 0, 1)  # read-only


# ------------------------------------------------------------------ the frame book
# Its rules are tested through FrameWaits (tests/test_death_answers_cpu.py) and against a
# table of scenarios (tests/test_c_library.py); here, what the binding refuses.


def test_a_frame_book_refuses_what_it_cannot_hold() -> None:
    from cupy_ipcpool._errors import UsageError

    with pytest.raises(UsageError, match=r"1\.\.65536 slots, not 0"):
        _engine.FrameBook(0)
    with pytest.raises(UsageError, match=r"record_cap must be at least 1 \(got 0\)"):
        _engine.FrameBook(2, record_cap=0)
    book = _engine.FrameBook(2, record_cap=4)
    with pytest.raises(UsageError, match="slot 2 of a book of 2 slots"):
        book.note(2, 1)
    with pytest.raises(UsageError, match="a sync page of 4 bytes has no 2 frame flags"):
        book.received(bytearray(4), 0, 0, 1)
    with pytest.raises(BufferError):
        book.prune(bytes(64))  # read-only
    assert book.record == () and book.generations == [-1, -1] and len(book) == 0


def test_a_frame_book_records_what_the_page_does_not_show_written() -> None:
    page = bytearray(64)
    book = _engine.FrameBook(2, record_cap=4)
    assert book.received(page, 7, 1, 3) is True  # flag 0, generation 3 awaited: recorded
    struct.pack_into("<I", page, 0, 5)
    assert book.received(page, 8, 0, 5) is False  # set already: complete, not recorded
    assert book.record == ((7, 1, 3),) and book.generations == [-1, 3]
    assert book.pending(page) == [1] and book.answers(page) == ((), (7,))
    assert book.resolve(page) == [1] and book.forced == 1
    assert book.answers(page) == ((7,), ()) and book.state(page, 1, 3) == 0
    book.freeze(page)
    page[:] = bytes(64)  # the page gone: the frozen words answer
    assert book.final == [5, FORCED] and book.answers(None) == ((7,), ())


# ------------------------------------------------------------------ the frame ledger
# Rule 1 (docs/protocol.md, "Failures") and the frames held: the C subscriber's judge and
# releases and the Python SubscriberCore both call c/src/ledger.c.  Both run against one
# hand-built publisher in tests/test_subscriber_rules_cpu.py; here, the ledger alone.


def test_a_ledger_takes_frames_in_order_one_per_slot() -> None:
    ledger = _engine.FrameLedger(2, 5)
    assert ledger.held == {} and ledger.last_seq == -1
    assert ledger.take(5, 0) is True and ledger.take(7, 1) is True  # gaps are allowed
    assert ledger.held == {5: 0, 7: 1} and ledger.last_seq == 7
    ledger.release(5, 0)
    assert ledger.take(8, 0) is True and ledger.held == {7: 1, 8: 0}


@pytest.mark.parametrize(
    ("seq", "slot", "words"),
    [
        (9, 2, "frame 9 names slot 2 of 2"),
        (4, 1, "frame 4 arrived before the first, 5"),
        (6, 1, "frame 6 arrived after frame 6"),
        (7, 0, "frame 7 is in slot 0, where this subscriber still holds frame 6"),
    ],
)
def test_a_frame_that_breaks_rule_1_is_refused_and_changes_nothing(
    seq: int, slot: int, words: str
) -> None:
    ledger = _engine.FrameLedger(2, 5)
    ledger.take(6, 0)
    with pytest.raises(ProtocolError, match=f"^{words}$"):
        ledger.take(seq, slot)
    assert ledger.held == {6: 0} and ledger.last_seq == 6
    assert ledger.take(7, 1) is True  # the stream goes on as before


@pytest.mark.parametrize(("seq", "slot"), [(3, 0), (3, 1), (4, 0), (-1, 0), (3, 2**64), (3, -1)])
def test_only_a_frame_held_is_released(seq: int, slot: int) -> None:
    ledger = _engine.FrameLedger(2, 0)
    ledger.take(3, 0)
    ledger.release(3, 0)
    ledger.take(4, 1)
    with pytest.raises(
        ProtocolError, match=f"^release of frame {seq} in slot {slot}, which is not held$"
    ):
        ledger.release(seq, slot)
    assert ledger.held == {4: 1}


def test_a_frame_released_ahead_is_not_held_when_its_message_comes() -> None:
    ledger = _engine.FrameLedger(2, 0)
    ledger.release_ahead(1, 1)
    ledger.release_ahead(0, 0)
    assert ledger.ahead == {0, 1}
    assert ledger.take(0, 0) is False and ledger.take(1, 1) is False
    assert ledger.held == {} and ledger.ahead == frozenset()
    assert ledger.take(2, 0) is True  # the slot is free: nothing of ours is held there


@pytest.mark.parametrize(
    ("seq", "slot"),
    [
        (0, 0),  # received by message and released already: a second release
        (1, 1),  # received by message and held
        (3, 0),  # released ahead already
        (5, 2),  # not a slot of the ring
        (2**64, 0),
    ],
)
def test_a_release_ahead_no_schedule_explains_is_refused(seq: int, slot: int) -> None:
    ledger = _engine.FrameLedger(2, 0)
    ledger.take(0, 0)
    ledger.release(0, 0)
    ledger.take(1, 1)
    ledger.release_ahead(3, 0)
    with pytest.raises(ProtocolError, match="cannot be released ahead"):
        ledger.release_ahead(seq, slot)
    assert ledger.ahead == {3} and ledger.held == {1: 1}


def test_no_more_frames_are_released_ahead_than_the_ring_has_slots() -> None:
    ledger = _engine.FrameLedger(2, 0)
    ledger.release_ahead(0, 0)
    ledger.release_ahead(1, 1)
    with pytest.raises(ProtocolError, match="frame 2 in slot 0 cannot be released ahead"):
        ledger.release_ahead(2, 0)
    assert ledger.take(0, 0) is False
    ledger.release_ahead(2, 0)  # one came: room for one more
    assert ledger.ahead == {1, 2}


def test_a_frame_whose_flag_write_failed_is_held_again() -> None:
    ledger = _engine.FrameLedger(2, 0)
    ledger.take(0, 1)
    ledger.release(0, 1)  # forgotten before the write, which the driver refused
    ledger.hold_again(0, 1)
    assert ledger.held == {0: 1}
    with pytest.raises(ProtocolError, match="frame 0 cannot be held again in slot 1"):
        ledger.hold_again(0, 1)  # the slot holds it already
    with pytest.raises(ProtocolError, match="frame 1 cannot be held again"):
        ledger.hold_again(1, 0)  # never received


@pytest.mark.parametrize(
    ("message", "answer"),
    [
        (proto.encode_frame(5, 1, b"pp"), ("frame", 5, 1, True, b"pp")),
        (proto.encode_bye(), ("bye",)),
        (proto.encode_refuse("lease_timeout"), ("evicted", "lease_timeout")),
        (proto.encode_welcome(1, 2, 0), "unexpected WELCOME from the publisher"),
        (proto.encode_release(5, 1), "unexpected RELEASE from the publisher"),
        (proto.encode_frame(3, 0, b""), "frame 3 arrived before the first, 5"),
        (proto.encode_frame(6, 2, b""), "frame 6 names slot 2 of 2"),
        (proto.encode_refuse("x")[:-1], "REFUSE"),
    ],
)
def test_a_live_stream_s_message_means_a_frame_a_bye_an_eviction_or_an_error(
    message: bytes, answer: Any
) -> None:
    ledger = _engine.FrameLedger(2, 5)
    if isinstance(answer, str):
        with pytest.raises(ProtocolError, match=re.escape(answer)):
            ledger.judge(message)
        assert ledger.held == {} and ledger.last_seq == -1
    else:
        assert ledger.judge(memoryview(message)) == answer


def test_a_ledger_refuses_what_it_cannot_hold() -> None:
    from cupy_ipcpool._errors import UsageError

    with pytest.raises(UsageError, match=r"1\.\.65536 slots, not 0"):
        _engine.FrameLedger(0, 0)
    with pytest.raises(TypeError, match="seq and slot must be ints"):
        _engine.FrameLedger(1, 0).take(0.0, 0)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        _engine.FrameLedger(1, 0).release(0)


# ------------------------------------------------------------------ the lease book
# Its rules are tested through LeaseBook (tests/test_protocol.py, test_early_release_cpu.py,
# test_flag_leases_cpu.py, ...) and both ways in under the sanitizers (test_c_library.py);
# here, what only the binding can meet: a flag look that calls back into the book.


def test_a_flag_look_that_removes_a_holder_meanwhile_skips_it() -> None:
    book = _engine.LeaseCore(2)
    book.add_subscriber(0, "block", 2)
    book.add_subscriber(1, "block", 2)
    assert book.publishing(0, 0, 0.0, True) == [0, 1]

    def reached(sub_id: int, slot: int) -> bool:
        if sub_id == 0:
            book.remove_subscriber(1)  # its lease goes back with it
        return True

    assert book.settle_flagged(reached, None) == 1
    assert book.subscribers() == [0] and book.is_free(0) and book.releases_due == 1


# ------------------------------------------------------------------ RELEASEs owed
# The queue both subscribers keep while the publisher's socket is full (c/src/owed.c):
# here over a real SOCK_SEQPACKET pair whose reader does not read.


def _full_pair() -> tuple[socket.socket, socket.socket]:
    """A socket pair whose first end takes no more datagrams now."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            a.send(b"x" * 64)
    return a, b


def _drain(b: socket.socket) -> list[bytes]:
    got = []
    with contextlib.suppress(BlockingIOError):
        while True:
            got.append(b.recv(4096, socket.MSG_DONTWAIT))
    return got


def test_releases_a_full_socket_did_not_take_go_later_in_order() -> None:
    a, b = _full_pair()
    with a, b:
        owed = _engine.OwedReleases(4)
        assert owed.limit == proto.MAX_CREDIT + 4
        assert owed.send(a.fileno(), 7, 1) is False and owed.send(a.fileno(), 8, 2) is False
        owed.owe(9, 3)
        assert owed.pending == [(7, 1), (8, 2), (9, 3)] and len(owed) == 3
        assert owed.flush(a.fileno()) is False and len(owed) == 3  # still full
        _drain(b)
        assert owed.send(a.fileno(), 10, 0) is True and len(owed) == 0  # behind the others
        sent = [proto.decode(m) for m in _drain(b)]
        assert [(m.seq, m.slot) for m in sent] == [(7, 1), (8, 2), (9, 3), (10, 0)]


def test_no_more_releases_are_owed_than_any_credit_explains() -> None:
    a, b = _full_pair()
    with a, b:
        owed = _engine.OwedReleases(2)
        for seq in range(owed.limit):
            owed.owe(seq, 0)
        words = f"for {owed.limit} RELEASEs, more than any credit allows"
        with pytest.raises(TransportError, match=words) as e:
            owed.send(a.fileno(), 99, 0)
        assert e.value.errno == errno.ENOBUFS
        with pytest.raises(TransportError, match="ENOBUFS"):
            owed.owe(99, 0)
        assert len(owed) == owed.limit and owed.pending[-1] == (owed.limit - 1, 0)


def test_a_release_to_a_closed_peer_fails_and_what_is_owed_stays() -> None:
    a, b = _full_pair()
    owed = _engine.OwedReleases(2)
    owed.owe(1, 1)
    b.close()
    with a, pytest.raises(OSError) as e:
        owed.flush(a.fileno())
    assert not isinstance(e.value, BlockingIOError) and owed.pending == [(1, 1)]
    owed.clear()
    assert len(owed) == 0 and owed.pending == []


# ------------------------------------------------------------------ a hang-up
# What is still queued when the publisher hangs up (c/src/hangup.c): the verdict of both
# subscribers; tests/test_subscriber_rules_cpu.py runs them against one publisher.

_F = proto.encode_frame(0, 0, b"")
_BYE = proto.encode_bye()
_NOTICE = proto.encode_refuse("lease_timeout")
_BAD_NOTICE = _NOTICE[:-1]


@pytest.mark.parametrize(
    ("queued", "verdict"),
    [
        ([], ("drop", 0)),
        ([_F, _F], ("drop", 2)),
        ([b"junk", _F[:4], _F], ("drop", 3)),  # no header, or a foreign one: skipped
        ([_F, _BYE, _F], ("bye", 1)),
        ([_F, _BYE, _NOTICE], ("bye", 1)),  # nothing after a BYE counts
        ([_F, _NOTICE, _BYE], ("evicted", 1)),
        ([_F, _BAD_NOTICE, _BYE], ("bad", 1)),
        ([_F, _BYE, _BAD_NOTICE], ("bye", 1)),
        ([memoryview(_F), bytearray(_NOTICE)], ("evicted", 1)),
    ],
)
def test_the_first_bye_or_refuse_queued_at_a_hang_up_decides(
    queued: list[bytes], verdict: tuple[str, int]
) -> None:
    assert _engine.hangup_verdict(queued) == verdict


def test_what_is_queued_at_a_hang_up_is_read_in_order_and_judged() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a:
        for message in (_F, proto.encode_frame(1, 1, b"x"), _BYE, _NOTICE):
            b.send(message)
        b.close()  # the publisher hangs up
        queued = [b"kept from before"]
        _engine.hangup_drain(a.fileno(), queued)
        assert queued == [b"kept from before", _F, proto.encode_frame(1, 1, b"x"), _BYE, _NOTICE]
        assert _engine.hangup_verdict(queued) == ("bye", 3)
        _engine.hangup_drain(a.fileno(), queued)  # nothing more: the end, at once
        assert len(queued) == 5


def test_a_hang_up_verdict_takes_a_list_of_buffers() -> None:
    with pytest.raises(TypeError, match="must be a list"):
        _engine.hangup_verdict((_BYE,))
    with pytest.raises(TypeError):
        _engine.hangup_verdict([_BYE, "text"])


# ------------------------------------------------------------------ the handshake
# The subscriber's half (c/src/handshake.c): SubscriberCore's and the C subscriber's.  Its
# failures are tested through both consumers (tests/test_scenarios_cpu.py,
# tests/test_foreign_peer_cpu.py); here, what the binding hands over, and that it waits
# without the GIL (the publisher below is a thread of this process).


def _answer_once(
    listener: socket.socket, reply: bytes, fds: list[int], delay: float, hellos: list[bytes]
) -> None:
    conn, _ = listener.accept()
    with conn:
        hellos.append(conn.recv(1 << 17))
        time.sleep(delay)
        socket.send_fds(conn, [reply], fds)
        conn.recv(64)  # until the subscriber hangs up


def _listener(tmp_path: Any) -> tuple[socket.socket, str]:
    path = str(tmp_path / "pub.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    return listener, path


def test_the_handshake_hands_over_the_socket_the_welcome_and_its_fds(tmp_path: Any) -> None:
    listener, path = _listener(tmp_path)
    memfd = os.memfd_create("slot")
    welcome = proto.encode_welcome(sub_id=3, num_slots=2, next_seq=9, credit=4, payload=b"pp")
    hellos: list[bytes] = []
    publisher = threading.Thread(
        target=_answer_once, args=(listener, welcome, [memfd], 0.3, hellos)
    )
    with listener:
        publisher.start()
        got = _engine.handshake(path, proto.MODE_AHEAD, 4, b"hi", [os.geteuid()], 10_000)
        sock_fd, pid, uid, sub_id, num_slots, next_seq, credit, lease_ms, payload, fds = got
        try:
            assert (pid, uid) == (os.getpid(), os.geteuid())
            assert (sub_id, num_slots, next_seq, credit, lease_ms, payload) == (
                3,
                2,
                9,
                4,
                0,
                b"pp",
            )
            assert len(fds) == 1 and os.fstat(fds[0]).st_ino == os.fstat(memfd).st_ino
            # the engine's HELLO, byte for byte the reference writer's
            assert hellos == [proto.encode_hello(proto.MODE_AHEAD, 4, os.getpid(), b"hi")]
        finally:
            os.close(sock_fd)
            for fd in fds:
                os.close(fd)
            os.close(memfd)
            publisher.join(5)


def test_a_failed_handshake_leaves_nothing_open(tmp_path: Any) -> None:
    from _fds import fds_opened_since, open_fds

    from cupy_ipcpool._errors import ForeignPeerError

    listener, path = _listener(tmp_path)
    memfd = os.memfd_create("slot")
    publisher = threading.Thread(
        target=_answer_once, args=(listener, b"HTTP/1.1 200", [memfd], 0, [])
    )
    before = open_fds()
    with listener:
        publisher.start()
        with pytest.raises(
            ForeignPeerError, match=re.escape("it answered b'HTTP/1.1 200', not the")
        ):
            _engine.handshake(path, proto.MODE_BLOCK, 4, b"", [os.geteuid()], 10_000)
        publisher.join(5)
    os.close(memfd)
    assert fds_opened_since(before) == {}


@pytest.mark.parametrize(
    ("mode", "credit", "payload", "words"),
    [
        (3, 1, b"", "mode must be 0 (block), 1 (latest) or 2 (ahead), not 3"),
        (0, 0, b"", "credit must be in 1..65535, not 0"),
        (0, 65536, b"", "credit must be in 1..65535, not 65536"),
        (1, 1, bytes(65537), "hello payload is 65537 bytes, more than the limit of 65536"),
    ],
)
def test_a_hello_out_of_range_is_refused_before_connecting(
    tmp_path: Any, mode: int, credit: int, payload: bytes, words: str
) -> None:
    """Nothing listens at the path: a refusal about the HELLO shows nothing was tried."""
    from cupy_ipcpool._errors import UsageError

    with pytest.raises(UsageError, match=re.escape(words)):
        _engine.handshake(str(tmp_path / "none"), mode, credit, payload, [os.geteuid()], 1000)


# ------------------------------------------------------------------ the WELCOME
# What the subscriber checks before it maps anything (c/src/welcome.c): the C subscriber's
# gpu_setup and the Python Subscriber's _setup both call it.


def _welcome_payload(num_slots: int, rows: int, row: int, sync_nbytes: int) -> bytes:
    from cupy_ipcpool._handles import PoolDescriptor
    from cupy_ipcpool.channel._payload import WELCOME_HEAD

    desc = PoolDescriptor(
        pool_id=b"p" * 16,
        exporter_pid=1,
        exporter_start_time=1,
        exporter_uid=0,
        device_uuid=b"u" * 16,
        device_ordinal=0,
        num_slots=num_slots,
        slot_nbytes=4096,
        alloc_nbytes=4096,
        fds=tuple(range(100, 100 + num_slots)),  # not in the bytes: they travel beside them
    ).to_bytes()
    return WELCOME_HEAD.pack(len(desc), num_slots, rows, row, sync_nbytes) + desc


def test_a_welcome_that_adds_up_is_taken() -> None:
    from cupy_ipcpool.channel._payload import WELCOME_HEAD, check_welcome
    from cupy_ipcpool.channel._syncpage import FlagLayout

    nbytes = FlagLayout(4, 8).nbytes
    payload = _welcome_payload(4, 8, 3, nbytes)
    row, rows, sync_nbytes, at, length = check_welcome(payload, 4, 5)
    assert (row, rows, sync_nbytes, at) == (3, 8, nbytes, WELCOME_HEAD.size)
    assert at + length == len(payload)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("short", "WELCOME payload too short"),
        ("another slot count", "WELCOME does not add up: 5 slots (session says 4)"),
        ("a row past the rows", "row 8 of 8"),
        ("too many rows", "row 3 of 70000"),
        ("an fd missing", "4 fds"),
        ("another page size", "announces a 8192-byte sync page; 4 slots and 8 rows take 4096"),
        ("a bad descriptor", "bad pool descriptor in WELCOME"),
    ],
)
def test_a_welcome_that_does_not_add_up_is_a_protocol_error(case: str, words: str) -> None:
    from cupy_ipcpool.channel._payload import check_welcome
    from cupy_ipcpool.channel._syncpage import FlagLayout

    nbytes = FlagLayout(4, 8).nbytes
    payload, n, nfds = _welcome_payload(4, 8, 3, nbytes), 4, 5
    if case == "short":
        payload = payload[:10]
    elif case == "another slot count":
        payload = _welcome_payload(5, 8, 3, nbytes)
    elif case == "a row past the rows":
        payload = _welcome_payload(4, 8, 8, nbytes)
    elif case == "too many rows":
        payload = _welcome_payload(4, 70000, 3, nbytes)
    elif case == "an fd missing":
        nfds = 4
    elif case == "another page size":
        payload = _welcome_payload(4, 8, 3, 2 * nbytes)
    else:
        payload = payload[:30] + b"\xff" + payload[31:]
    with pytest.raises(ProtocolError, match=re.escape(words)):
        check_welcome(payload, n, nfds)
