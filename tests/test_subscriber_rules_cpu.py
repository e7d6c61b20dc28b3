"""The subscriber rules the Python subscriber and the C library once disagreed on (issue 44).

Each rule is written in docs/protocol.md; each test here runs both consumers of the
protocol layer -- the Python session core (:class:`SubscriberCore` over memfd slots)
and the C library's raw session in ``c/tests/cip_probe.c`` -- against the same
hand-built publisher (:class:`Peer`: a real ``SOCK_SEQPACKET`` socket, real memfds,
every byte crafted here), through the adapters of ``test_scenarios_cpu.py``.  Where a
rule lives in the GPU layers (which need a device), the part of it that runs without
one is tested on both sides: the payload check, the flag logic.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _memfd_backend import pattern
from _memop_recorder import MemopRecorder
from test_c_library import _welcome, read_messages, status
from test_scenarios_cpu import (  # noqa: F401 - cip_probe: the C probe's fixture
    C_WORDS,
    DEADLINE,
    PY_WORDS,
    CConsumer,
    Consumer,
    Got,
    Outcome,
    PyConsumer,
    cip_probe,
    consumer_of,
    frame,
    outcome,
)

from cupy_ipcpool._errors import ProtocolError
from cupy_ipcpool._handles import ArrayHandle
from cupy_ipcpool.channel import _protocol as proto
from cupy_ipcpool.channel._payload import FRAME_HEAD, check_frame
from cupy_ipcpool.channel._subscriber_core import SubscriberCore

SLOT_SIZE = struct.Struct("<Q")
KINDS = ["python", "c"]


class Peer:
    """A hand-built publisher: answers the HELLO with a WELCOME of ``num_slots`` memfd
    slots (slot ``i`` holding frame ``i``'s pattern), then does what the test says.

    :meth:`send` queues messages on the connection; :meth:`hang_up` closes it (no BYE
    unless one was sent); :meth:`received` reads what the subscriber sent.
    """

    def __init__(self, address: str, num_slots: int = 3, next_seq: int = 0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(address)
        self.sock.listen(4)
        self.fds: list[int] = []
        for i in range(num_slots):
            fd = os.memfd_create(f"cip-rule-{i}", os.MFD_CLOEXEC)
            os.ftruncate(fd, 4096)
            with mmap.mmap(fd, 4096) as m:
                m[:] = pattern(i, 4096)
            self.fds.append(fd)
        self.welcome = _welcome(
            num_slots=num_slots,
            credit=num_slots,
            payload=SLOT_SIZE.pack(4096),
            next_seq=next_seq,
        )
        self.conn: socket.socket | None = None
        self.joined = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(20)
        conn, _ = self.sock.accept()
        conn.settimeout(20)
        conn.recv(1 << 17)  # HELLO
        socket.send_fds(conn, [self.welcome], self.fds)
        self.conn = conn
        self.joined.set()

    def send(self, *messages: bytes) -> None:
        assert self.joined.wait(DEADLINE), "the subscriber never joined"
        assert self.conn is not None
        for msg in messages:
            self.conn.send(msg)

    def stream(self, frames: int) -> None:
        """Send ``frames`` frames from a thread, frame ``seq`` in slot ``seq % num_slots``,
        reading nothing meanwhile (the subscriber's socket fills with its RELEASEs)."""
        assert self.joined.wait(DEADLINE)
        assert self.conn is not None
        num_slots, conn = len(self.fds), self.conn

        def send_all() -> None:
            with contextlib.suppress(OSError):  # the subscriber may hang up first
                for seq in range(frames):
                    conn.send(proto.encode_frame(seq, seq % num_slots))

        self.thread = threading.Thread(target=send_all, daemon=True)
        self.thread.start()

    def read(self, count: int, timeout: float) -> list[proto.Message]:
        """Read until ``count`` messages arrived (or ``timeout``, or the hang-up)."""
        assert self.conn is not None
        return read_messages(self.conn, count, timeout)

    def hang_up(self) -> None:
        """Close the connection: the subscriber sees a hang-up (after what was queued)."""
        assert self.joined.wait(DEADLINE)
        assert self.conn is not None
        self.conn.close()

    def received(self, until_hang_up: bool = False) -> tuple[list[proto.Message], bool]:
        """What the subscriber sent (waiting up to DEADLINE for its hang-up if asked), and
        whether it hung up."""
        assert self.conn is not None
        out: list[proto.Message] = []
        deadline = time.monotonic() + (DEADLINE if until_hang_up else 0.2)
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.conn], [], [], 0.05)
            if not ready:
                continue
            try:
                data = self.conn.recv(1 << 17)
            except ConnectionResetError:
                return out, True
            if not data:
                return out, True
            out.append(proto.decode(data))
        return out, False

    def close(self) -> None:
        self.thread.join(DEADLINE)
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.close()
        self.sock.close()
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


