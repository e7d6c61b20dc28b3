"""The channel's compiled per-frame socket calls (``cupy_ipcpool._engine``, ``c/python/frameio.c``).

Real ``SOCK_SEQPACKET`` socket pairs, pipes as watched fds, threads as the
other end.  The stream memory operation that ``release_frame`` makes is a
ctypes C-callable that records its arguments (as in
``tests/test_fastpath_cpu.py``); on the GPU machine it is the driver's
``cuStreamWriteValue32`` (``tests/test_channel_gpu.py``).
"""

from __future__ import annotations

import os
import resource
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from _gil import assert_gil_released
from _memop_recorder import MemopRecorder as _Recorder
from hypothesis import given, settings
from hypothesis import strategies as st

from cupy_ipcpool._engine import PROTOCOL, pollfds, recv_frame, release_frame
from cupy_ipcpool._errors import ProtocolError
from cupy_ipcpool.channel import _protocol as proto

_HEAD = 20  # the FRAME header: "<HBBQII"
_BUF = proto.MAX_FRAME_SIZE + 1


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    yield r, w
    os.close(r)
    os.close(w)


def _hup(sock: socket.socket, *watched: int) -> bytes:
    return pollfds([(sock.fileno(), select.POLLRDHUP), *((fd, select.POLLIN) for fd in watched)])


def _later(delay: float, fn: object) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        fn()  # type: ignore[operator]

    t = threading.Thread(target=run)
    t.start()
    return t


def test_the_compiled_protocol_is_the_protocol() -> None:
    assert PROTOCOL == (
        proto.MAGIC,
        proto.VERSION,
        proto.FRAME,
        proto.RELEASE,
        _HEAD,
        proto.MAX_RELEASE_SIZE,
        proto.MAX_FRAME_PAYLOAD,
    )


def test_a_queued_frame_comes_back_decoded_without_waiting(pair: tuple) -> None:
    a, b = pair
    buf = bytearray(_BUF)
    b.send(proto.encode_frame(2**63 + 5, 7, b"payload"))
    n, seq, slot, waited = recv_frame(a.fileno(), buf, 1000, False, _hup(a))
    assert (seq, slot, waited) == (2**63 + 5, 7, False)
    assert bytes(buf[_HEAD:n]) == b"payload"


def test_no_wait_allowed_still_takes_a_queued_frame(pair: tuple) -> None:
    """``poll_first`` (the last call waited) must not skip the only look a timeout of 0 has."""
    a, b = pair
    b.send(proto.encode_frame(6, 2))
    got = recv_frame(a.fileno(), bytearray(_BUF), 0, True, _hup(a))
    assert got is not None and got[1:] == (6, 2, False)


def test_a_frame_sent_during_the_wait_wakes_it(pair: tuple) -> None:
    a, b = pair
    buf = bytearray(_BUF)
    t = _later(0.05, lambda: b.send(proto.encode_frame(3, 1)))
    try:
        n, seq, slot, waited = recv_frame(a.fileno(), buf, 5000, True, _hup(a))
    finally:
        t.join()
    assert (n, seq, slot, waited) == (_HEAD, 3, 1, True)


@pytest.mark.parametrize("timeout_ms", [-1, 2**31, 2**62])
def test_a_timeout_too_long_for_one_poll_still_waits(pair: tuple, timeout_ms: int) -> None:
    """Without limit, or longer than poll(2) takes (or than the clock can add): a real wait."""
    a, b = pair
    t = _later(0.05, lambda: b.send(proto.encode_frame(8, 0)))
    try:
        got = recv_frame(a.fileno(), bytearray(_BUF), timeout_ms, True, _hup(a))
    finally:
        t.join()
    assert got is not None and got[1:3] == (8, 0)


@pytest.mark.parametrize("timeout_ms", [0, 30])
def test_nothing_within_the_timeout_answers_none(pair: tuple, timeout_ms: int) -> None:
    a, _b = pair
    start = time.monotonic()
    assert recv_frame(a.fileno(), bytearray(_BUF), timeout_ms, False, _hup(a)) is None
    took = time.monotonic() - start
    assert took >= timeout_ms / 1000 * 0.9
    if timeout_ms == 0:
        assert took < 0.5


