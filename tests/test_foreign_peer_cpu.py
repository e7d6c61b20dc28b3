"""CPU tier: subscribing to a socket that is no cupy_ipcpool publisher says so (issue 45).

Real foreign servers on Unix sockets, which answer the HELLO in another
protocol (HTTP-ish bytes), or are sockets of another type: the subscriber
names the path and says the peer is not a cupy_ipcpool publisher, instead
of a bare "bad magic 0x213c".  The remote tier's decoding says the same of
a peer that does not speak its protocol.
"""

from __future__ import annotations

import errno
import pickle
import socket
import struct
import threading
import time
from typing import Any

import pytest

import cupy_ipcpool as cip
from cupy_ipcpool._errors import ForeignPeerError
from cupy_ipcpool.channel import _protocol as proto
from cupy_ipcpool.channel._subscriber_core import SubscriberCore
from cupy_ipcpool.remote import HostChannelSubscriber
from cupy_ipcpool.remote import _wire as wire
from tests._foreign import HTTP, foreign_server


def _subscribers() -> list[Any]:
    """Every way to subscribe that runs here: the session core, the host tier, and the
    GPU subscriber where CuPy imports (its handshake comes before any GPU is used)."""
    out: list[Any] = [
        lambda path: SubscriberCore(path, timeout=5.0),
        lambda path: HostChannelSubscriber(path, timeout=5.0),
    ]
    try:
        import cupy  # noqa: F401
    except Exception:
        return out
    out.append(lambda path: cip.subscribe(path, timeout=5.0))
    return out


SUBSCRIBERS = _subscribers()
SUBSCRIBER_IDS = ["core", "host", "gpu"][: len(SUBSCRIBERS)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("subscribe", SUBSCRIBERS, ids=SUBSCRIBER_IDS)
def test_a_server_of_another_protocol_is_named_as_no_publisher(tmp_path: Any, subscribe) -> None:
    path = str(tmp_path / "web.sock")
    with (
        foreign_server(path, socket.SOCK_SEQPACKET) as heard,
        pytest.raises(cip.ProtocolError) as raised,
    ):
        subscribe(path)
    text = str(raised.value)
    assert text.startswith(f"{path} is not a cupy_ipcpool publisher: it answered b'HTTP/1.1 "), text
    # the magic last, as the C library words it (tests/test_scenarios_cpu.py)
    assert text.endswith("not the channel protocol's messages (bad magic 0x5448, expected 0x4950)")
    assert len(text) < 240, text  # what it answered is cut short
    assert isinstance(raised.value, ForeignPeerError)
    assert heard and isinstance(proto.decode(heard[0]), proto.Hello)  # it was sent our HELLO
    again = pickle.loads(pickle.dumps(raised.value))  # errors pickle
    assert type(again) is type(raised.value) and str(again) == text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("subscribe", SUBSCRIBERS, ids=SUBSCRIBER_IDS)
@pytest.mark.parametrize("kind", [socket.SOCK_STREAM, socket.SOCK_DGRAM], ids=["stream", "dgram"])
def test_a_socket_of_another_type_is_named_as_no_publisher(
    tmp_path: Any, subscribe, kind: int
) -> None:
    path = str(tmp_path / "other.sock")
    other = socket.socket(socket.AF_UNIX, kind)
    other.bind(path)
    if kind == socket.SOCK_STREAM:
        other.listen(1)
    with other, pytest.raises(cip.TransportError) as raised:
        subscribe(path)
    assert raised.value.errno == errno.EPROTOTYPE
    text = str(raised.value)
    assert f"{path} is not a cupy_ipcpool publisher: its socket is of another type" in text, text
    assert "SOCK_SEQPACKET" in text


@pytest.mark.timeout(60)
def test_an_answer_with_our_magic_that_does_not_add_up_is_a_protocol_error(tmp_path: Any) -> None:
    """A peer that speaks the channel protocol badly is not called foreign."""
    path = str(tmp_path / "bad.sock")
    bad_version = struct.pack("<HBB", proto.MAGIC, proto.VERSION + 1, proto.WELCOME)
    with (
        foreign_server(path, socket.SOCK_SEQPACKET, bad_version),
        pytest.raises(cip.ProtocolError, match="unsupported protocol version") as raised,
    ):
        SubscriberCore(path, timeout=5.0)
    assert not isinstance(raised.value, ForeignPeerError)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("reply", "magic"), [(b"I", "none"), (b"<!DOCTYPE", "0x213c")])
def test_a_reply_without_our_magic_is_foreign(tmp_path: Any, reply: bytes, magic: str) -> None:
    path = str(tmp_path / "short.sock")
    with (
        foreign_server(path, socket.SOCK_SEQPACKET, reply),
        pytest.raises(ForeignPeerError, match=f"bad magic {magic}, expected 0x4950") as raised,
    ):
        SubscriberCore(path, timeout=5.0)
    assert f"it answered {reply!r}, not" in str(raised.value)


def test_the_channel_decoder_says_the_peer_speaks_another_protocol() -> None:
    with pytest.raises(cip.ProtocolError) as raised:
        proto.decode(b"<!DOCTYPE html>")
    text = str(raised.value)
    assert "bad magic 0x213c (expected 0x4950)" in text, text
    assert "does not speak the cupy_ipcpool channel protocol" in text, text


def test_the_remote_decoder_says_the_peer_speaks_another_protocol() -> None:
    for decode in (wire.decode_header, wire.decode):
        with pytest.raises(cip.ProtocolError) as raised:
            decode(b"HTTP/1.1")
        text = str(raised.value)
        assert "bad magic 0x5448 (expected 0x4952)" in text, text
        assert "does not speak cupy_ipcpool's remote protocol" in text, text


@pytest.mark.timeout(60)
def test_a_remote_subscriber_names_a_tcp_server_of_another_protocol() -> None:
    """The remote tier's handshake over a real TCP server that answers HTTP."""
    from cupy_ipcpool import remote

    if remote.available() is not None:
        pytest.skip(f"UCXX is not usable here: {remote.available()}")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]

        def answer() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(1 << 16)
                conn.sendall(HTTP)
                time.sleep(0.5)

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        address = f"ucx://127.0.0.1:{port}"
        with pytest.raises(cip.ProtocolError) as raised:
            remote.subscribe(address, insecure=True, memory="host", timeout=5.0)
        thread.join(5)
    text = str(raised.value)
    assert text.startswith(f"{address} is not a cupy_ipcpool server: it answered b'HTTP/1.1"), text
    assert "magic" not in text, text
    assert isinstance(raised.value, ForeignPeerError)
