"""The remote server's TCP listener: every handshake on one thread, non-blocking, bounded.

One thread (the transport's
:class:`~cupy_ipcpool._transport._accept_loop.AcceptLoop`) accepts connections and
drives every handshake in progress (HELLO, CHALLENGE, PROOF) from one ``poll(2)`` set: no
thread per peer, no blocking read or write.  :class:`~._admission.HandshakeBook` decides who
waits: at most ``per_address`` handshakes of one source address per stage,
the oldest of that address and stage going when one more arrives, and one
deadline per handshake from accept.  A peer that sends a malformed message,
the wrong proof, or nothing in time is refused (a REFUSE with the reason, when
its socket takes it) and closed.  A handshake that proves the secret is handed
to the server loop (``on_joined``), which creates the UCX endpoint.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .._errors import ProtocolError
from .._transport._accept_loop import HANDSHAKE_TIMEOUT, AcceptLoop
from . import _auth as auth
from . import _io
from . import _wire as wire
from ._admission import WAIT_HELLO, WAIT_PROOF, HandshakeBook, address_key

#: Most handshakes of one source address waiting in one stage at once.
MAX_PENDING_PER_ADDRESS = 8


@dataclass
class Joined:
    """A peer that proved the secret: what the server loop needs to adopt it."""

    sock: socket.socket
    hello: wire.Hello
    ucx_address: bytes
    peer: str
    reader: _io.MessageReader


@dataclass
class _Handshake:
    sock: socket.socket
    peer: str
    address: int
    fd: int
    reader: _io.MessageReader = field(default_factory=_io.MessageReader)
    hello: wire.Hello | None = None
    hello_raw: bytes = b""
    challenge: bytes = b""


def refuse(sock: socket.socket, reason: str) -> None:
    """Send REFUSE if the socket takes it now (never blocks), then close."""
    with contextlib.suppress(OSError):
        sock.send(wire.encode_refuse(reason), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
    sock.close()


class Acceptor:
    """Accept and authenticate subscribers; hand each one that proves the secret on.

    Parameters
    ----------
    listener:
        A bound, listening, non-blocking TCP socket (closed by :meth:`stop`).
    secret:
        The shared secret, or None (serve without one).
    on_joined:
        Called on the accept thread with each :class:`Joined` peer.
    per_address:
        Most handshakes of one source address per stage.
    timeout:
        Seconds each handshake has, from accept.
    """

    def __init__(
        self,
        listener: socket.socket,
        secret: bytes | None,
        on_joined: Callable[[Joined], None],
        *,
        per_address: int = MAX_PENDING_PER_ADDRESS,
        timeout: float = HANDSHAKE_TIMEOUT,
    ) -> None:
        self.listener = listener
        self.secret = secret
        self.on_joined = on_joined
        self.stopping = False
        self.refused = 0
        self._book = HandshakeBook(per_address, timeout)
        self._handshakes: dict[int, _Handshake] = {}  # by fd, as the book keys them
        self._loop: AcceptLoop[_Handshake] = AcceptLoop(
            listener,
            name="ipcpool-remote-accept",
            on_accept=self._accepted,
            on_event=self._on_event,
            deadlines=self._book,
            on_expired=self._expired,
            on_exit=self._close_handshakes,
        )
        self.thread = self._loop.thread

    def start(self) -> None:
        """Start the accept thread."""
        self.thread.start()

    def stop(self) -> None:
        """Stop the thread, close the listener and refuse every handshake in progress."""
        self.stopping = True
        self._loop.stop()  # joins the thread, closes the listener

    def pending(self, address: str | None = None) -> int:
        """Handshakes in progress (from ``address``, or in all); for tests and diagnostics."""
        return self._book.count(None if address is None else address_key(address))

    # -- the thread --

    @property
    def failure(self) -> str | None:
        """Why the thread ended, when it ended by itself (a bug); None while it runs."""
        return self._loop.failure

    def _on_event(self, hs: _Handshake, _events: int) -> None:
        self._on_readable(hs.fd, hs)

    def _expired(self, fd: int) -> None:
        self._end(fd, f"no complete handshake within {self._book.timeout} s", booked=False)

    def _close_handshakes(self) -> None:
        for fd in list(self._handshakes):
            self._book.remove(fd)
            self._handshakes.pop(fd).sock.close()

    def _accepted(self, conn: socket.socket, addr: tuple[str, int]) -> None:
        _io.configure(conn)
        host = str(addr[0])
        peer = f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
        fd = conn.fileno()
        key = address_key(host)
        self._before_eviction(key, WAIT_HELLO)
        for old in self._book.admit(fd, key, time.monotonic()):
            self._end(
                old,
                f"{wire.REFUSE_BUSY}{self._book.per_address} handshakes from {host} were "
                "waiting; this one, "
                "the oldest, made room for a newer one",
                booked=False,
            )
        hs = _Handshake(conn, peer, key, fd)
        self._handshakes[fd] = hs
        self._loop.watch(fd, hs, select.POLLIN)
        self._on_readable(fd, hs)  # the HELLO is often there already

    def _before_eviction(self, address: int, stage: int) -> None:
        """Let the handshakes that one more of ``address`` would push out read what they got.

        The oldest of an address and stage goes only if it is still waiting
        once what it already sent is read: a subscriber whose message arrived
        moves on, whatever the number of connections behind it.
        """
        seen = set()
        while True:
            victim = self._book.next_to_go(address, stage)
            if victim is None or victim in seen:
                return
            seen.add(victim)
            hs = self._handshakes.get(victim)
            if hs is None:
                return
            self._on_readable(victim, hs)

    def _on_readable(self, fd: int, hs: _Handshake) -> None:
        try:
            messages, eof = hs.reader.feed(hs.sock)
            for msg in messages:
                if fd not in self._handshakes:
                    return
                self._step(fd, hs, msg)
        except ProtocolError as exc:
            self._end(fd, f"handshake failed: {exc}")
            return
        if eof and fd in self._handshakes:
            self._end(fd, "the peer closed the connection during the handshake")

    def _step(self, fd: int, hs: _Handshake, msg: wire.Message) -> None:
        if hs.hello is None:
            if not isinstance(msg, wire.Hello):
                raise ProtocolError(f"expected HELLO, got {type(msg).__name__}")
            hs.hello = msg
            hs.hello_raw = wire.encode_hello(msg.nonce, msg.mode, msg.num_slots)
            nonce = auth.nonce()
            proof = auth.server_proof(self.secret, hs.hello_raw, nonce)
            hs.challenge = wire.encode_challenge(nonce, self.secret is not None, proof)
            try:
                sent = hs.sock.send(hs.challenge, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except OSError as exc:
                self._end(fd, f"sending the challenge failed: {exc}")
                return
            if sent != len(hs.challenge):  # a fresh socket that cannot take 100 bytes
                self._end(fd, "the peer does not read")
                return
            self._before_eviction(hs.address, WAIT_PROOF)
            if fd not in self._handshakes:
                return
            for old in self._book.advance(fd, WAIT_PROOF):
                self._end(
                    old,
                    f"{wire.REFUSE_BUSY}{self._book.per_address} handshakes from the address of "
                    f"{hs.peer} owed "
                    "their proof; this one, the oldest, made room for a newer one",
                    booked=False,
                )
            return
        if not isinstance(msg, wire.Proof):
            raise ProtocolError(f"expected PROOF, got {type(msg).__name__}")
        expected = auth.client_proof(self.secret, hs.hello_raw, hs.challenge, msg.ucx_address)
        if not auth.verify(expected, msg.proof):
            self._end(fd, "authentication failed: wrong secret")
            return
        self._book.remove(fd)
        del self._handshakes[fd]
        self._loop.forget(fd, hs)
        if self.stopping:
            refuse(hs.sock, "the server is closing")
            return
        self.on_joined(Joined(hs.sock, hs.hello, msg.ucx_address, hs.peer, hs.reader))

    def _end(self, fd: int, reason: str, *, booked: bool = True) -> None:
        if booked:
            self._book.remove(fd)
        hs = self._handshakes.pop(fd, None)
        if hs is None:
            return
        self._loop.forget(fd, hs)
        self.refused += 1
        refuse(hs.sock, reason)


__all__ = ["HANDSHAKE_TIMEOUT", "MAX_PENDING_PER_ADDRESS", "Acceptor", "Joined", "refuse"]
