"""The remote layer without a GPU: pure wire/auth/credit state, and real UCX sessions on 127.0.0.1.

End-to-end tests run a :class:`HostChannelPublisher` (session core, memfd slots)
as the producer, :func:`cupy_ipcpool.remote.serve` as its bridge, and remote
subscribers / relays with host-memory receive rings; every byte is checked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
from _remote import SECRET, remote_sub, served_host_channel, wait_for
from skips import needs_ucx

from cupy_ipcpool import EndOfStream, IpcPoolError, PeerRefusedError, ProtocolError, SlotBusyError
from cupy_ipcpool.remote import _auth as auth
from cupy_ipcpool.remote import _wire as wire
from cupy_ipcpool.remote._credit import ClientBook, ServerBook
from tests import _pipe_child

CTX = _pipe_child.CHILDREN  # forkserver children (tests/_pipe_child.py)
N_BYTES = 40_000  # above UCX's rendezvous threshold: zero-copy into the receive slot
N_FLOATS = 300


# -- pure: wire format -------------------------------------------------------------------


def _roundtrip(data: bytes) -> wire.Message:
    return wire.decode(data)


def test_wire_roundtrip_every_message() -> None:
    n = os.urandom(32)
    assert _roundtrip(wire.encode_hello(n, wire.MODE_LATEST, 7)) == wire.Hello(n, 1, 7)
    assert _roundtrip(wire.encode_challenge(n, True, n)) == wire.Challenge(n, True, n)
    assert _roundtrip(wire.encode_proof(n, b"addr")) == wire.Proof(n, b"addr")
    assert _roundtrip(wire.encode_welcome(3, 9, 11, 1 << 20, 64)) == wire.Welcome(
        3, 9, 11, 1 << 20, 64
    )
    assert _roundtrip(wire.encode_refuse("no")) == wire.Refuse("no")
    assert _roundtrip(wire.encode_credit(5)) == wire.Credit(5)
    assert _roundtrip(wire.encode_bye()) == wire.Bye()
    specs = (wire.ArraySpec("<f4", (2, 3)), wire.ArraySpec("|u1", ()))
    msg = _roundtrip(wire.encode_frame(1 << 40, 2, specs, b"meta"))
    assert msg == wire.FrameHeader(1 << 40, 2, specs, b"meta")
    assert specs[0].nbytes == 24 and specs[1].nbytes == 1


def test_wire_refuse_is_cut_to_limit() -> None:
    msg = _roundtrip(wire.encode_refuse("é" * 2000))
    assert isinstance(msg, wire.Refuse) and len(msg.reason.encode()) <= wire.MAX_REFUSE_REASON


@pytest.mark.parametrize(
    "data, match",
    [
        (b"\x00" * 3, "shorter"),
        (struct.pack("<HBBI", 0x1234, 1, wire.BYE, 0), "magic"),
        (struct.pack("<HBBI", wire.MAGIC, 9, wire.BYE, 0), "version"),
        (struct.pack("<HBBI", wire.MAGIC, 1, 99, 0), "unknown message type"),
        (struct.pack("<HBBI", wire.MAGIC, 1, wire.CREDIT, 1 << 20), "at most"),
        (struct.pack("<HBBI", wire.MAGIC, 1, wire.BYE, 1) + b"x", "type 8 with a 1-byte"),
        (struct.pack("<HBBI", wire.MAGIC, 1, wire.CREDIT, 2) + b"xx", "CREDIT must"),
        (wire.encode_bye() + b"x", "header says"),
    ],
)
def test_wire_rejects_malformed(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        wire.decode(data)


def _frame_body(specs_raw: bytes, count: int, meta: bytes = b"") -> bytes:
    body = struct.pack("<QIHI", 1, 0, count, len(meta)) + specs_raw + meta
    return struct.pack("<HBBI", wire.MAGIC, 1, wire.FRAME, len(body)) + body


@pytest.mark.parametrize(
    "specs_raw, count, match",
    [
        (b"\x03|O8\x00", 1, "plain numeric"),
        (b"\x03<f0\x00", 1, "item size"),
        (b"\x03<x4\x00", 1, "plain numeric"),
        (b"\x02<f\x00", 1, "bad dtype"),
        (b"\x03<f4\x21" + b"\x00" * 8 * 33, 1, "dimensions"),
        (b"\x03<f4\x01" + struct.pack("<Q", 1 << 63), 1, "out of range"),
        (b"\x03<f4\x02" + b"\x00" * 8, 1, "truncated shape"),
        (b"\x03<f4\x00", 2, "truncated array spec"),
        (b"\x03\xff\xfe\xfd\x00", 1, "ASCII"),
    ],
)
def test_wire_rejects_bad_specs(specs_raw: bytes, count: int, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        wire.decode(_frame_body(specs_raw, count))


def test_wire_frame_metadata_length_must_match() -> None:
    ok = _frame_body(b"\x03<f4\x01" + struct.pack("<Q", 2), 1, b"")
    assert wire.decode(ok) == wire.FrameHeader(1, 0, (wire.ArraySpec("<f4", (2,)),), b"")
    body = struct.pack("<QIHI", 1, 0, 0, 5) + b"abc"
    raw = struct.pack("<HBBI", wire.MAGIC, 1, wire.FRAME, len(body)) + body
    with pytest.raises(ProtocolError, match="metadata"):
        wire.decode(raw)


def test_wire_encoders_check_ranges() -> None:
    with pytest.raises(ValueError):
        wire.encode_hello(b"short", 0, 1)
    with pytest.raises(ValueError):
        wire.encode_hello(bytes(32), 0, 0)
    with pytest.raises(ValueError):
        wire.encode_proof(bytes(32), b"")
    with pytest.raises(ValueError):
        wire.encode_frame(0, 0, (), b"x" * (wire.MAX_METADATA + 1))


def test_layout_aligns_and_checks_fit() -> None:
    specs = (wire.ArraySpec("|u1", (3,)), wire.ArraySpec("<f8", (4,)))
    assert wire.layout(specs, 1024) == [0, 256]
    with pytest.raises(ProtocolError, match="receive slot"):
        wire.layout(specs, 256 + 31)


def test_a_host_frame_payload_is_the_documented_bytes() -> None:
    """The engine's host frame payload (``cip_host_frame_encode``) against bytes packed here
    by hand from the documented layout: u16 count, u32 metadata length, per array a u8
    typestr length, the typestr, a u8 ndim and ndim u64 dimensions, then the metadata."""
    from cupy_ipcpool.remote import _host

    specs = (wire.ArraySpec("<f4", (480, 640)), wire.ArraySpec("<u8", (1,)))
    payload = _host.encode_payload(specs, b"meta")
    assert payload == (
        struct.pack("<HI", 2, 4)
        + b"\x03<f4\x02"
        + struct.pack("<2Q", 480, 640)
        + b"\x03<u8\x01"
        + struct.pack("<Q", 1)
        + b"meta"
    )
    # read back, placed in a slot: the second array at the first multiple of 256 after 1228800
    assert _host.decode_payload(payload, 480 * 640 * 4 + 264) == (specs, [0, 1228800], b"meta")
    assert _host.encode_payload((), b"") == struct.pack("<HI", 0, 0)


@pytest.mark.parametrize(
    ("specs", "metadata", "error", "match"),
    [
        ((wire.ArraySpec("|u1", (1,)),) * 65, b"", "UsageError", "at most 64 arrays"),
        ((), b"x" * 16385, "UsageError", "16384 metadata bytes"),
        ((wire.ArraySpec("|O8", (1,)),), b"", "ProtocolError", "plain numeric"),
        ((wire.ArraySpec("<f4", (-1,)),), b"", "ProtocolError", "out of range"),
        ((wire.ArraySpec("<f4", (1,) * 33),), b"", "ProtocolError", "33 dimensions"),
        ((wire.ArraySpec("<f4" + "4" * 20, (1,)),), b"", "ProtocolError", "bad dtype"),
    ],
)
def test_a_host_frame_that_cannot_be_sent_is_refused(
    specs: tuple[wire.ArraySpec, ...], metadata: bytes, error: str, match: str
) -> None:
    import cupy_ipcpool
    from cupy_ipcpool.remote import _host

    with pytest.raises(getattr(cupy_ipcpool, error), match=match):
        _host.encode_payload(specs, metadata)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\x01\x00\x00\x00\x00", "too short"),
        (struct.pack("<HI", 65, 0), "65 arrays"),
        (struct.pack("<HI", 0, 16385), "16385 metadata bytes"),
        (struct.pack("<HI", 1, 0) + b"\x03<f4", "truncated"),
        (struct.pack("<HI", 1, 2) + b"\x03<f4\x01" + struct.pack("<Q", 4) + b"m", "metadata"),
        (struct.pack("<HI", 0, 1) + b"mm", "metadata length does not match"),
        (struct.pack("<HI", 1, 0) + b"\x03<f8\x01" + struct.pack("<Q", 9), "need 72 bytes"),
    ],
)
def test_a_bad_host_frame_payload_is_a_protocol_error(payload: bytes, match: str) -> None:
    from cupy_ipcpool.remote import _host

    with pytest.raises(ProtocolError, match=match):
        _host.decode_payload(payload, 64)


def test_array_specs_survive_their_wire_form() -> None:
    """Every plain numeric spec comes back from its wire form as it was (the engine both
    ways), with the bytes used; hand-packed bytes above pin the form itself."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    typestrs = st.builds(
        lambda order, kind, size: f"{order}{kind}{size}",
        st.sampled_from("<>|"),
        st.sampled_from("biufc"),
        st.integers(1, 64),
    )
    shapes = st.lists(st.integers(0, (1 << 62) - 1), max_size=32).map(tuple)
    specs_st = st.lists(st.builds(wire.ArraySpec, typestrs, shapes), max_size=8)

    @settings(max_examples=200, deadline=None)
    @given(specs_st, st.binary(max_size=8))
    def roundtrip(specs: list[wire.ArraySpec], tail: bytes) -> None:
        data = wire.encode_specs(specs)
        assert wire.decode_specs(data + tail, len(specs)) == (tuple(specs), len(data))

    roundtrip()