@pytest.fixture(params=KINDS)
def consumer(request: pytest.FixtureRequest) -> Iterator[Consumer]:
    """Each consumer in turn: the Python session core, the C library's raw session."""
    with consumer_of(request.param, request) as made:
        yield made


@pytest.fixture
def address(tmp_path: Any) -> str:
    return str(tmp_path / "pub.sock")


@pytest.fixture
def peer_at(address: str) -> Iterator[Any]:
    made: list[Peer] = []

    def make(**kw: Any) -> Peer:
        p = Peer(address, **kw)
        made.append(p)
        return p

    try:
        yield make
    finally:
        for p in made:
            p.close()


def _open(c: Consumer, address: str, peer: Peer) -> None:
    got = c.open(address)
    assert got.word == "ok", got
    assert peer.joined.wait(DEADLINE)


def _ended_by_protocol_error(c: Consumer, peer: Peer, words: str) -> None:
    """The next receive is a protocol error naming ``words``; the subscription is closed
    (the peer sees it hang up) and nothing more is handed out."""
    got = c.recv()
    assert outcome(got) == "protocol", got
    assert isinstance(got, Outcome) and words in got.message, got
    _, hung_up = peer.received(until_hang_up=True)
    assert hung_up, "the subscriber kept the connection of a peer that broke the protocol"
    # every later call ends (C repeats the protocol error; Python's core reports the
    # closed connection as EndOfStream(clean=False): test_scenarios_cpu.py, "DIFFERS")
    assert outcome(c.recv(0)) in {"protocol", "gone"}


# ---------------------------------------------------------------- rule 1: seqs and slots
# docs/protocol.md, "Failures": a FRAME whose seq is not after every seq received (and
# not below the WELCOME's next_seq), or whose slot holds a frame this subscriber still
# holds, is a protocol error.


@pytest.mark.timeout(60)
def test_a_seq_that_goes_backwards_is_a_protocol_error(
    consumer: Consumer, address: str, peer_at: Any
) -> None:
    peer = peer_at()
    _open(consumer, address, peer)
    peer.send(proto.encode_frame(1, 1, b"one"), proto.encode_frame(0, 0, b"zero"))
    assert frame(consumer.recv()) == Got(1, 1, b"one", True)
    _ended_by_protocol_error(consumer, peer, "frame 0 arrived after frame 1")


@pytest.mark.timeout(60)
def test_a_seq_received_and_released_is_not_taken_again(
    consumer: Consumer, address: str, peer_at: Any
) -> None:
    peer = peer_at()
    _open(consumer, address, peer)
    peer.send(proto.encode_frame(0, 0, b""))
    got = frame(consumer.recv())
    assert consumer.release(got.seq, got.slot).word == "ok"
    peer.send(proto.encode_frame(0, 1, b"again"))
    _ended_by_protocol_error(consumer, peer, "frame 0 arrived after frame 0")


@pytest.mark.timeout(60)
def test_a_seq_before_the_welcome_s_next_seq_is_a_protocol_error(
    consumer: Consumer, address: str, peer_at: Any
) -> None:
    peer = peer_at(next_seq=5)
    _open(consumer, address, peer)
    peer.send(proto.encode_frame(3, 0, b""))
    _ended_by_protocol_error(consumer, peer, "frame 3 arrived before the first, 5")


@pytest.mark.timeout(60)
def test_a_second_frame_in_a_held_slot_is_a_protocol_error(
    consumer: Consumer, address: str, peer_at: Any
) -> None:
    peer = peer_at()
    _open(consumer, address, peer)
    peer.send(proto.encode_frame(0, 0, b""), proto.encode_frame(1, 0, b""))
    held = frame(consumer.recv())
    assert held.seq == 0
    _ended_by_protocol_error(consumer, peer, "where this subscriber still holds frame 0")
    assert consumer.check(0, 0), "the held frame's slot is as it was"


