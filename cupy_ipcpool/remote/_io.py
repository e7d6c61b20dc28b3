"""Control-socket plumbing: whole messages over a TCP stream, with deadlines and limits."""

from __future__ import annotations

import contextlib
import socket
import time

from .._errors import ChannelTimeoutError, EndOfStream, ForeignPeerError, ProtocolError
from . import _wire as wire


def configure(sock: socket.socket) -> None:
    """Low latency (no Nagle) and keepalive on a control socket."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    chunks = []
    while n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ChannelTimeoutError("the peer did not answer in time")
        sock.settimeout(remaining)
        data = sock.recv(n)
        if not data:
            raise EndOfStream("the peer closed the connection", False)
        chunks.append(data)
        n -= len(data)
    return b"".join(chunks)


def recv_message(
    sock: socket.socket, deadline: float, *, foreign: str | None = None
) -> tuple[wire.Message, bytes]:
    """Read one whole message before ``deadline`` (monotonic); return it and its raw bytes.

    Parameters
    ----------
    foreign:
        What to say when the message does not begin with the protocol's magic
        (the peer speaks something else: the first message of a handshake),
        followed by the bytes it sent; None: the plain malformed-header error.

    Raises
    ------
    ProtocolError
        Malformed (checked before the body is read: no oversized allocations).
    EndOfStream
        The peer closed.
    TimeoutError
        Not complete in time.
    """
    head = _recv_exact(sock, wire.HEADER.size, deadline)
    if foreign is not None and not wire.has_magic(head):
        raise ForeignPeerError(f"{foreign}: it answered {head!r}, not this protocol's messages")
    kind, length = wire.decode_header(head)
    body = _recv_exact(sock, length, deadline) if length else b""
    return wire.decode_body(kind, body), head + body


def send_all(sock: socket.socket, data: bytes, timeout: float) -> None:
    """Send all of ``data`` within ``timeout`` seconds (TimeoutError / OSError otherwise)."""
    sock.settimeout(timeout)
    sock.sendall(data)


class MessageReader:
    """Split a non-blocking byte stream into checked messages."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, sock: socket.socket) -> tuple[list[wire.Message], bool]:
        """Read what is available; return ``(messages, eof)``.

        Raises
        ------
        ProtocolError
            A malformed message (the caller drops the connection).
        """
        eof = False
        while True:
            try:
                data = sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                eof = True
                break
            if not data:
                eof = True
                break
            self._buf += data
            if len(self._buf) > 4 * wire.MAX_MESSAGE:
                break  # parse what is there before reading more
        out: list[wire.Message] = []
        buf = self._buf
        pos = 0
        while len(buf) - pos >= wire.HEADER.size:
            kind, length = wire.decode_header(memoryview(buf)[pos : pos + wire.HEADER.size])
            end = pos + wire.HEADER.size + length
            if len(buf) < end:
                break
            out.append(wire.decode_body(kind, bytes(buf[pos + wire.HEADER.size : end])))
            pos = end
        del buf[:pos]
        if eof and buf and not out:
            raise ProtocolError(f"the connection ended inside a message ({len(buf)} bytes)")
        return out, eof