def test_tags_and_addresses() -> None:
    assert wire.data_tag(0xABCD, 5, 2) == 0xABCD << 32 | 5 << 8 | 2
    assert wire.data_tag(1, 1 << 24, 0) == 1 << 32  # seq wraps in 24 bits
    assert wire.parse_address("ucx://10.0.0.1:1234") == ("10.0.0.1", 1234)
    assert wire.parse_address("ucx://[::1]:99") == ("::1", 99)
    for bad in (
        "tcp://x:1",
        "ucx://x:99999",
        "ucx://:5",
        "ucx://x:1/path",
        "node7",  # no scheme, no port: a server's address is written out
        "ucx://node7",
        "ucx://node7:0",
    ):
        with pytest.raises(ValueError):
            wire.parse_address(bad)
    assert wire.is_remote_address("ucx://h:1") and not wire.is_remote_address("/tmp/x.sock")


# -- pure: auth --------------------------------------------------------------------


def test_auth_proofs_bind_direction_and_transcript() -> None:
    k = b"k" * 32
    hello, nonce = b"hello", b"n" * 32
    s = auth.server_proof(k, hello, nonce)
    c = auth.client_proof(k, hello, nonce, b"")
    assert s != c and len(s) == 32
    assert auth.verify(s, auth.server_proof(k, hello, nonce))
    assert not auth.verify(s, auth.server_proof(b"x" * 32, hello, nonce))
    assert auth.client_proof(k, hello, b"c", b"a1") != auth.client_proof(k, hello, b"c", b"a2")
    assert auth.server_proof(None, hello, nonce) == bytes(32)
    assert auth.nonce() != auth.nonce()