@pytest.mark.timeout(60)
def test_a_slot_released_takes_its_next_frame(
    consumer: Consumer, address: str, peer_at: Any
) -> None:
    """The counterpart: once released, a slot's next use is an ordinary frame, and seqs
    may skip (a "latest" subscriber's gaps)."""
    peer = peer_at()
    _open(consumer, address, peer)
    peer.send(proto.encode_frame(0, 0, b"a"))
    first = frame(consumer.recv())
    assert consumer.release(first.seq, first.slot).word == "ok"
    peer.send(proto.encode_frame(3, 0, b"b"))
    second = frame(consumer.recv())
    assert (second.seq, second.slot, second.payload) == (3, 0, b"b")
    msgs, _ = peer.received()
    assert [(m.seq, m.slot) for m in msgs if isinstance(m, proto.Release)] == [(0, 0)]


# ---------------------------------------------------------------- rule 3: hang-ups
# docs/protocol.md, "Failures": after a hang-up without BYE no frame still queued is
# handed out (the publisher takes the connection's leases back as it ends).


@pytest.mark.timeout(60)
def test_frames_queued_at_a_hang_up_without_bye_are_dropped(
    consumer: Consumer, address: str, peer_at: Any
) -> None:
    peer = peer_at()
    _open(consumer, address, peer)
    peer.send(proto.encode_frame(0, 0, b""))
    held = frame(consumer.recv())
    peer.send(proto.encode_frame(1, 1, b""), proto.encode_frame(2, 2, b""))
    peer.hang_up()
    got = consumer.recv()
    assert outcome(got) == "gone", "a frame queued at a hang-up without BYE was handed out"
    assert isinstance(got, Outcome) and "without BYE" in got.message, got
    assert outcome(consumer.recv(0)) == "gone"
    # the frame held before the hang-up stays readable; its release only forgets it
    assert consumer.check(held.seq, held.slot)
    assert consumer.release(held.seq, held.slot).word == "ok"


@pytest.mark.timeout(60)
def test_frames_queued_before_a_bye_are_handed_out_and_nothing_after_it(
    consumer: Consumer, address: str, peer_at: Any
) -> None:
    """The counterpart: a BYE keeps what was queued before it; what follows it is ignored."""
    peer = peer_at()
    _open(consumer, address, peer)
    peer.send(
        proto.encode_frame(0, 0, b"a"),
        proto.encode_frame(1, 1, b"b"),
        proto.encode_bye(),
        proto.encode_frame(2, 2, b"after"),
    )
    peer.hang_up()
    assert [frame(consumer.recv()).payload for _ in range(2)] == [b"a", b"b"]
    assert outcome(consumer.recv()) == "end"
    assert outcome(consumer.recv(0)) == "end"


@pytest.mark.timeout(60)
def test_an_eviction_notice_after_a_bye_does_not_count(
    consumer: Consumer, address: str, peer_at: Any
) -> None:
    """At a hang-up the first BYE or REFUSE queued decides: nothing after a BYE counts,
    an eviction notice neither (the C library took one there as an eviction)."""
    peer = peer_at()
    _open(consumer, address, peer)
    peer.send(
        proto.encode_frame(0, 0, b"a"),
        proto.encode_bye(),
        proto.encode_refuse("lease_timeout"),
    )
    peer.hang_up()
    assert frame(consumer.recv()).payload == b"a"
    assert outcome(consumer.recv()) == "end"


@pytest.mark.timeout(60)
def test_an_eviction_notice_before_a_bye_ends_the_stream_as_evicted(
    consumer: Consumer, address: str, peer_at: Any
) -> None:
    peer = peer_at()
    _open(consumer, address, peer)
    peer.send(
        proto.encode_frame(0, 0, b"a"),
        proto.encode_refuse("lease_timeout"),
        proto.encode_bye(),
    )
    peer.hang_up()
    got = consumer.recv()
    assert outcome(got) == "evicted", got
    assert isinstance(got, Outcome) and "lease_timeout" in got.message, got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["HELLO", "WELCOME", "RELEASE"])
def test_a_message_no_publisher_sends_on_a_live_stream_is_a_protocol_error(
    consumer: Consumer, address: str, peer_at: Any, kind: str
) -> None:
    messages = {
        "HELLO": proto.encode_hello(proto.MODE_BLOCK, 1, os.getpid()),
        "WELCOME": proto.encode_welcome(1, 4, 0),
        "RELEASE": proto.encode_release(0, 0),
    }
    peer = peer_at()
    _open(consumer, address, peer)
    peer.send(messages[kind])
    _ended_by_protocol_error(consumer, peer, f"unexpected {kind} from the publisher")


# ---------------------------------------------------------------- rule 4: malformed REFUSE
# docs/protocol.md, "Failures": a REFUSE that does not decode is a protocol error, never
# an eviction; queued at a hang-up it keeps every frame queued from being handed out.


