"""The subscriber side of a remote session: handshake, credit, frame headers, UCX receives.

:class:`ClientSession` is driven by one thread through :meth:`ClientSession.step`.
What the frames land in, and what happens to a complete frame, is the
*sink*'s business: a :class:`~._subscriber.RemoteSubscriber` queues them for
its user; a :class:`~._relay.Relay` republishes them locally.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from dataclasses import dataclass
from typing import Any, Protocol

from .._errors import (
    EndOfStream,
    EvictedError,
    IpcPoolError,
    PeerRefusedError,
    ProtocolError,
    TransportError,
    UsageError,
)
from . import _auth as auth
from . import _io
from . import _ucx as ucx
from . import _wire as wire
from ._credit import ClientBook
from ._errors import AuthenticationError
from ._staging import StagingBuffers, needs_staging

#: Start of the message of a refusal that a new attempt may overcome.
_BUSY = "busy: the server at "
#: Seconds between attempts after such a refusal.
_RETRY = 0.02


@dataclass
class Received:
    """A frame whose data arrived completely in ``slot``."""

    seq: int
    slot: int
    specs: tuple[wire.ArraySpec, ...]
    arrays: list[Any]
    metadata: bytes


class Sink(Protocol):
    """Where a session's frames land."""

    num_slots: int

    def setup(self, max_frame: int) -> None:
        """Allocate the receive ring for frames of at most ``max_frame`` bytes."""

    def grantable(self, book: ClientBook) -> list[int]:
        """Slots that may be offered to the server now."""
        ...

    def arrays(self, slot: int, specs: tuple[wire.ArraySpec, ...]) -> list[Any]:
        """Where frame arrays in ``slot`` are received (ProtocolError when they do not fit)."""
        ...

    def deliver(self, frame: Received, book: ClientBook) -> None:
        """A complete frame."""

    def abandon(self, slot: int) -> None:
        """A frame in ``slot`` will never complete."""


@dataclass
class _Pending:
    seq: int
    slot: int
    specs: tuple[wire.ArraySpec, ...]
    arrays: list[Any]
    metadata: bytes
    requests: list[Any]
    #: what UCX receives into when the frame is staged (then copied into ``arrays``)
    staged: list[Any] | None = None