def test_auth_secret_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    assert auth.secret_from(None) is None
    assert auth.secret_from(SECRET) == SECRET.encode()
    monkeypatch.setenv(auth.SECRET_ENV, SECRET)
    assert auth.secret_from(None) == SECRET.encode()
    with pytest.raises(ValueError, match="at least 16"):
        auth.secret_from("short")


# -- pure: credit ----------------------------------------------------------------


def test_serverbook_credit_latest_and_block() -> None:
    book = ServerBook()
    book.add_subscriber(1, "block", 2)
    book.add_subscriber(2, "latest", 2)
    assert book.offer(10) == []  # no credit: block queues, latest skips
    assert book.retained(10) and book.queued(1) == 1
    assert book.credit(1, 0) == (10, 0)  # the queued frame goes out at once
    assert book.credit(2, 1) is None
    assert book.offer(11) == [(2, 1)]  # 1 used its credit on frame 10: queues 11
    assert book.queued(1) == 1
    book2 = ServerBook()
    book2.add_subscriber(1, "block", 4)
    book2.add_subscriber(2, "latest", 4)
    book2.credit(1, 0)
    book2.credit(2, 3)
    assert sorted(book2.offer(5)) == [(1, 0), (2, 3)]
    assert not book2.sent(1, 5) and book2.sent(2, 5)  # free after both sends
    assert book2.offer(6) == []  # 1 queues it, 2 skips it
    assert book2.queued(1) == 1 and book2.retained(6)
    assert book2.remove_subscriber(1) == [6]  # the queue's frame is free again
    assert not book2.retained(6)


