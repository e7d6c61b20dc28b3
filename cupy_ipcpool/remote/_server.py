"""The producer side: forward a local channel's frames to remote subscribers over UCX.

A :class:`RemoteServer` is itself a *local subscriber* of the producer's
channel (the bridge): it receives each frame once, zero-copy, and sends it
with UCX to every remote subscriber that has credit.  The bridge's lease on
the producer's slot is its only hold, and it is returned when every UCX send
of that frame has completed or failed (or was given up after
``send_timeout``) and no ``"block"`` subscriber still waits for credit to
receive it.  The producer and its local subscribers are untouched: they see
one more local subscriber.

Threads: the accept thread (:class:`~._accept.Acceptor`: every handshake,
non-blocking, admitted per source address), the source thread (blocks in the
bridge's ``recv``) and the server loop, which owns the UCX worker, the
control sockets (never a blocking write) and the :class:`~._credit.ServerBook`.
The loop ends only when the source ends, on :meth:`RemoteServer.close`, or on
a failure of the server itself; :attr:`RemoteServer.ended` says which.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import secrets
import select
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._errors import (
    ChannelTimeoutError,
    EndOfStream,
    ProtocolError,
    TeardownWarning,
    TransportError,
    UsageError,
)
from .._transport._closing import ClosesOnExit
from . import _auth as auth
from . import _io
from . import _ucx as ucx
from . import _wire as wire
from ._accept import HANDSHAKE_TIMEOUT, MAX_PENDING_PER_ADDRESS, Acceptor, Joined, refuse
from ._credit import ServerBook
from ._staging import StagingBuffers, cuda_ipc_exports, cuda_ipc_may_carry

#: Bytes of control messages a subscriber may leave unread before it is dropped.
MAX_OUTBOX = 1 << 20
_SEND_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL


class SourceFrame(Protocol):
    """A frame the server forwards: C-contiguous arrays (NumPy or CuPy), metadata, a lease."""

    seq: int
    arrays: tuple[Any, ...]
    metadata: bytes

    def release(self) -> None: ...


class FrameSource(Protocol):
    """Where the server takes frames from (the bridge subscriber)."""

    slot_nbytes: int
    num_slots: int

    def recv(self, *, timeout: float | None = None) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RemoteInfo:
    """What the server knows about one remote subscriber."""

    sub_id: int
    peer: str
    mode: str
    num_slots: int
    #: on this machine, with transports that include UCX's cuda_ipc: device frames to
    #: it go through a staging buffer unless cuda_ipc exports the slots
    #: (remote/_staging.py)
    local: bool = False


@dataclass
class _Remote:
    info: RemoteInfo
    sock: socket.socket
    endpoint: Any
    key: int
    reader: _io.MessageReader
    outbox: bytearray = field(default_factory=bytearray)


@dataclass
class _Send:
    sub_id: int
    seq: int
    requests: list[Any]


class RemoteServer(ClosesOnExit):
    """Serve a local channel's frames to remote subscribers over UCX.

    Parameters
    ----------
    source:
        The bridge: a local subscriber of the producer's channel.  Use
        :func:`serve`, which opens it for you (GPU channel or host channel).
    listen:
        ``"host:port"`` of the control listener, the port written out (default
        ``127.0.0.1:13337``; port 0 picks a free one).  A loopback host also restricts UCX to the
        loopback device.  Bind to another address only on a trusted network:
        UCX does not encrypt.
    secret:
        The shared secret (at least 16 bytes; default ``$CUPY_IPCPOOL_SECRET``).
        Required unless ``insecure=True``.
    insecure:
        Accept subscribers without a secret (for trying it out on one machine).
    max_subscribers:
        Further subscribers are refused.
    max_pending_per_address:
        Most handshakes of one source address waiting at once in each step
        (for HELLO, for PROOF); one more makes the oldest of that address and
        step go.
    handshake_timeout:
        Seconds a connection has, from accept, to finish the handshake.
    send_timeout:
        Seconds a frame's UCX send to one subscriber may stay incomplete (and
        its unread control messages may stay unsent); then that subscriber is
        evicted and the source frame's lease comes back.
    linger:
        After the source ends, how long queued frames may take to drain.
    own_source:
        Close ``source`` when the server closes.

    Raises
    ------
    UsageError
        No secret and not ``insecure``; a bad ``listen`` address or option.
    TransportError
        The listener cannot bind.
    RemoteUnavailableError
        UCXX is not installed.
    """

    def __init__(
        self,
        source: FrameSource,
        *,
        listen: str = f"127.0.0.1:{wire.DEFAULT_PORT}",
        secret: str | bytes | None = None,
        insecure: bool = False,
        max_subscribers: int = 16,
        max_pending_per_address: int = MAX_PENDING_PER_ADDRESS,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        send_timeout: float = 5.0,
        linger: float = 5.0,
        own_source: bool = False,
    ) -> None:
        key = auth.secret_from(secret)
        if key is None and not insecure:
            raise UsageError(
                "a remote server needs a shared secret: pass secret=... (or set "
                f"${auth.SECRET_ENV}); insecure=True serves without one"
            )
        if not send_timeout > 0:
            raise UsageError(f"send_timeout must be positive, not {send_timeout}")
        host, port = wire.parse_listen(listen)
        self._source = source
        self._own_source = own_source
        self._max_subscribers = max_subscribers
        self.send_timeout = float(send_timeout)
        self._linger = linger
        self._book = ServerBook(source_slots=int(getattr(source, "num_slots", 0)) or None)
        self._remotes: dict[int, _Remote] = {}
        self._by_fd: dict[int, _Remote] = {}
        self._frames: dict[int, Any] = {}
        # device frames staged for local subscribers (remote/_staging.py): seq -> (buffer,
        # the frame's arrays in it); the buffers are made when first needed
        self._staged: dict[int, tuple[Any, list[Any]]] = {}
        self._staging: StagingBuffers | None = None
        self._slots_exported: bool | None = None  # by cuda_ipc: known at the first frame
        self._sends: list[_Send] = []
        self._orphans: list[Any] = []  # requests of evicted subscribers, given up
        self._closing_eps: list[Any] = []
        self._joined: collections.deque[Joined] = collections.deque()
        self._incoming: collections.deque[Any] = collections.deque()
        self._source_end: tuple[str, bool] | None = None
        self._failure: str | None = None
        self._last_seq = -1
        self._next_id = 1
        self._lock = threading.Lock()
        self._stop = False
        self._closed = False
        self.last_leave_reason = ""
        self.frames_received = 0
        self.frames_sent = 0
        self.evictions = 0
        self._worker = ucx.Worker(loopback_only=ucx.is_loopback(host))
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(socket.SOMAXCONN)
            listener.setblocking(False)
            self._acceptor = Acceptor(
                listener,
                key,
                self._on_joined,
                per_address=max_pending_per_address,
                timeout=handshake_timeout,
            )
        except (OSError, UsageError) as exc:
            listener.close()
            self._worker.close()
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            if isinstance(exc, UsageError):
                raise
            raise TransportError(
                exc.errno or errno.EADDRINUSE,
                f"cannot listen on {host}:{port}: {exc.strerror or exc}",
            ) from None
        bound = listener.getsockname()
        self.host, self.port = host, int(bound[1])
        self._poller = select.poll()
        self._source_thread = threading.Thread(
            target=self._pump, name="ipcpool-remote-source", daemon=True
        )
        self._loop_thread = threading.Thread(
            target=self._run, name="ipcpool-remote-server", daemon=True
        )
        self._acceptor.start()
        self._source_thread.start()
        self._loop_thread.start()

    # -- public state --

    @property
    def address(self) -> str:
        """``ucx://host:port`` that subscribers connect to."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"ucx://{host}:{self.port}"

    @property
    def subscribers(self) -> list[RemoteInfo]:
        """Remote subscribers adopted and not yet gone."""
        with self._lock:
            return [r.info for r in self._remotes.values()]

    @property
    def pending_handshakes(self) -> int:
        """Handshakes in progress (for diagnostics and tests)."""
        return self._acceptor.pending()

    @property
    def ucx_config(self) -> dict[str, str]:
        """The UCX configuration the server's worker uses."""
        return self._worker.config

    @property
    def running(self) -> bool:
        """True until the server loop ended (source ended and drained, closed, or failed)."""
        return self._loop_thread.is_alive()

    @property
    def ended(self) -> EndOfStream | None:
        """Why the loop ended (None while it runs).

        ``clean`` is True when the source ended cleanly (the producer closed)
        or :meth:`close` was called; False when the source died or failed, or
        the server itself failed (the message says which).
        """
        if self._loop_thread.is_alive():
            return None
        if self._failure is not None:
            return EndOfStream(self._failure, False)
        if self._source_end is not None:
            reason, clean = self._source_end
            return EndOfStream(f"the source ended: {reason}", clean)
        return EndOfStream("the server was closed", True)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the loop to end (see :attr:`ended`); True if it did."""
        self._loop_thread.join(timeout)
        return not self._loop_thread.is_alive()

    # -- threads --

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _on_joined(self, joined: Joined) -> None:
        self._joined.append(joined)
        self._wake()

    def _pump(self) -> None:
        source = self._source
        while not self._stop:
            try:
                frame = source.recv(timeout=0.2)
            except (ChannelTimeoutError, TimeoutError):
                continue
            except EndOfStream as exc:
                self._incoming.append((str(exc), exc.clean))
                break
            except Exception as exc:
                if self._stop:
                    break
                self._incoming.append((f"the source failed: {exc!r}", False))
                break
            self._incoming.append(frame)
            self._wake()
        self._wake()

    def _run(self) -> None:
        worker = self._worker
        poller = self._poller
        poller.register(self._wake_r, select.POLLIN)
        poller.register(worker.fileno(), select.POLLIN)
        drain_deadline = None
        try:
            while not self._stop:
                self._progress()
                while self._joined:
                    self._adopt(self._joined.popleft())
                while self._incoming:
                    item = self._incoming.popleft()
                    if isinstance(item, tuple):
                        self._source_end = item
                    else:
                        self._forward(item)
                if self._acceptor.failure is not None:
                    self._failure = self._acceptor.failure
                    break
                if self._source_end is not None:
                    if drain_deadline is None:
                        drain_deadline = time.monotonic() + self._linger
                    if not self._book.retained_frames() or time.monotonic() > drain_deadline:
                        break
                self._progress()
                if worker.arm():
                    for fd, ev in poller.poll(self._poll_timeout()):
                        if fd == self._wake_r:
                            with contextlib.suppress(OSError):
                                os.read(self._wake_r, 4096)
                            continue
                        remote = self._by_fd.get(fd)
                        if remote is not None:
                            self._guard(remote, self._on_event, remote, ev)
        except Exception as exc:  # a bug: end the sessions and say why
            self._failure = f"the remote server loop failed: {exc!r}"
            warnings.warn(self._failure, RuntimeWarning, stacklevel=1)
        finally:
            self._shutdown()

    # -- loop internals --

    def _poll_timeout(self) -> int:
        deadlines = [self._book.next_deadline(self.send_timeout)]
        if self._source_end is not None or self._orphans or self._closing_eps:
            deadlines.append(time.monotonic() + 0.1)
        due = [d for d in deadlines if d is not None]
        if not due:
            return -1
        return max(0, int((min(due) - time.monotonic()) * 1000) + 1)

    def _progress(self) -> None:
        self._worker.progress()
        self._reap_sends()
        now = time.monotonic()
        for sub_id in self._book.overdue(now, self.send_timeout):
            remote = self._remotes.get(sub_id)
            if remote is not None:
                self.evictions += 1
                self._drop(
                    remote,
                    f"evicted: a frame send did not complete within send_timeout="
                    f"{self.send_timeout} s",
                    notify=True,
                    abandon=True,
                )

    def _guard(self, remote: _Remote, step: Any, *args: Any) -> None:
        """Run one subscriber's step; an unexpected error costs that subscriber only."""
        try:
            step(*args)
        except Exception as exc:
            self._drop(remote, f"dropped after a server error: {exc!r}")

    def _adopt(self, joined: Joined) -> None:
        hello = joined.hello
        if len(self._remotes) >= self._max_subscribers:
            refuse(joined.sock, f"the server already has max_subscribers={self._max_subscribers}")
            return
        if self._source_end is not None:
            refuse(joined.sock, "the stream has ended")
            return
        sub_id = self._next_id
        self._next_id += 1
        try:
            endpoint = self._worker.connect(joined.ucx_address)
        except Exception as exc:
            refuse(joined.sock, f"cannot reach the subscriber's UCX worker: {exc}")
            return
        mode = wire.MODE_NAMES[hello.mode]
        local = cuda_ipc_may_carry(joined.sock, self._worker.config.get("TLS", ""))
        info = RemoteInfo(sub_id, joined.peer, mode, hello.num_slots, local)
        remote = _Remote(info, joined.sock, endpoint, secrets.randbits(32), joined.reader)
        self._book.add_subscriber(sub_id, mode, hello.num_slots)
        with self._lock:
            self._remotes[sub_id] = remote
        self._by_fd[joined.sock.fileno()] = remote
        self._poller.register(joined.sock, select.POLLIN)
        welcome = wire.encode_welcome(
            sub_id, remote.key, self._last_seq + 1, int(self._source.slot_nbytes), wire.MAX_ARRAYS
        )
        self._guard(remote, self._send_control, remote, welcome)

    def _send_control(self, remote: _Remote, data: bytes) -> None:
        """Queue ``data`` on the control socket; never blocks (a full outbox drops the peer)."""
        if not remote.outbox:
            try:
                sent = remote.sock.send(data, _SEND_FLAGS)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._drop(remote, f"its control connection failed: {exc}")
                return
            data = data[sent:]
            if not data:
                return
            self._poller.modify(remote.sock, select.POLLIN | select.POLLOUT)
        remote.outbox += data
        if len(remote.outbox) > MAX_OUTBOX:
            self._drop(remote, f"dropped: it left {len(remote.outbox)} control bytes unread")

    def _on_event(self, remote: _Remote, ev: int) -> None:
        if ev & select.POLLOUT and remote.outbox:
            try:
                sent = remote.sock.send(remote.outbox, _SEND_FLAGS)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._drop(remote, f"its control connection failed: {exc}")
                return
            del remote.outbox[:sent]
            if not remote.outbox:
                self._poller.modify(remote.sock, select.POLLIN)
        if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
            self._read(remote)

    def _forward(self, frame: Any) -> None:
        seq = int(frame.seq)
        self._last_seq = seq
        self.frames_received += 1
        self._frames[seq] = frame
        for sub_id, slot in self._book.offer(seq, time.monotonic()):
            remote = self._remotes[sub_id]
            self._guard(remote, self._start_send, remote, seq, slot)
        if not self._book.retained(seq):
            self._release(seq)

    def _start_send(self, remote: _Remote, seq: int, slot: int) -> None:
        frame = self._frames[seq]
        sub_id = remote.info.sub_id
        try:
            from ._host import spec_of

            specs = tuple(spec_of(a) for a in frame.arrays)
            self._send_control(remote, wire.encode_frame(seq, slot, specs, frame.metadata))
            if sub_id not in self._remotes:  # dropped by that write: the send never starts
                if self._book.sent(sub_id, seq):
                    self._release(seq)
                return
            arrays = self._staged_arrays(seq, frame) if remote.info.local else frame.arrays
            requests = [
                self._worker.send(remote.endpoint, a, wire.data_tag(remote.key, seq, i))
                for i, a in enumerate(arrays)
            ]
        except Exception as exc:
            if self._book.sent(sub_id, seq):
                self._release(seq)
            self._drop(remote, f"sending frame {seq} failed: {exc}")
            return
        self._sends.append(_Send(sub_id, seq, requests))
        self.frames_sent += 1

    def _staged_arrays(self, seq: int, frame: Any) -> Any:
        """What a send of frame ``seq`` to a subscriber on this machine reads from.

        Device arrays that UCX's cuda_ipc cannot export (an IpcPool's slots)
        are copied into a staging buffer once per frame (remote/_staging.py);
        host arrays, and device memory it exports, are sent as they are.
        """
        staged = self._staged.get(seq)
        if staged is not None:
            return staged[1]
        arrays = frame.arrays
        device = [a for a in arrays if type(a).__module__.startswith("cupy")]
        if not device:
            return arrays
        if self._slots_exported is None:
            self._slots_exported = cuda_ipc_exports(int(device[0].data.ptr))
        if self._slots_exported:
            return arrays
        if self._staging is None:
            nbytes = int(self._source.slot_nbytes) + wire.ALIGN * wire.MAX_ARRAYS
            self._staging = StagingBuffers(nbytes, device[0].device.id)
        from ._host import spec_of

        memory = self._staging.take()
        views = self._staging.views(memory, tuple(spec_of(a) for a in arrays))
        try:
            self._staging.copy(list(arrays), views)
        except BaseException:
            self._staging.give(memory)
            raise
        self._staged[seq] = (memory, views)
        return views

    def _reap_sends(self) -> None:
        if self._orphans:
            self._orphans = [r for r in self._orphans if ucx.request_state(r) is None]
        if self._closing_eps:  # an endpoint goes (with its sockets) once it has closed
            self._closing_eps = [
                (r, e) for r, e in self._closing_eps if ucx.request_state(r) is None
            ]
        if not self._sends:
            return
        still = []
        failed: list[tuple[int, str]] = []
        for send in self._sends:
            states = [ucx.request_state(r) for r in send.requests]
            if any(s is None for s in states):
                still.append(send)
                continue
            errors = [s for s in states if s]
            if errors:
                failed.append((send.sub_id, errors[0]))
            if self._book.sent(send.sub_id, send.seq):
                self._release(send.seq)
        self._sends = still
        for sub_id, why in failed:
            remote = self._remotes.get(sub_id)
            if remote is not None:
                self._drop(remote, f"a UCX send failed: {why}")

    def _release(self, seq: int) -> None:
        staged = self._staged.pop(seq, None)
        if staged is not None and self._staging is not None:
            self._staging.give(staged[0])
        frame = self._frames.pop(seq, None)
        if frame is not None:
            try:
                frame.release()
            except Exception as exc:
                warnings.warn(
                    f"releasing frame {seq} failed: {exc!r}", TeardownWarning, stacklevel=2
                )

    def _read(self, remote: _Remote) -> None:
        sub_id = remote.info.sub_id
        try:
            messages, eof = remote.reader.feed(remote.sock)
            for msg in messages:
                if type(msg) is wire.Credit:
                    start = self._book.credit(sub_id, msg.slot, time.monotonic())
                    if start is not None:
                        self._start_send(remote, start[0], start[1])
                    if sub_id not in self._remotes:
                        return
                elif type(msg) is wire.Bye:
                    self._drop(remote, "said BYE")
                    return
                else:
                    raise ProtocolError(f"unexpected {type(msg).__name__} from a subscriber")
        except ProtocolError as exc:
            self._drop(remote, f"protocol error: {exc}")
            return
        if eof:
            self._drop(remote, "disconnected")

    def _drop(
        self,
        remote: _Remote,
        reason: str,
        *,
        bye: bool = False,
        notify: bool = False,
        abandon: bool = False,
    ) -> None:
        """Forget a subscriber: close its control socket first, then give back what it held.

        ``notify`` tells it why (a REFUSE) and ``bye`` says goodbye, when its
        socket takes it now.  ``abandon`` also gives back the leases of its
        sends still in flight (after ``send_timeout``): UCX cannot cancel a
        send to a peer that makes no progress, so those requests are kept
        until they end; the subscriber, its control connection closed before
        the lease was given back, never hands their frames out.
        """
        sub_id = remote.info.sub_id
        with self._lock:
            if self._remotes.pop(sub_id, None) is None:
                return
            # set with the removal: whoever sees the subscriber gone sees why
            self.last_leave_reason = reason
        fd = remote.sock.fileno()
        self._by_fd.pop(fd, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._poller.unregister(fd)
        last = wire.encode_refuse(reason) if notify else wire.encode_bye() if bye else b""
        if last and not remote.outbox:
            with contextlib.suppress(OSError):
                remote.sock.send(last, _SEND_FLAGS)
        with contextlib.suppress(OSError):
            remote.sock.shutdown(socket.SHUT_RDWR)
        remote.sock.close()
        if abandon:
            keep = [s for s in self._sends if s.sub_id == sub_id]
            self._sends = [s for s in self._sends if s.sub_id != sub_id]
            self._orphans.extend(r for s in keep for r in s.requests if r is not None)
        for seq in self._book.remove_subscriber(sub_id, abandon_sends=abandon):
            self._release(seq)
        req = ucx.close_endpoint(remote.endpoint)
        if req is not None:
            self._closing_eps.append((req, remote.endpoint))

    def _shutdown(self) -> None:
        """End every session, wait (bounded) for sends to finish, release every frame."""
        end = self._source_end
        clean = self._failure is None and (end is None or end[1])
        reason = self._failure or ("the server closed" if end is None else end[0])
        for remote in list(self._remotes.values()):
            self._drop(remote, reason, bye=clean)
        deadline = time.monotonic() + 2.0
        while (self._sends or self._closing_eps) and time.monotonic() < deadline:
            self._worker.progress()
            self._reap_sends()
            self._closing_eps = [
                (r, e) for r, e in self._closing_eps if ucx.request_state(r) is None
            ]
            if self._sends or self._closing_eps:
                time.sleep(0.002)
        if self._sends or self._orphans:
            self._worker.cancel()
            self._worker.progress()
            self._reap_sends()
        for seq in list(self._frames):
            self._release(seq)
        self._closing_eps.clear()
        self._stop = True

    # -- teardown --

    def close(self) -> None:
        """Stop accepting, end every session (BYE), release every frame.

        Idempotent; never raises (problems become :class:`TeardownWarning`).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._acceptor.stop()
        except Exception as exc:
            warnings.warn(f"stopping the acceptor failed: {exc!r}", TeardownWarning, stacklevel=2)
        self._stop = True
        self._wake()
        self._loop_thread.join(10.0)
        self._source_thread.join(2.0)
        while self._joined:
            refuse(self._joined.popleft().sock, "the server is closing")
        for item in self._incoming:
            if not isinstance(item, tuple):
                with contextlib.suppress(Exception):
                    item.release()
        self._incoming.clear()
        if self._own_source:
            try:
                self._source.close()
            except Exception as exc:
                warnings.warn(f"closing the source failed: {exc!r}", TeardownWarning, stacklevel=2)
        self._worker.close()
        if self._staging is not None:
            self._staging.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


__all__ = ["FrameSource", "RemoteInfo", "RemoteServer", "SourceFrame"]