#: Malformed REFUSEs: its length field says more than it carries; its reason is not UTF-8
#: (the C library took it as an eviction, with the bytes as the reason).
MALFORMED_REFUSES = {
    "short": proto.encode_refuse("lease_timeout")[:-2],
    "not utf-8": struct.pack("<HBBI", proto.MAGIC, proto.VERSION, proto.REFUSE, 3) + b"ok\xff",
}


@pytest.fixture(params=sorted(MALFORMED_REFUSES))
def malformed_refuse(request: pytest.FixtureRequest) -> bytes:
    return MALFORMED_REFUSES[request.param]


@pytest.mark.timeout(60)
def test_a_malformed_refuse_queued_at_a_hang_up_is_a_protocol_error(
    consumer: Consumer, address: str, peer_at: Any, malformed_refuse: bytes
) -> None:
    peer = peer_at()
    _open(consumer, address, peer)
    peer.send(proto.encode_frame(0, 0, b""), malformed_refuse, proto.encode_bye())
    peer.hang_up()
    got = consumer.recv()
    assert outcome(got) == "protocol", f"not a protocol error: {got}"
    assert isinstance(got, Outcome) and "REFUSE" in got.message, got
    assert outcome(consumer.recv(0)) in {"protocol", "gone"}


@pytest.mark.timeout(60)
def test_a_malformed_refuse_on_a_live_connection_is_a_protocol_error(
    consumer: Consumer, address: str, peer_at: Any, malformed_refuse: bytes
) -> None:
    peer = peer_at()
    _open(consumer, address, peer)
    peer.send(proto.encode_frame(0, 0, b""), malformed_refuse)
    assert frame(consumer.recv()).seq == 0  # taken before the notice, no hang-up since
    _ended_by_protocol_error(consumer, peer, "REFUSE")


# ---------------------------------------------------------------- rule 2: handles in the frame
# docs/protocol.md, "What a subscriber refuses": every array handle of a FRAME names the
# frame's slot and generation.  The check belongs to the GPU layers (the Python
# Subscriber's _hand_out calls _payload.check_frame, the engine's; the C library's
# cip_sub_recv calls the same C function, which cip_parse_frame_payload exposes): here it
# runs on the payload each consumer received from the same peer, through each way in.


def _handle_payload(slot: int, generation: int, handle_slot: int, handle_generation: int) -> bytes:
    handle = ArrayHandle(handle_slot, handle_generation, 0, (4,), (8,), np.dtype("float64"))
    return FRAME_HEAD.pack(slot, generation, 1, 0) + handle.pack()


def _payload_check(c: Consumer, got: Got) -> Outcome:
    """The consumer's check of the frame's array handles against its head."""
    if isinstance(c, CConsumer):
        answer = c.probe("parse")
        return (
            Outcome("ok") if answer.startswith("ok ") else Outcome(C_WORDS[status(answer)], answer)
        )
    try:
        check_frame(got.seq, got.slot, got.payload, 1 << 20)
    except ProtocolError as exc:
        return Outcome("protocol", str(exc))
    return Outcome("ok")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("handle_slot", "handle_generation", "words"),
    [
        (1, 7, "lies in slot 1, not in the frame's"),
        (0, 6, "is of generation 6, the frame of 7"),
        (0, 7 + (1 << 32), ""),  # the head carries the low 32 bits: the same generation
        (0, 7, ""),
    ],
)
def test_each_array_handle_names_the_frame_s_slot_and_generation(
    consumer: Consumer,
    address: str,
    peer_at: Any,
    handle_slot: int,
    handle_generation: int,
    words: str,
) -> None:
    peer = peer_at()
    _open(consumer, address, peer)
    payload = _handle_payload(0, 7, handle_slot, handle_generation)
    peer.send(proto.encode_frame(0, 0, payload))
    got = frame(consumer.recv())
    checked = _payload_check(consumer, got)
    if words:
        assert checked.word == "protocol", checked
        assert words in checked.message, checked
    else:
        assert checked.word == "ok", checked


# ---------------------------------------------------------------- rule 5: a full socket
# docs/protocol.md, "Failures": a release never waits for the publisher to read: a
# RELEASE the socket does not take is kept and sent, in order, at the next receive or
# release that finds room (and before the BYE at close); past MAX_CREDIT + num_slots
# owed, no credit explains it and the subscription ends.


