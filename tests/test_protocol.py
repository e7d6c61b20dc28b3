"""Wire format and lease accounting: no sockets, no processes."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupy_ipcpool import _compiled
from cupy_ipcpool._errors import ProtocolError, UsageError
from cupy_ipcpool.channel import _protocol as proto
from cupy_ipcpool.channel._leases import LeaseBook

VALID = [
    (
        proto.encode_hello(proto.MODE_BLOCK, 64, 1234, b"events"),
        proto.Hello(0, 64, 1234, b"events"),
    ),
    (proto.encode_hello(proto.MODE_LATEST, 1, 1), proto.Hello(1, 1, 1, b"")),
    (
        proto.encode_welcome(7, 4, 99, b"descriptor"),
        proto.Welcome(7, 4, 99, b"descriptor"),
    ),
    (
        proto.encode_welcome(1, 8, 0, credit=65535, lease_timeout_ms=2**32 - 1),
        proto.Welcome(1, 8, 0, b"", 65535, 2**32 - 1),
    ),
    (proto.encode_refuse("uid 5 is not allowed"), proto.Refuse("uid 5 is not allowed")),
    (proto.encode_refuse("ünïcode ✓"), proto.Refuse("ünïcode ✓")),
    (proto.encode_frame(2**64 - 1, 3, b"\x00" * 100), proto.Frame(2**64 - 1, 3, b"\x00" * 100)),
    (proto.encode_frame(0, 0), proto.Frame(0, 0, b"")),
    (proto.encode_release(42, 1), proto.Release(42, 1)),
    (proto.encode_bye(), proto.Bye()),
]


@pytest.mark.parametrize(("data", "expected"), VALID)
def test_round_trip(data: bytes, expected: proto.Message) -> None:
    assert proto.decode(data) == expected
    assert proto.decode(memoryview(data)) == expected
    assert proto.decode(bytearray(data)) == expected


def test_max_sizes_round_trip() -> None:
    big = b"x" * proto.MAX_FRAME_PAYLOAD
    assert proto.decode(proto.encode_frame(1, 2, big)).payload == big  # type: ignore[union-attr]
    big = b"y" * proto.MAX_WELCOME_PAYLOAD
    msg = proto.decode(proto.encode_welcome(1, 2, 3, big))
    assert isinstance(msg, proto.Welcome)
    assert msg.payload == big
    assert len(proto.encode_refuse("z" * 5000)) == 8 + proto.MAX_REFUSE_REASON
    # Cutting a long reason never splits a UTF-8 character.
    assert isinstance(proto.decode(proto.encode_refuse("é" * 1000)), proto.Refuse)


@pytest.mark.parametrize(
    "call",
    [
        lambda: proto.encode_frame(0, 0, b"x" * (proto.MAX_FRAME_PAYLOAD + 1)),
        lambda: proto.encode_hello(0, 1, 1, b"x" * (proto.MAX_HELLO_PAYLOAD + 1)),
        lambda: proto.encode_hello(3, 1, 1),
        lambda: proto.encode_hello(0, 0, 1),
        lambda: proto.encode_hello(0, 70000, 1),
        lambda: proto.encode_welcome(1, 0, 0),
        lambda: proto.encode_welcome(1, 1, 0, b"x" * (proto.MAX_WELCOME_PAYLOAD + 1)),
    ],
)
def test_encode_rejects_out_of_range(call: object) -> None:
    with pytest.raises(ValueError):
        call()  # type: ignore[operator]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"IP",
        struct.pack("<HBB", 0x1234, 2, proto.BYE),
        struct.pack("<HBB", proto.MAGIC, proto.VERSION + 1, proto.BYE),
        struct.pack("<HBB", proto.MAGIC, 1, proto.BYE),  # version 1 had a shorter WELCOME
        struct.pack("<HBB", proto.MAGIC, 2, 0),
        struct.pack("<HBB", proto.MAGIC, 2, 99),
        # length fields over the limit or not matching the message
        struct.pack("<HBBQII", proto.MAGIC, 2, proto.FRAME, 0, 0, proto.MAX_FRAME_PAYLOAD + 1),
        struct.pack("<HBBQII", proto.MAGIC, 2, proto.FRAME, 0, 0, 5) + b"abcd",
        struct.pack("<HBBQII", proto.MAGIC, 2, proto.FRAME, 0, 0, 3) + b"abcd",
        struct.pack("<HBBBHII", proto.MAGIC, 2, proto.HELLO, 3, 1, 1, 0),
        struct.pack("<HBBBHII", proto.MAGIC, 2, proto.HELLO, 0, 0, 1, 0),
        struct.pack("<HBBIIQHII", proto.MAGIC, 2, proto.WELCOME, 1, 0, 0, 1, 0, 0),
        struct.pack("<HBBIIQHII", proto.MAGIC, 2, proto.WELCOME, 1, 1, 0, 0, 0, 0),
        struct.pack("<HBBI", proto.MAGIC, 2, proto.REFUSE, 2) + b"\xff\xfe",
        struct.pack("<HBBI", proto.MAGIC, 2, proto.REFUSE, 2000) + b"a" * 2000,
        proto.encode_release(1, 1) + b"\x00",
        proto.encode_bye() + b"\x00",
    ],
)
def test_decode_rejects(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        proto.decode(data)


def _decode_only_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        proto.decode(data)


@pytest.mark.parametrize(("data", "_expected"), VALID)
def test_every_truncation_and_extension_rejected(data: bytes, _expected: object) -> None:
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            proto.decode(data[:cut])
    for extra in (b"\x00", b"\xff" * 7):
        with pytest.raises(ProtocolError):
            proto.decode(data + extra)


@pytest.mark.parametrize(("data", "_expected"), VALID)
def test_every_bit_flip_decodes_or_raises_protocol_error(data: bytes, _expected: object) -> None:
    for bit in range(min(len(data), 64) * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        _decode_only_protocol_error(bytes(flipped))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    _decode_only_protocol_error(data)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from([d for d, _ in VALID]), st.binary(max_size=40), st.integers(0, 200))
def test_mutated_headers_raise_only_protocol_error(valid: bytes, junk: bytes, at: int) -> None:
    at = min(at, len(valid))
    _decode_only_protocol_error(valid[:at] + junk + valid[at + len(junk) :])
    _decode_only_protocol_error(valid[:4] + junk)


# -- LeaseBook --------------------------------------------------------------------


def _book() -> LeaseBook:
    book = LeaseBook(4)
    book.add_subscriber(1, "block", 64)
    book.add_subscriber(2, "latest", 1)
    return book


def test_block_gets_every_frame_latest_within_credit() -> None:
    book = _book()
    assert book.publishing(0, 0) == [1, 2]
    assert book.publishing(1, 1) == [1]  # latest has its one credit out
    assert book.outstanding(1) == 2
    assert book.outstanding(2) == 1
    assert book.leases(0) == [(1, 0), (2, 0)]
    assert book.release(2, 0, 0) is False  # block subscriber still holds slot 0
    assert book.publishing(2, 2) == [1, 2]
    assert book.release(1, 0, 0) is True
    assert book.is_free(0)
    assert book.free_slots() == [0, 3]


def test_latest_credit_two() -> None:
    book = LeaseBook(4)
    book.add_subscriber(5, "latest", 2)
    assert [book.publishing(s, s) for s in range(4)] == [[5], [5], [], []]
    assert book.free_slots() == [2, 3]
    assert book.held_by(5) == {0: 0, 1: 1}


def test_release_validation() -> None:
    book = _book()
    book.publishing(0, 10)
    with pytest.raises(ProtocolError, match="does not hold"):
        book.release(1, 11, 0)  # unknown seq
    with pytest.raises(ProtocolError, match="slot"):
        book.release(1, 10, 1)  # wrong slot
    with pytest.raises(ProtocolError, match="unknown subscriber"):
        book.release(9, 10, 0)
    assert book.release(1, 10, 0) is False
    with pytest.raises(ProtocolError):
        book.release(1, 10, 0)  # double release
    assert book.release(2, 10, 0) is True
    with pytest.raises(ProtocolError):
        book.release(2, 10, 0)


def test_publishing_a_leased_slot_is_a_bug() -> None:
    book = _book()
    book.publishing(0, 0)
    with pytest.raises(RuntimeError):
        book.publishing(0, 1)


def test_remove_subscriber_frees_its_slots() -> None:
    book = _book()
    book.publishing(0, 0)
    book.publishing(1, 1)
    book.hold(1)
    book.release(2, 0, 0)
    assert book.remove_subscriber(1) == [0]  # slot 1 is still held locally
    assert book.leases(1) == []
    assert not book.is_free(1)
    assert book.unhold(1) is True
    assert book.remove_subscriber(1) == []
    assert book.free_slots() == [0, 1, 2, 3]


def test_readers_to_wait() -> None:
    book = _book()
    book.publishing(0, 0)
    assert book.readers_to_wait(0) == []
    book.release(2, 0, 0)
    book.release(1, 0, 0)
    assert book.readers_to_wait(0) == [2, 1]
    book.remove_subscriber(2)
    assert book.readers_to_wait(0) == [1]
    book.publishing(0, 1)
    assert book.readers_to_wait(0) == []


def test_cancel_does_not_count_as_reader() -> None:
    book = _book()
    book.publishing(0, 0)
    assert book.cancel(2, 0, 0) is False
    assert book.outstanding(2) == 0
    assert book.cancel(1, 0, 0) is True
    assert book.readers_to_wait(0) == []
    with pytest.raises(ProtocolError):
        book.cancel(1, 0, 0)


def test_pick_free_slot_round_robin_and_holds() -> None:
    book = LeaseBook(3)
    assert book.pick_free_slot(0) == 0
    assert book.pick_free_slot(2) == 2
    assert book.pick_free_slot(3) == 0
    book.hold(0)
    book.hold(0)
    assert book.pick_free_slot(0) == 1
    book.add_subscriber(1, "block", 1)
    book.publishing(1, 0)
    book.publishing(2, 1)
    assert book.pick_free_slot(0) is None
    assert book.unhold(0) is False
    assert book.unhold(0) is True
    assert book.pick_free_slot(1) == 0
    with pytest.raises(RuntimeError):
        book.unhold(0)
    with pytest.raises(IndexError):
        book.hold(3)


def test_publish_held_slot_allowed_but_not_free() -> None:
    book = _book()
    book.hold(0)
    assert book.publishing(0, 0) == [1, 2]
    book.release(1, 0, 0)
    assert book.release(2, 0, 0) is False  # still held locally
    assert book.unhold(0) is True


def test_add_subscriber_validation() -> None:
    book = _book()
    with pytest.raises(ValueError):
        book.add_subscriber(1, "block", 1)
    with pytest.raises(ValueError):
        book.add_subscriber(3, "sometimes", 1)
    with pytest.raises(ValueError):
        book.add_subscriber(3, "latest", 0)
    with pytest.raises(ValueError):
        LeaseBook(0)


# -- credit cap, latest reserve, eviction rule ---------------------------------------


def test_max_credit_caps_what_a_subscriber_asks() -> None:
    from cupy_ipcpool.channel._leases import default_latest_reserve, default_max_credit

    assert [default_max_credit(n) for n in (1, 2, 3, 4, 8, 64)] == [1, 1, 1, 2, 6, 62]
    assert [default_latest_reserve(n) for n in (1, 2, 3, 8)] == [0, 1, 2, 2]
    book = LeaseBook(8)
    assert book.add_subscriber(1, "latest", 65535) == 6
    assert book.credit(1) == 6
    assert LeaseBook(8, max_credit=3).add_subscriber(1, "latest", 5) == 3
    with pytest.raises(ValueError):
        LeaseBook(8, max_credit=0)
    with pytest.raises(ValueError):
        LeaseBook(4, latest_reserve=4)


def test_latest_subscribers_together_leave_the_reserve_free() -> None:
    book = LeaseBook(6, max_credit=6)
    book.add_subscriber(1, "latest", 6)
    book.add_subscriber(2, "latest", 6)
    got = [book.publishing(s, s) for s in range(6)]
    assert got == [[1, 2]] * 4 + [[], []]  # two slots stay out of reach
    assert book.latest_leased_slots() == 4
    assert book.free_slots() == [4, 5]
    book.release(1, 0, 0)
    assert book.latest_leased_slots() == 4  # subscriber 2 still holds slot 0
    book.release(2, 0, 0)
    assert book.latest_leased_slots() == 3
    assert book.publishing(0, 6) == [1, 2]
    book.remove_subscriber(1)
    book.remove_subscriber(2)
    assert book.latest_leased_slots() == 0


def test_block_subscribers_ignore_the_reserve() -> None:
    book = LeaseBook(3)
    book.add_subscriber(1, "block", 64)
    assert [book.publishing(s, s) for s in range(3)] == [[1], [1], [1]]
    assert book.free_slots() == []


def test_cancel_returns_latest_room() -> None:
    book = LeaseBook(3)
    book.add_subscriber(1, "latest", 1)
    assert book.publishing(0, 0) == [1]
    assert book.cancel(1, 0, 0) is True
    assert book.latest_leased_slots() == 0


def test_overdue_names_subscribers_holding_too_long() -> None:
    book = LeaseBook(8)
    book.add_subscriber(1, "block", 64)
    book.add_subscriber(2, "latest", 2)
    assert book.overdue(100.0, 1.0) == []
    assert book.next_expiry(1.0) is None
    book.publishing(0, 0, now=10.0)
    book.publishing(1, 1, now=10.5)
    book.publishing(2, 2, now=11.0)  # latest has its two
    assert book.oldest_lease(1) == 10.0
    assert book.next_expiry(1.0) == 11.0
    assert book.overdue(10.9, 1.0) == []
    assert book.overdue(11.1, 1.0) == [1, 2]
    book.release(1, 0, 0)
    book.release(2, 0, 0)
    assert book.oldest_lease(1) == 10.5
    assert book.overdue(11.1, 1.0) == []
    assert book.overdue(11.6, 1.0) == [1, 2]
    book.remove_subscriber(2)
    assert book.overdue(11.6, 1.0) == [1]
    assert book.oldest_lease(2) is None


# What the channel sends is the engine's (c/src/message.c): the accept thread writes its
# WELCOMEs and REFUSEs with the writers _engine.encode_welcome / encode_refuse bind, and
# proto.bye_message is the engine's BYE; the encode_* functions are the pure-Python reference.


def welcome_message(
    sub_id: int,
    num_slots: int,
    next_seq: int,
    payload: bytes,
    *,
    credit: int = 1,
    lease_timeout_ms: int = 0,
) -> bytes:
    """The WELCOME as the engine writes it (cipi_put_welcome: the accept thread's writer)."""
    engine = _compiled.load("cupy_ipcpool._engine")
    return bytes(
        engine.encode_welcome(sub_id, num_slots, next_seq, payload, credit, lease_timeout_ms)
    )


def refuse_message(reason: str) -> bytes:
    """The REFUSE as the engine writes it (cipi_put_refuse: the accept thread's writer)."""
    return bytes(_compiled.load("cupy_ipcpool._engine").encode_refuse(reason))


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.integers(-1, proto.MAX_SLOTS + 1),
    st.integers(0, 2**64 - 1),
    st.binary(max_size=64),
    st.integers(0, proto.MAX_CREDIT + 1),
    st.integers(0, 2**32),
)
def test_the_engines_welcome_is_the_reference_encoders(
    sub_id: int, num_slots: int, next_seq: int, payload: bytes, credit: int, lease_ms: int
) -> None:
    def answer(encode: object) -> object:
        try:
            return encode(  # type: ignore[operator]
                sub_id, num_slots, next_seq, payload, credit=credit, lease_timeout_ms=lease_ms
            )
        except (ValueError, OverflowError) as exc:
            return type(exc).__name__, str(exc)

    assert answer(welcome_message) == answer(proto.encode_welcome)