def test_other_messages_and_the_end_are_left_to_the_caller(pair: tuple) -> None:
    a, b = pair
    buf = bytearray(_BUF)
    b.send(proto.encode_bye())
    n, seq, _slot, _w = recv_frame(a.fileno(), buf, 1000, False, _hup(a))
    assert seq == -1 and bytes(buf[:n]) == proto.encode_bye()
    b.close()
    assert recv_frame(a.fileno(), buf, 1000, True, _hup(a))[:2] == (0, -1)


def test_a_failed_receive_raises_its_oserror() -> None:
    # SOCK_STREAM, not SEQPACKET: a peer that closes with our data unread resets us
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        a.send(b"x")
        b.close()
        with pytest.raises(ConnectionResetError):
            recv_frame(a.fileno(), bytearray(64), 0, False, pollfds([]))
    finally:
        a.close()
    r, w = os.pipe()
    os.close(w)
    os.close(r)
    with pytest.raises(OSError):  # EBADF: the fd is closed
        recv_frame(r, bytearray(64), 0, False, pollfds([]))


@pytest.mark.parametrize("when", ["queued", "during the wait"])
def test_a_watched_fd_that_fired_hands_the_frame_to_the_caller(
    pair: tuple, pipe: tuple[int, int], when: str
) -> None:
    """The frame is not taken as usable: the caller decodes it and looks at what fired."""
    a, b = pair
    r, w = pipe
    os.write(w, b"!")
    msg = proto.encode_frame(9, 2, b"x")
    buf = bytearray(_BUF)
    if when == "queued":
        b.send(msg)
        got = recv_frame(a.fileno(), buf, 1000, False, _hup(a, r))
    else:
        t = _later(0.05, lambda: b.send(msg))
        try:
            got = recv_frame(a.fileno(), buf, 5000, True, _hup(a, r))
        finally:
            t.join()
    n, seq, _slot, _w = got
    assert seq == -1 and bytes(buf[:n]) == msg


def test_the_peers_hang_up_hands_a_queued_frame_to_the_caller(pair: tuple) -> None:
    a, b = pair
    msg = proto.encode_frame(4, 0)
    b.send(msg)
    b.shutdown(socket.SHUT_WR)
    buf = bytearray(_BUF)
    n, seq, _slot, _w = recv_frame(a.fileno(), buf, 1000, True, _hup(a))
    assert seq == -1 and bytes(buf[:n]) == msg


def test_a_fired_watched_fd_does_not_turn_the_wait_into_a_spin(
    pair: tuple, pipe: tuple[int, int]
) -> None:
    """A pidfd stays readable once its process exited: the wait must still sleep."""
    a, _b = pair
    r, w = pipe
    os.write(w, b"!")
    before = resource.getrusage(resource.RUSAGE_THREAD)
    start = time.monotonic()
    assert recv_frame(a.fileno(), bytearray(_BUF), 300, True, _hup(a, r)) is None
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_THREAD)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert wall >= 0.27
    assert cpu < 0.1 * wall