def test_serverbook_rejects_bad_credit_and_late_sends_release() -> None:
    book = ServerBook()
    book.add_subscriber(1, "latest", 2)
    with pytest.raises(ProtocolError, match="slot 2"):
        book.credit(1, 2)
    book.credit(1, 0)
    with pytest.raises(ProtocolError, match="twice"):
        book.credit(1, 0)
    assert book.offer(7) == [(1, 0)]
    assert book.remove_subscriber(1) == []  # the send is still in flight
    assert book.retained(7)
    assert book.sent(1, 7)  # it completes (or fails) later: the frame is free
    with pytest.raises(ValueError):
        book.add_subscriber(2, "fast", 1)


def test_clientbook_checks_the_server() -> None:
    book = ClientBook(3, next_seq=10)
    book.grant(0)
    with pytest.raises(ValueError):
        book.grant(0)
    with pytest.raises(ProtocolError, match="not granted"):
        book.frame(10, 1)
    with pytest.raises(ProtocolError, match="out of order"):
        book.frame(9, 0)
    book.frame(10, 0)
    assert book.receiving == {0: 10}
    assert book.received(0) == 10 and book.held == {0: 10}
    assert book.free() == [1, 2]
    book.release(0)
    with pytest.raises(ValueError):
        book.release(0)
    book.grant(1)
    with pytest.raises(ProtocolError, match="out of order"):
        book.frame(10, 1)


# -- end to end over UCX on 127.0.0.1 -------------------------------------------------


def _arrays(seq: int) -> tuple[np.ndarray, np.ndarray]:
    return np.full(N_BYTES, seq % 251, np.uint8), np.arange(N_FLOATS, dtype=np.float32) + seq


def check(frame: Any) -> int:
    """Every byte of a received frame is what the producer wrote; return the seq."""
    (seq,) = struct.unpack("<Q", frame.metadata)
    a, b = frame.arrays
    assert a.dtype == np.uint8 and a.shape == (N_BYTES,)
    assert b.dtype == np.float32 and b.shape == (N_FLOATS,)
    assert (a == seq % 251).all(), f"frame {seq}: bytes of another frame"
    assert (b == np.arange(N_FLOATS, dtype=np.float32) + seq).all()
    return seq


def publish(pub: Any, timeout: float = 5.0) -> int:
    seq = pub.core.next_seq
    got = pub.send(*_arrays(seq), metadata=struct.pack("<Q", seq), timeout=timeout)
    assert got == seq
    return seq


def producer(
    num_slots: int = 4, **kwargs: Any
) -> contextlib.AbstractContextManager[tuple[Any, Any]]:
    """A host channel (slots of 128 KiB) and its remote server, both in this process."""
    return served_host_channel(1 << 17, num_slots, **kwargs)