def test_the_engines_welcome_refuses_a_payload_past_the_limit() -> None:
    big = b"x" * (proto.MAX_WELCOME_PAYLOAD + 1)
    with pytest.raises(UsageError) as engine:
        welcome_message(1, 1, 0, big)
    with pytest.raises(UsageError) as reference:
        proto.encode_welcome(1, 1, 0, big)
    assert str(engine.value) == str(reference.value)
    data = welcome_message(1, 1, 0, big[:-1])  # at the limit: whole
    assert proto.decode(data) == proto.Welcome(1, 1, 0, big[:-1])


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=1200) | st.text(alphabet="é✓\U0001f600a", min_size=300, max_size=700))
def test_the_engines_refuse_is_the_reference_encoders(reason: str) -> None:
    """A reason past 1 KiB of UTF-8 is cut before the character it would split; a lone
    surrogate (not encodable) becomes '?'."""
    data = refuse_message(reason)
    assert data == proto.encode_refuse(reason)
    assert isinstance(proto.decode(data), proto.Refuse)


def test_the_engines_refuse_of_a_lone_surrogate_and_the_bye() -> None:
    assert refuse_message("a\ud800b") == proto.encode_refuse("a\ud800b")
    assert proto.decode(refuse_message("a\ud800b")) == proto.Refuse("a?b")
    assert proto.bye_message() == proto.encode_bye()