def test_other_threads_run_while_it_waits(pair: tuple) -> None:
    a, b = pair
    got = assert_gil_released(
        lambda: recv_frame(a.fileno(), bytearray(_BUF), 30_000, True, _hup(a)),
        ("poll", "ppoll"),
        wake=lambda: b.send(proto.encode_frame(3, 1, b"woken")),
    )
    assert got is not None and got[1:3] == (3, 1)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=64),
        st.builds(
            proto.encode_frame,
            st.integers(0, 2**64 - 1),
            st.integers(0, 2**32 - 1),
            st.binary(max_size=300),
        ),
        st.tuples(
            st.builds(
                proto.encode_frame, st.integers(0, 9), st.integers(0, 9), st.binary(max_size=40)
            ),
            st.integers(0, 39),
            st.integers(0, 255),
        ).map(lambda t: t[0][: t[1] % len(t[0])] + bytes([t[2]]) + t[0][t[1] % len(t[0]) + 1 :]),
        st.builds(proto.encode_release, st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1)),
    )
)
def test_it_takes_exactly_what_decode_reads_as_a_frame(data: bytes) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        if not data:
            return  # an empty datagram reads as the end
        b.send(data)
        buf = bytearray(_BUF)
        n, seq, slot, _w = recv_frame(a.fileno(), buf, 1000, False, _hup(a))
        assert bytes(buf[:n]) == data
        try:
            msg = proto.decode(data)
        except ProtocolError:
            msg = None
        if type(msg) is proto.Frame:
            assert (seq, slot, bytes(buf[_HEAD:n])) == (msg.seq, msg.slot, msg.payload)
        else:
            assert seq == -1
    finally:
        a.close()
        b.close()


def test_an_oversize_datagram_is_not_a_frame(pair: tuple) -> None:
    a, b = pair
    b.send(proto.encode_frame(1, 1, bytes(proto.MAX_FRAME_PAYLOAD)) + b"extra")
    buf = bytearray(_BUF)
    n, seq, _slot, _w = recv_frame(a.fileno(), buf, 1000, False, _hup(a))
    assert n == _BUF and seq == -1


def test_recv_frame_refuses_bad_arguments(pair: tuple) -> None:
    a, _b = pair
    fd = a.fileno()
    with pytest.raises(TypeError):
        recv_frame(fd, bytes(64), 0, False, _hup(a))
    with pytest.raises(TypeError):
        recv_frame(fd, bytearray(64), 0, False, [fd])
    with pytest.raises(ValueError):
        recv_frame(fd, bytearray(64), 0, False, b"\x00" * 5)
    with pytest.raises(ValueError):
        recv_frame(-1, bytearray(64), 0, False, _hup(a))
    with pytest.raises(ValueError):
        recv_frame(fd, bytearray(64), -2, False, _hup(a))
    with pytest.raises(TypeError):
        recv_frame(fd, bytearray(64), 0, False)  # type: ignore[call-arg]


def test_pollfds_packs_pairs_and_refuses_bad_ones() -> None:
    assert len(pollfds([(0, select.POLLIN), (5, select.POLLRDHUP)])) == 2 * len(pollfds([(0, 1)]))
    assert pollfds([]) == b""
    with pytest.raises(ValueError):  # a hang-up set holds at most 16
        pollfds([(i, 1) for i in range(17)])
    seventeen = bytes(17 * len(pollfds([(0, 1)])))
    with pytest.raises(ValueError):
        recv_frame(0, bytearray(64), 0, False, seventeen)
    with pytest.raises(ValueError):
        pollfds([(-1, 1)])
    with pytest.raises(TypeError):
        pollfds([(1,)])
    with pytest.raises(TypeError):
        pollfds(5)


# -- release_frame -------------------------------------------------------------------


def test_release_writes_then_sends_the_release(pair: tuple) -> None:
    a, b = pair
    rec = _Recorder()
    rc = release_frame(
        a.fileno(),
        _hup(a),
        rec.address,
        0x7F00_0000_1000,
        0x2000,
        2**32 + 9,
        1,
        2**64 - 1,
        2**32 - 1,
    )
    assert rc == 0
    assert rec.calls == [(0x7F00_0000_1000, 0x2000, 9, 1)]
    assert b.recv(64, socket.MSG_DONTWAIT) == proto.encode_release(2**64 - 1, 2**32 - 1)


def test_release_after_a_hang_up_does_nothing(pair: tuple, pipe: tuple[int, int]) -> None:
    a, b = pair
    r, w = pipe
    rec = _Recorder()
    os.write(w, b"!")  # a watched fd (the producer's pidfd) fired
    assert release_frame(a.fileno(), _hup(a, r), rec.address, 1, 16, 1, 0, 5, 0) == -1
    b.shutdown(socket.SHUT_WR)  # the publisher hung up
    assert release_frame(a.fileno(), _hup(a), rec.address, 1, 16, 1, 0, 5, 0) == -1
    assert rec.calls == []
    with pytest.raises(BlockingIOError):
        b.recv(64, socket.MSG_DONTWAIT)