def drive(pub: Any, seconds: float) -> None:
    """Let the producer collect releases for a while."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pub.poll(0.01)


@needs_ucx
@pytest.mark.timeout(60)
def test_handshake_secret_and_every_byte() -> None:
    with producer() as (pub, server):
        assert server.address.startswith("ucx://127.0.0.1:")
        assert server.ucx_config.get("NET_DEVICES") == "lo"  # loopback: UCX stays on lo
        with remote_sub(server.address, slots=3) as sub:
            wait_for(lambda: server.subscribers)
            info = server.subscribers[0]
            assert info.mode == "block" and info.num_slots == 3
            sent, got = [], []
            for i in range(40):
                sent.append(publish(pub))
                if i % 2:  # two frames in flight at a time
                    for _ in range(2):
                        with sub.recv(timeout=10) as frame:
                            got.append(check(frame))
                            assert frame.seq == got[-1]
            assert got == sent  # block: every frame, in order
            assert sub.held == {}
        wait_for(lambda: not server.subscribers)
        assert "BYE" in server.last_leave_reason


@needs_ucx
@pytest.mark.timeout(60)
def test_wrong_or_missing_secret_refused() -> None:
    from cupy_ipcpool.remote import AuthenticationError, RemoteServer

    with producer() as (pub, server):
        with pytest.raises(AuthenticationError, match="does not know the shared secret"):
            remote_sub(server.address, secret="wrong horse battery staple 42")
        with pytest.raises(AuthenticationError, match="requires a shared secret"):
            remote_sub(server.address, secret=None, insecure=True)
        with pytest.raises(ValueError, match="shared secret"):
            remote_sub(server.address, secret=None)
        assert issubclass(AuthenticationError, IpcPoolError)
        assert issubclass(AuthenticationError, PeerRefusedError)
        # a raw client that answers the challenge with a wrong proof is refused by the server
        host, port = wire.parse_address(server.address)
        with socket.create_connection((host, port), timeout=5) as s:
            hello = wire.encode_hello(auth.nonce(), 0, 2)
            s.sendall(hello)
            msg, _ = _read(s)
            assert isinstance(msg, wire.Challenge) and msg.auth
            s.sendall(wire.encode_proof(bytes(32), b"x" * 10))
            msg, _ = _read(s)
            assert isinstance(msg, wire.Refuse) and "wrong secret" in msg.reason
        # the server still serves a subscriber with the right secret
        with remote_sub(server.address) as sub:
            wait_for(lambda: server.subscribers)
            seq = publish(pub)
            with sub.recv(timeout=10) as f:
                assert check(f) == seq
    with pytest.raises(ValueError, match="shared secret"):
        RemoteServer(object(), listen="127.0.0.1:0")  # type: ignore[arg-type]
    with producer(secret=None, insecure=True) as (_pub, server):
        with pytest.raises(AuthenticationError, match="does not prove"):
            remote_sub(server.address)  # a subscriber with a secret refuses an open server
        remote_sub(server.address, secret=None, insecure=True).close()


def _read(s: socket.socket) -> tuple[wire.Message, bytes]:
    from cupy_ipcpool.remote import _io

    return _io.recv_message(s, time.monotonic() + 5)


@needs_ucx
@pytest.mark.timeout(60)
def test_bad_clients_cannot_block_or_break_the_server() -> None:
    with producer() as (pub, server):
        host, port = wire.parse_address(server.address)
        silent = socket.create_connection((host, port), timeout=5)  # says nothing
        garbage = socket.create_connection((host, port), timeout=5)
        garbage.sendall(b"GET / HTTP/1.1\r\n\r\n" * 10)
        oversized = socket.create_connection((host, port), timeout=5)
        oversized.sendall(struct.pack("<HBBI", wire.MAGIC, 1, wire.HELLO, 1 << 30))
        t0 = time.monotonic()
        with remote_sub(server.address) as sub:  # joins while the silent one waits
            assert time.monotonic() - t0 < 3.0
            wait_for(lambda: server.subscribers)
            seq = publish(pub)
            with sub.recv(timeout=10) as f:
                assert check(f) == seq
        for s in (garbage, oversized):
            msg, _ = _read(s)
            assert isinstance(msg, wire.Refuse) and "handshake failed" in msg.reason
            s.close()
        silent.close()


@needs_ucx
@pytest.mark.timeout(60)
def test_latest_skips_for_the_slow_one_only() -> None:
    with (
        producer(num_slots=6) as (pub, server),
        remote_sub(server.address, slots=2) as fast,
        remote_sub(server.address, mode="latest", slots=1) as slow,
    ):
        wait_for(lambda: len(server.subscribers) == 2)
        fast_seen: list[int] = []

        def next_frame() -> int:
            newest = publish(pub)
            with fast.recv(timeout=10) as f:
                fast_seen.append(check(f))
            return newest

        # the "latest" one skips frames until its first CREDIT reached the server (it is
        # sent after the handshake): publish until it has one
        held = None
        deadline = time.monotonic() + 10
        while held is None and time.monotonic() < deadline:
            next_frame()
            with contextlib.suppress(TimeoutError):
                held = slow.recv(timeout=0.2)
        assert held is not None
        check(held)
        for _ in range(30):
            next_frame()
        assert fast_seen == list(range(len(fast_seen)))  # the block one misses nothing
        with pytest.raises(TimeoutError):
            slow.recv(timeout=0.2)  # holding its only slot: it was sent none of them
        held.release()  # credit back: the next frame it gets is the newest one
        got = None
        deadline = time.monotonic() + 10
        while got is None and time.monotonic() < deadline:
            newest = publish(pub)
            with fast.recv(timeout=10) as f:
                assert check(f) == newest
            with contextlib.suppress(TimeoutError), slow.recv(timeout=0.2) as f:
                got = check(f)
        assert got == newest


@needs_ucx
@pytest.mark.timeout(60)
def test_block_backpressure_reaches_the_producer() -> None:
    with producer(num_slots=4) as (pub, server), remote_sub(server.address, slots=2) as sub:
        wait_for(lambda: server.subscribers)
        published = []
        with pytest.raises(SlotBusyError):
            for _ in range(20):
                published.append(publish(pub, timeout=0.5))
        # 2 frames held by the subscriber, 4 slots retained by the bridge for it
        assert 4 <= len(published) <= 8
        got = []
        while len(got) < len(published):
            with sub.recv(timeout=10) as f:
                got.append(check(f))
            pub.poll(0.0)
        assert got == published  # nothing lost while the producer waited
        publish(pub, timeout=5)  # and it goes on


def child_subscriber(conn: Connection, address: str, count: int) -> None:
    """Receive ``count`` frames, hold them all, report, then wait to be killed."""
    try:
        sub = remote_sub(address, slots=count)
        held = [sub.recv(timeout=20) for _ in range(count)]
        conn.send(("ok", [check(f) for f in held]))
        time.sleep(60)
    except BaseException as exc:
        conn.send(("err", type(exc).__name__, str(exc)))


@needs_ucx
@pytest.mark.timeout(90)
def test_subscriber_killed_mid_stream_gives_leases_back() -> None:
    with producer(num_slots=4) as (pub, server):
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=child_subscriber, args=(child, server.address, 2))
        proc.start()
        try:
            wait_for(lambda: server.subscribers, timeout=30)
            for _ in range(4):  # 2 to the child's slots, 2 queued in the bridge for it
                publish(pub)
            assert parent.poll(30)
            reply = parent.recv()
            assert reply[0] == "ok", reply
            assert reply[1] == [0, 1]
            wait_for(lambda: any(pub.leases(s) for s in range(4)))
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            wait_for(lambda: not server.subscribers, timeout=15)
            assert server.last_leave_reason
            # every producer slot comes back; the producer goes on alone
            wait_for(lambda: not any(pub.leases(s) for s in range(4)), poll=lambda: pub.poll(0))
            for _ in range(8):
                publish(pub, timeout=5)
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


def child_producer(conn: Connection, port_path: str) -> None:
    """Serve a host channel, report the address, publish until killed."""
    try:
        with producer(num_slots=4) as (pub, server):
            conn.send(("ok", server.address))
            wait_for(lambda: server.subscribers, timeout=30)
            while True:
                with contextlib.suppress(SlotBusyError):
                    publish(pub, timeout=0.2)
                time.sleep(0.002)
    except BaseException as exc:
        conn.send(("err", type(exc).__name__, str(exc)))


@needs_ucx
@pytest.mark.timeout(90)
def test_producer_killed_mid_stream_frames_stay_readable() -> None:
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=child_producer, args=(child, ""))
    proc.start()
    try:
        assert parent.poll(30)
        reply = parent.recv()
        assert reply[0] == "ok", reply
        with remote_sub(reply[1], slots=3) as sub:
            kept = sub.recv(timeout=20)
            kept_seq = check(kept)
            for _ in range(5):
                with sub.recv(timeout=20) as f:
                    check(f)
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            with pytest.raises(EndOfStream) as info:
                while True:
                    with sub.recv(timeout=20) as f:
                        check(f)
            assert not info.value.clean
            assert check(kept) == kept_seq  # still readable, still intact
            kept.release()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)


@needs_ucx
@pytest.mark.timeout(60)
def test_clean_close_ends_iteration() -> None:
    with producer() as (pub, server):
        sub = remote_sub(server.address)
        wait_for(lambda: server.subscribers)
        for _ in range(3):
            publish(pub)
        seen = []
        deadline = time.monotonic() + 10
        while len(seen) < 3 and time.monotonic() < deadline:
            with sub.recv(timeout=10) as f:
                seen.append(check(f))
        server.close()
        assert list(sub) == []  # a clean BYE ends the iteration
        with pytest.raises(EndOfStream) as info:
            sub.recv(timeout=1)
        assert info.value.clean
        sub.close()
        sub.close()


@needs_ucx
@pytest.mark.timeout(90)
def test_relay_feeds_two_local_subscribers() -> None:
    from cupy_ipcpool.remote import HostChannelSubscriber, Relay

    with producer(num_slots=4) as (pub, server), tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "relay.sock")
        with Relay(server.address, local, secret=SECRET, memory="host", slots=4) as relay:
            wait_for(lambda: server.subscribers)
            a = HostChannelSubscriber(local)
            b = HostChannelSubscriber(local)
            try:
                wait_for(lambda: len(relay.subscribers) == 2)
                n = 12
                seen_a: list[int] = []
                seen_b: list[int] = []
                sent = 0
                deadline = time.monotonic() + 30
                while (len(seen_a) < n or len(seen_b) < n) and time.monotonic() < deadline:
                    if sent < n:
                        with contextlib.suppress(SlotBusyError):
                            publish(pub, timeout=0.05)
                            sent += 1
                    for sub, seen in ((a, seen_a), (b, seen_b)):
                        with contextlib.suppress(TimeoutError), sub.recv(timeout=0.01) as f:
                            seen.append(check(f))
                assert seen_a == list(range(n)) and seen_b == list(range(n))
                # the relay thread counts a frame after publishing it: the subscribers
                # may see the last frame a moment before the count moves
                wait_for(lambda: relay.relayed == n, timeout=5.0)
                assert len(server.subscribers) == 1  # one network stream for two readers
            finally:
                a.close()
                b.close()


def test_import_needs_no_ucxx() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['ucxx'] = None\n"
        "import cupy_ipcpool, cupy_ipcpool.remote as r\n"
        "assert r.available() is not None\n"
        "try:\n"
        "    r.subscribe('ucx://127.0.0.1:1', secret='x'*16, memory='host')\n"
        "except r.RemoteUnavailableError as e:\n"
        "    assert \"-e '.[remote-cu13]' (CUDA 13) or -e '.[remote-cu12]'\" in str(e)\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@needs_ucx
@pytest.mark.timeout(90)
def test_relay_command_line() -> None:
    import subprocess
    import sys

    from cupy_ipcpool.remote import HostChannelSubscriber

    with producer() as (pub, server), tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "relay.sock")
        env = {**os.environ, auth.SECRET_ENV: SECRET}
        cmd = [sys.executable, "-m", "cupy_ipcpool", "relay", server.address, local]
        proc = subprocess.Popen([*cmd, "--memory", "host"], env=env, stdout=subprocess.PIPE)
        try:
            wait_for(lambda: os.path.exists(local), timeout=30)
            with HostChannelSubscriber(local) as reader:
                seen: list[int] = []
                deadline = time.monotonic() + 30
                while len(seen) < 3 and time.monotonic() < deadline:
                    if server.subscribers:
                        with contextlib.suppress(SlotBusyError):
                            publish(pub, timeout=0.05)
                    with contextlib.suppress(TimeoutError), reader.recv(timeout=0.05) as f:
                        seen.append(check(f))
                assert len(seen) >= 3 and seen == sorted(seen)
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=30)
            assert proc.returncode == 0, out
            assert b"relayed" in out
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