class ClientSession:
    """Connect, authenticate and receive frames into a sink.

    Parameters
    ----------
    address:
        ``ucx://host:port`` of a :class:`~cupy_ipcpool.remote.RemoteServer`.
    sink:
        Receives the frames (see :class:`Sink`).
    secret:
        The shared secret (default ``$CUPY_IPCPOOL_SECRET``).
    insecure:
        Accept a server that requires no secret.
    mode:
        ``"block"`` or ``"latest"``.
    timeout:
        Seconds for connecting and the handshake.

    Raises
    ------
    AuthenticationError
        Wrong or missing secret (either side).
    PeerRefusedError
        The server refused (capacity, stream ended...).
    TransportError
        No server at the address.
    ProtocolError
        The server spoke out of protocol.
    """

    def __init__(
        self,
        address: str,
        sink: Sink,
        *,
        secret: str | bytes | None = None,
        insecure: bool = False,
        mode: str = "block",
        timeout: float = 10.0,
    ) -> None:
        if mode not in wire.MODE_CODES:
            raise UsageError(f"mode must be 'block' or 'latest', not {mode!r}")
        host, port = wire.parse_address(address)
        key = auth.secret_from(secret)
        if key is None and not insecure:
            raise UsageError(
                "a remote subscription needs the server's shared secret: pass secret=... "
                f"(or set ${auth.SECRET_ENV}); insecure=True connects without one"
            )
        ucx.load()  # say so now if UCXX is missing (after the caller's own mistakes)
        self.address = address
        self.mode = mode
        self.sink = sink
        self.ended: tuple[str, bool] | None = None
        #: set with ``ended`` when the server evicted this subscriber, or when it
        #: spoke out of protocol: what ``recv`` raises once before EndOfStream
        self.failure: IpcPoolError | None = None
        self._pending: dict[int, _Pending] = {}  # slot -> frame, in header (= seq) order
        #: device frames go through staging buffers (remote/_staging.py): None until
        #: the first device frame's header decides it
        self.staged: bool | None = None
        self._staging: StagingBuffers | None = None
        self._stage_of: dict[int, Any] = {}  # receive slot -> its staging buffer
        deadline = time.monotonic() + timeout
        # The UCX worker exists before the handshake starts, so that the PROOF
        # follows the CHALLENGE at once: the server admits a handshake per
        # source address for a bounded time, and a quick one is never pushed out.
        self.worker: ucx.Worker | None = ucx.Worker(loopback_only=ucx.is_loopback(host))
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=timeout)
            except OSError as exc:
                self.worker.close()
                raise TransportError(
                    exc.errno or 0,
                    f"cannot connect to the remote server at {address}: {exc.strerror or exc} "
                    "(is it serving, and is its port reachable from here?)",
                ) from None
            self.sock = sock
            try:
                _io.configure(sock)
                self._handshake(key, insecure, deadline)
                sink.setup(self.max_frame)
                break
            except PeerRefusedError as exc:
                # Pushed out by newer handshakes from this address (a flood, or many
                # subscribers at once): try again, with a new connection, in time.
                if _BUSY not in str(exc) or time.monotonic() + _RETRY > deadline:
                    self.close(bye=False)
                    raise
                with contextlib.suppress(OSError):
                    sock.close()
                time.sleep(_RETRY)
            except BaseException:
                self.close(bye=False)
                raise
        sock.setblocking(False)
        self.reader = _io.MessageReader()

    def _handshake(self, secret: bytes | None, insecure: bool, deadline: float) -> None:
        sock = self.sock
        assert self.worker is not None
        hello = wire.encode_hello(auth.nonce(), wire.MODE_CODES[self.mode], self.sink.num_slots)
        _io.send_all(sock, hello, max(0.0, deadline - time.monotonic()))
        try:
            msg, challenge = _io.recv_message(
                sock, deadline, foreign=f"{self.address} is not a cupy_ipcpool server"
            )
        except EndOfStream:
            raise EndOfStream(
                f"{self.address} closed the connection before answering the handshake "
                "(is it a cupy_ipcpool server?)",
                False,
            ) from None
        if isinstance(msg, wire.Refuse):
            if msg.reason.startswith(wire.REFUSE_BUSY):
                raise PeerRefusedError(f"{_BUSY}{self.address} refused: {msg.reason}")
            raise PeerRefusedError(f"the server at {self.address} refused: {msg.reason}")
        if not isinstance(msg, wire.Challenge):
            raise ProtocolError(f"expected CHALLENGE, got {type(msg).__name__}")
        if msg.auth and secret is None:
            raise AuthenticationError(
                f"the server at {self.address} requires a shared secret: pass secret=..."
            )
        if not msg.auth and secret is not None and not insecure:
            raise AuthenticationError(
                f"the server at {self.address} does not prove the shared secret (it serves "
                "without one); refusing it (insecure=True accepts such a server)"
            )
        if msg.auth and secret is not None:
            want = auth.server_proof(secret, hello, msg.nonce)
            if not auth.verify(want, msg.proof):
                raise AuthenticationError(
                    f"the server at {self.address} does not know the shared secret"
                )
        address = self.worker.address
        use = secret if msg.auth else None
        proof = auth.client_proof(use, hello, challenge, address)
        _io.send_all(sock, wire.encode_proof(proof, address), max(0.0, deadline - time.monotonic()))
        reply, _raw = _io.recv_message(sock, deadline)
        if isinstance(reply, wire.Refuse):
            if reply.reason.startswith("authentication failed"):
                raise AuthenticationError(f"the server at {self.address} refused: {reply.reason}")
            raise PeerRefusedError(f"the server at {self.address} refused: {reply.reason}")
        if not isinstance(reply, wire.Welcome):
            raise ProtocolError(f"expected WELCOME, got {type(reply).__name__}")
        self.sub_id = reply.sub_id
        self.key = reply.key
        self.max_frame = reply.max_frame
        self.book = ClientBook(self.sink.num_slots, reply.next_seq)

    # -- the loop --

    def fds(self) -> list[int]:
        """Fds to wait on (control socket, UCX worker)."""
        assert self.worker is not None
        return [self.sock.fileno(), self.worker.fileno()]

    def step(self, poller: select.poll, timeout_ms: int) -> None:
        """Make progress: complete frames, grant credit, read headers; wait up to ``timeout_ms``."""
        worker = self.worker
        assert worker is not None
        if self.ended is not None:
            return
        worker.progress()
        self._complete()
        self._grant()
        if self.ended is not None:
            return
        if worker.arm():
            poller.poll(timeout_ms)
        worker.progress()
        self._read()
        self._complete()

    def _grant(self) -> None:
        book = self.book
        for slot in self.sink.grantable(book):
            book.grant(slot)
            try:
                self.sock.send(wire.encode_credit(slot))
            except BlockingIOError:
                _io.send_all(self.sock, wire.encode_credit(slot), 5.0)
                self.sock.setblocking(False)
            except OSError as exc:
                # A server that said BYE and closed makes this send fail (EPIPE) before
                # the BYE queued for us is read: read what is queued first, so that a
                # clean close is not reported as a failure.
                with contextlib.suppress(ProtocolError):
                    self._read()
                self._end(f"the connection to {self.address} failed: {exc}", False)
                return

    def _read(self) -> None:
        try:
            messages, eof = self.reader.feed(self.sock)
            for msg in messages:
                if type(msg) is wire.FrameHeader:
                    self._header(msg)
                elif type(msg) is wire.Bye:
                    self._end(f"the server at {self.address} said BYE", True)
                    return
                elif type(msg) is wire.Refuse:  # the server dropped us, and says why
                    reason = f"the server at {self.address} {msg.reason}"
                    self._end(reason, False, EvictedError(reason, False))
                    return
                else:
                    raise ProtocolError(f"unexpected {type(msg).__name__} from the server")
        except ProtocolError as exc:
            reason = f"the connection was closed after a protocol error: {exc}"
            self._end(reason, False, ProtocolError(f"the server at {self.address}: {exc}"))
            return
        if eof:
            self._end(f"the connection to the server at {self.address} was lost", False)

    def _header(self, msg: wire.FrameHeader) -> None:
        assert self.worker is not None
        if msg.slot >= self.sink.num_slots:
            raise ProtocolError(f"frame {msg.seq} names slot {msg.slot} of {self.sink.num_slots}")
        if sum(s.nbytes for s in msg.specs) > self.max_frame:
            raise ProtocolError(f"frame {msg.seq} is larger than the announced {self.max_frame}")
        self.book.frame(msg.seq, msg.slot)
        try:
            arrays = self.sink.arrays(msg.slot, msg.specs)
        except ProtocolError:
            self.book.abandon(msg.slot)
            raise
        targets = self._staged_targets(msg.slot, msg.specs, arrays)
        requests = [
            self.worker.recv(a, wire.data_tag(self.key, msg.seq, i))
            for i, a in enumerate(arrays if targets is None else targets)
        ]
        self._pending[msg.slot] = _Pending(
            msg.seq, msg.slot, msg.specs, arrays, msg.metadata, requests, targets
        )

    def _staged_targets(
        self, slot: int, specs: tuple[wire.ArraySpec, ...], arrays: list[Any]
    ) -> list[Any] | None:
        """Where UCX receives a device frame of ``slot`` when it is staged (else None)."""
        if not arrays or not _on_device(arrays[0]):
            return None
        if self.staged is None:
            assert self.worker is not None
            tls = self.worker.config.get("TLS", "")
            self.staged = needs_staging(self.sock, tls, int(arrays[0].data.ptr))
        if not self.staged:
            return None
        if self._staging is None:
            # a frame's arrays fit max_frame bytes, plus their alignment in the slot
            nbytes = self.max_frame + wire.ALIGN * wire.MAX_ARRAYS
            self._staging = StagingBuffers(nbytes, arrays[0].device.id)
        memory = self._stage_of.get(slot)
        if memory is None:
            memory = self._stage_of[slot] = self._staging.take()
        return self._staging.views(memory, specs)

    def _complete(self) -> None:
        if self._pending and self._first_done():
            # Hand a frame out only while the server still holds its lease: it
            # closes this connection (after an eviction notice) before it gives
            # a lease back, so whatever is queued here is read first.
            self._read()
            if self.ended is not None:
                return
        while self._pending:
            slot, first = next(iter(self._pending.items()))
            states = [ucx.request_state(r) for r in first.requests]
            if any(s is None for s in states):
                return
            del self._pending[slot]
            errors = [s for s in states if s]
            if errors:
                self.book.abandon(slot)
                self.sink.abandon(slot)
                self._end(f"receiving frame {first.seq} failed: {errors[0]}", False)
                return
            if first.staged is not None:
                assert self._staging is not None
                self._staging.copy(first.staged, first.arrays)
            self.book.received(slot)
            self.sink.deliver(
                Received(first.seq, slot, first.specs, first.arrays, first.metadata), self.book
            )

    def _first_done(self) -> bool:
        first = next(iter(self._pending.values()))
        return all(ucx.request_state(r) is not None for r in first.requests)

    def _end(self, reason: str, clean: bool, failure: IpcPoolError | None = None) -> None:
        if self.ended is None:
            self.ended = (reason, clean)
            self.failure = failure
            self._abandon_pending()

    def _abandon_pending(self) -> None:
        if not self._pending:
            return
        if self.worker is not None:
            with contextlib.suppress(Exception):
                self.worker.cancel()
                self.worker.progress()
        for slot in list(self._pending):
            self.book.abandon(slot)
            self.sink.abandon(slot)
        self._pending.clear()

    def close(self, *, bye: bool = True) -> None:
        """Say BYE (unless the server ended), cancel receives, drop the worker. Idempotent."""
        if bye and self.ended is None:
            with contextlib.suppress(OSError):
                self.sock.send(wire.encode_bye(), socket.MSG_DONTWAIT)
        if self.ended is None:
            self.ended = ("the subscription was closed", True)
        if getattr(self, "book", None) is not None:
            self._abandon_pending()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        if self.worker is not None:
            self.worker.close()
        self._stage_of.clear()
        if self._staging is not None:
            self._staging.close()


def _on_device(array: Any) -> bool:
    """Whether ``array`` is a CuPy array (device memory)."""
    return type(array).__module__.startswith("cupy")


__all__ = ["ClientSession", "Received", "Sink"]