def test_a_driver_error_is_returned_and_nothing_sent(pair: tuple) -> None:
    a, b = pair
    rec = _Recorder(result=700)
    assert release_frame(a.fileno(), _hup(a), rec.address, 1, 16, 3, 0, 5, 0) == 700
    assert len(rec.calls) == 1
    with pytest.raises(BlockingIOError):
        b.recv(64, socket.MSG_DONTWAIT)


def test_a_full_socket_raises_after_the_write(pair: tuple) -> None:
    a, _b = pair
    a.setblocking(False)
    with pytest.raises(BlockingIOError):
        while True:
            a.send(b"x" * 1024)
    rec = _Recorder()
    with pytest.raises(BlockingIOError):
        release_frame(a.fileno(), _hup(a), rec.address, 1, 16, 3, 0, 5, 0)
    assert len(rec.calls) == 1


def test_release_without_a_socket_writes_and_sends_nothing(pair: tuple) -> None:
    """fd -1: the subscriber owes RELEASEs the socket did not take; this one waits behind."""
    a, b = pair
    rec = _Recorder()
    assert release_frame(-1, _hup(a), rec.address, 1, 16, 3, 0, 5, 0) == 0
    assert rec.calls == [(1, 16, 3, 0)]
    with pytest.raises(BlockingIOError):
        b.recv(64, socket.MSG_DONTWAIT)
    with pytest.raises(ValueError):
        release_frame(-2, _hup(a), rec.address, 1, 16, 3, 0, 5, 0)


def test_release_refuses_bad_arguments(pair: tuple) -> None:
    a, _b = pair
    rec = _Recorder()
    fd, hup = a.fileno(), _hup(a)
    with pytest.raises(OverflowError):
        release_frame(fd, hup, rec.address, 1, 16, 3, 0, 5, 2**32)
    with pytest.raises(OverflowError):
        release_frame(fd, hup, rec.address, 1, 16, 3, 0, -1, 0)
    with pytest.raises(ValueError):
        release_frame(fd, hup, 0, 1, 16, 3, 0, 5, 0)
    with pytest.raises(TypeError):
        release_frame(fd, hup, rec.address, 1, 16, "3", 0, 5, 0)
    with pytest.raises(TypeError):
        release_frame(fd, hup, rec.address, 1, 16, 3, 0, 5)  # type: ignore[call-arg]
    assert rec.calls == []


# -- loading: the session layer takes the extension only as built for its protocol -------


def _unloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    from cupy_ipcpool.channel import _sockets

    for name in ("pollfds", "recv_frame", "release_frame"):
        monkeypatch.delattr(_sockets, name, raising=False)


def test_a_build_for_another_protocol_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from cupy_ipcpool import _engine
    from cupy_ipcpool.channel import _sockets

    _unloaded(monkeypatch)
    monkeypatch.setattr(_engine, "PROTOCOL", (*PROTOCOL[:1], PROTOCOL[1] + 1, *PROTOCOL[2:]))
    with pytest.raises(ImportError, match="rebuild it"):
        _sockets._load_frameio()
    assert not hasattr(_sockets, "recv_frame")


def test_a_missing_build_is_reported_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import cupy_ipcpool
    from cupy_ipcpool import _info
    from cupy_ipcpool.channel import _sockets

    _unloaded(monkeypatch)
    monkeypatch.delattr(cupy_ipcpool, "_engine")
    monkeypatch.setitem(sys.modules, "cupy_ipcpool._engine", None)
    with pytest.raises(ImportError, match="is not built"):
        _sockets._load_frameio()
    assert "NOT BUILT (_engine)" in _info.fastpath_summary()