def _recv_release(c: Consumer, n: int) -> tuple[str, int, str]:
    """Receive and release ``n`` frames: (outcome word, frames done, message)."""
    if isinstance(c, CConsumer):
        answer = c.probe(f"recvrel {n} 5000", timeout=120)
        if answer.startswith("ok "):
            return "ok", int(answer.split()[1]), answer
        return C_WORDS[status(answer)], int(answer.split()[3]), answer
    assert isinstance(c, PyConsumer) and c.mc is not None
    core = c.mc.core
    for done in range(n):
        try:
            got = core.recv(5.0)
            core.release(got.seq, got.slot)
        except Exception as exc:
            word = next(w for cls, w in PY_WORDS if isinstance(exc, cls))
            return word, done, str(exc)
    return "ok", n, ""


@pytest.mark.timeout(120)
def test_releases_a_full_socket_did_not_take_are_sent_later_in_order(
    consumer: Consumer, address: str, peer_at: Any
) -> None:
    num_slots, frames = 8, 1200  # the subscriber's socket takes a few hundred RELEASEs
    peer = peer_at(num_slots=num_slots)
    _open(consumer, address, peer)
    peer.stream(frames)
    # every release returns at once, however full the socket (no wait, no error)
    t0 = time.monotonic()
    word, done, message = _recv_release(consumer, frames)
    assert (word, done) == ("ok", frames), message
    assert time.monotonic() - t0 < 20, "a release waited for the publisher to read"
    first = peer.read(frames, 0.5)
    assert 0 < len(first) < frames, (
        f"{len(first)} RELEASEs were in the socket: it never filled, so this proves nothing"
    )
    # the publisher reads again; the subscriber's next call sends what it owes
    rest: list[proto.Message] = []
    reader = threading.Thread(target=lambda: rest.extend(peer.read(frames - len(first), 20)))
    reader.start()
    assert outcome(consumer.recv(1500)) == "timeout"
    reader.join(30)
    got = [(m.seq, m.slot) for m in (*first, *rest) if isinstance(m, proto.Release)]
    assert got == [(seq, seq % num_slots) for seq in range(frames)], (
        f"{len(got)} RELEASEs of {frames} arrived, or out of order"
    )
    consumer.close()
    assert any(isinstance(m, proto.Bye) for m in peer.read(1, 10)), "BYE after the RELEASEs"


@pytest.mark.timeout(180)
def test_a_publisher_that_never_reads_ends_the_subscription_clearly(
    consumer: Consumer, address: str, peer_at: Any
) -> None:
    num_slots = 8
    limit = proto.MAX_CREDIT + num_slots
    peer = peer_at(num_slots=num_slots)
    _open(consumer, address, peer)
    peer.stream(limit + 400)
    word, done, message = _recv_release(consumer, limit + 400)
    assert word == "transport", message
    assert "has not read this subscriber's messages" in message
    assert limit < done < limit + 400, message
    assert outcome(consumer.recv(0)) in {"transport", "gone"}  # and every later call ends


@pytest.mark.timeout(120)
def test_the_gpu_release_writes_its_flag_and_queues_its_release_behind_those_owed(
    address: str, peer_at: Any
) -> None:
    """The GPU subscriber's release (the read-flag write and the RELEASE in one compiled
    call, SubscriberCore.release_with_write): with RELEASEs owed, the write is made at
    once and the RELEASE goes behind them, never ahead."""
    num_slots, frames = 8, 1200
    peer = peer_at(num_slots=num_slots)
    rec = MemopRecorder()
    with SubscriberCore(address, timeout=5.0) as core:
        assert peer.joined.wait(DEADLINE)
        peer.stream(frames)
        for i in range(frames):
            got = core.recv(5.0)
            if i % 2:
                core.release(got.seq, got.slot)
            else:
                rc = core.release_with_write(
                    got.seq, got.slot, rec.address, 0x5000, 0x7000_0040 + got.slot, got.seq, 0
                )
                assert rc == 0
        assert len(rec.calls) == frames // 2, "a read-flag write waited for the socket"
        msgs = peer.read(frames, 0.5)
        assert 0 < len(msgs) < frames, "the socket never filled: this proves nothing"
        reader = threading.Thread(target=lambda: msgs.extend(peer.read(frames - len(msgs), 20)))
        reader.start()
        with pytest.raises(TimeoutError):
            core.recv(1.5)
        reader.join(30)
    got_order = [(m.seq, m.slot) for m in msgs if isinstance(m, proto.Release)]
    assert got_order == [(seq, seq % num_slots) for seq in range(frames)]
