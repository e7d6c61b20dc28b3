"""The producer side: forward a local channel's frames to remote subscribers over UCX.

A :class:`RemoteServer` is itself a *local subscriber* of the producer's
channel (the bridge): it receives each frame once, zero-copy, and sends it
with UCX to every remote subscriber that has credit.  The bridge's lease on
the producer's slot is its only hold, and it is returned when every UCX send
of that frame has completed or failed and no ``"block"`` subscriber still
waits for credit to receive it.  The producer and its local subscribers are
untouched: they see one more local subscriber.

Threads: an accept thread (TCP listener; each handshake on a short-lived
thread with a deadline, at most ``max_pending`` at once), a source thread
(blocks in the bridge's ``recv``) and the server loop, which owns the UCX
worker, the control sockets and the :class:`~._credit.ServerBook`.
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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._errors import EndOfStream, ProtocolError, TeardownWarning, TransportError, UsageError
from . import _auth as auth
from . import _io
from . import _ucx as ucx
from . import _wire as wire
from ._credit import ServerBook

#: Seconds a connecting subscriber has to finish the handshake.
HANDSHAKE_TIMEOUT = 5.0


class SourceFrame(Protocol):
    """A frame the server forwards: C-contiguous arrays (NumPy or CuPy), metadata, a lease."""

    seq: int
    arrays: tuple[Any, ...]
    metadata: bytes

    def release(self) -> None: ...


class FrameSource(Protocol):
    """Where the server takes frames from (the bridge subscriber)."""

    slot_nbytes: int

    def recv(self, timeout: float | None = None) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RemoteInfo:
    """What the server knows about one remote subscriber."""

    sub_id: int
    peer: str
    mode: str
    num_slots: int


@dataclass
class _Remote:
    info: RemoteInfo
    sock: socket.socket
    endpoint: Any
    key: int
    reader: _io.MessageReader = field(default_factory=_io.MessageReader)


@dataclass
class _Send:
    sub_id: int
    seq: int
    requests: list[Any]


@dataclass
class _Joined:
    sock: socket.socket
    hello: wire.Hello
    ucx_address: bytes
    peer: str


def _refuse(sock: socket.socket, reason: str) -> None:
    with contextlib.suppress(OSError):
        _io.send_all(sock, wire.encode_refuse(reason), 1.0)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
    sock.close()


class _Acceptor:
    """The TCP listener and the handshakes (each on its own thread, bounded)."""

    def __init__(
        self,
        listener: socket.socket,
        secret: bytes | None,
        on_joined: Any,
        max_pending: int,
    ) -> None:
        self.listener = listener
        self.secret = secret
        self.on_joined = on_joined
        self.stopping = False
        self._slots = threading.BoundedSemaphore(max_pending)
        self._wake_r, self._wake_w = os.pipe()
        self.thread = threading.Thread(target=self._run, name="ipcpool-remote-accept", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self.thread.join(2.0)
        self.listener.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.listener, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self.stopping:
            poller.poll()
            if self.stopping:
                return
            try:
                conn, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    select.select([self._wake_r], [], [], 0.1)
                    continue
                return
            if not self._slots.acquire(blocking=False):
                _refuse(conn, "too many handshakes in progress; try again")
                continue
            where = f"{peer[0]}:{peer[1]}"
            threading.Thread(
                target=self._handshake, args=(conn, where), name="ipcpool-remote-hs", daemon=True
            ).start()

    def _handshake(self, conn: socket.socket, peer: str) -> None:
        try:
            _io.configure(conn)
            deadline = time.monotonic() + HANDSHAKE_TIMEOUT
            hello, hello_raw = _io.recv_message(conn, deadline)
            if not isinstance(hello, wire.Hello):
                raise ProtocolError(f"expected HELLO, got {type(hello).__name__}")
            nonce = auth.nonce()
            proof = auth.server_proof(self.secret, hello_raw, nonce)
            challenge = wire.encode_challenge(nonce, self.secret is not None, proof)
            _io.send_all(conn, challenge, HANDSHAKE_TIMEOUT)
            msg, _raw = _io.recv_message(conn, deadline)
            if not isinstance(msg, wire.Proof):
                raise ProtocolError(f"expected PROOF, got {type(msg).__name__}")
            expected = auth.client_proof(self.secret, hello_raw, challenge, msg.ucx_address)
            if not auth.verify(expected, msg.proof):
                _refuse(conn, "authentication failed: wrong secret")
                return
            if self.stopping:
                _refuse(conn, "the server is closing")
                return
            conn.settimeout(None)
            self.on_joined(_Joined(conn, hello, msg.ucx_address, peer))
        except (ProtocolError, EndOfStream, TimeoutError, OSError) as exc:
            _refuse(conn, f"handshake failed: {exc}")
        except Exception as exc:  # never let a hostile peer kill the thread silently
            _refuse(conn, f"handshake failed: {exc!r}")
        finally:
            self._slots.release()


class RemoteServer:
    """Serve a local channel's frames to remote subscribers over UCX.

    Parameters
    ----------
    source:
        The bridge: a local subscriber of the producer's channel.  Use
        :func:`serve`, which opens it for you (GPU channel or host channel).
    listen:
        ``"host:port"`` of the control listener (default ``127.0.0.1:13337``;
        port 0 picks a free one).  A loopback host also restricts UCX to the
        loopback device.  Bind to another address only on a trusted network:
        UCX does not encrypt.
    token:
        The shared secret (at least 16 bytes; default ``$CUPY_IPCPOOL_TOKEN``).
        Required unless ``insecure=True``.
    insecure:
        Accept subscribers without a secret (for trying it out on one machine).
    max_subscribers:
        Further subscribers are refused.
    max_pending:
        Most handshakes in progress at once.
    send_timeout:
        How long writing a control message to a subscriber may block before it
        is dropped.
    linger:
        After the source ends, how long queued frames may take to drain.
    own_source:
        Close ``source`` when the server closes.

    Raises
    ------
    UsageError
        No secret and not ``insecure``; a bad ``listen`` address.
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
        token: str | bytes | None = None,
        insecure: bool = False,
        max_subscribers: int = 16,
        max_pending: int = 8,
        send_timeout: float = 5.0,
        linger: float = 5.0,
        own_source: bool = False,
    ) -> None:
        secret = auth.secret_from(token)
        if secret is None and not insecure:
            raise UsageError(
                "a remote server needs a shared secret: pass token=... (or set "
                f"${auth.TOKEN_ENV}); insecure=True serves without one"
            )
        host, port = wire.parse_address(listen)
        self._source = source
        self._own_source = own_source
        self._secret = secret
        self._max_subscribers = max_subscribers
        self._send_timeout = send_timeout
        self._linger = linger
        self._worker = ucx.Worker(loopback_only=ucx.is_loopback(host))
        self._book = ServerBook()
        self._remotes: dict[int, _Remote] = {}
        self._by_fd: dict[int, _Remote] = {}
        self._frames: dict[int, Any] = {}
        self._sends: list[_Send] = []
        self._closing_eps: list[Any] = []
        self._joined: collections.deque[_Joined] = collections.deque()
        self._incoming: collections.deque[Any] = collections.deque()
        self._source_end: tuple[str, bool] | None = None
        self._next_id = 1
        self._lock = threading.Lock()
        self._stop = False
        self._closed = False
        self.last_leave_reason = ""
        self.frames_received = 0
        self.frames_sent = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(min(max_subscribers + max_pending, socket.SOMAXCONN))
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            self._worker.close()
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            raise TransportError(
                exc.errno or errno.EADDRINUSE,
                f"cannot listen on {host}:{port}: {exc.strerror or exc}",
            ) from None
        bound = listener.getsockname()
        self.host, self.port = host, int(bound[1])
        self._acceptor = _Acceptor(listener, secret, self._on_joined, max_pending)
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
    def ucx_config(self) -> dict[str, str]:
        """The UCX configuration the server's worker uses."""
        return self._worker.config

    @property
    def running(self) -> bool:
        """True until the server loop ended (source ended and drained, or closed)."""
        return self._loop_thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the loop to end (the source ended); True if it did."""
        self._loop_thread.join(timeout)
        return not self._loop_thread.is_alive()

    # -- threads --

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _on_joined(self, joined: _Joined) -> None:
        self._joined.append(joined)
        self._wake()

    def _pump(self) -> None:
        source = self._source
        while not self._stop:
            try:
                frame = source.recv(0.2)
            except TimeoutError:
                continue
            except EndOfStream as exc:
                self._incoming.append((str(exc), exc.clean))
                break
            except Exception as exc:
                self._incoming.append((f"the source failed: {exc!r}", False))
                break
            self._incoming.append(frame)
            self._wake()
        self._wake()

    def _run(self) -> None:
        worker = self._worker
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        poller.register(worker.fileno(), select.POLLIN)
        self._poller = poller
        drain_deadline = None
        try:
            while not self._stop:
                worker.progress()
                self._reap_sends()
                while self._joined:
                    self._adopt(self._joined.popleft())
                while self._incoming:
                    item = self._incoming.popleft()
                    if isinstance(item, tuple):
                        self._source_end = item
                    else:
                        self._forward(item)
                if self._source_end is not None:
                    if drain_deadline is None:
                        drain_deadline = time.monotonic() + self._linger
                    if not self._book.retained_frames() or time.monotonic() > drain_deadline:
                        break
                worker.progress()
                self._reap_sends()
                if worker.arm():
                    timeout = 100 if self._source_end is not None else -1
                    for fd, _ev in poller.poll(timeout):
                        if fd == self._wake_r:
                            with contextlib.suppress(OSError):
                                os.read(self._wake_r, 4096)
                            continue
                        remote = self._by_fd.get(fd)
                        if remote is not None:
                            self._read(remote)
        except Exception as exc:  # pragma: no cover - a bug: end the sessions, say why
            warnings.warn(f"the remote server loop failed: {exc!r}", RuntimeWarning, stacklevel=1)
            self._source_end = (f"the server failed: {exc!r}", False)
        finally:
            self._shutdown()

    # -- loop internals --

    def _adopt(self, joined: _Joined) -> None:
        hello = joined.hello
        if len(self._remotes) >= self._max_subscribers:
            _refuse(joined.sock, f"the server already has max_subscribers={self._max_subscribers}")
            return
        if self._source_end is not None:
            _refuse(joined.sock, "the stream has ended")
            return
        sub_id = self._next_id
        self._next_id += 1
        key = secrets.randbits(32)
        try:
            endpoint = self._worker.connect(joined.ucx_address)
        except Exception as exc:
            _refuse(joined.sock, f"cannot reach the subscriber's UCX worker: {exc}")
            return
        mode = wire.MODE_NAMES[hello.mode]
        info = RemoteInfo(sub_id, joined.peer, mode, hello.num_slots)
        remote = _Remote(info, joined.sock, endpoint, key)
        next_seq = getattr(self, "_last_seq", -1) + 1
        welcome = wire.encode_welcome(
            sub_id, key, next_seq, int(self._source.slot_nbytes), wire.MAX_ARRAYS
        )
        try:
            _io.send_all(joined.sock, welcome, self._send_timeout)
            joined.sock.setblocking(False)
        except OSError:
            joined.sock.close()
            ucx.close_endpoint(endpoint)
            return
        self._book.add_subscriber(sub_id, mode, hello.num_slots)
        with self._lock:
            self._remotes[sub_id] = remote
        self._by_fd[joined.sock.fileno()] = remote
        self._poller.register(joined.sock, select.POLLIN)

    def _forward(self, frame: Any) -> None:
        seq = int(frame.seq)
        self._last_seq = seq
        self.frames_received += 1
        self._frames[seq] = frame
        for sub_id, slot in self._book.offer(seq):
            self._start_send(sub_id, seq, slot)
        if not self._book.retained(seq):
            self._release(seq)

    def _start_send(self, sub_id: int, seq: int, slot: int) -> None:
        remote = self._remotes.get(sub_id)
        frame = self._frames[seq]
        if remote is None:  # pragma: no cover - the book only names live subscribers
            if self._book.sent(sub_id, seq):
                self._release(seq)
            return
        try:
            from ._host import spec_of

            specs = tuple(spec_of(a) for a in frame.arrays)
            header = wire.encode_frame(seq, slot, specs, frame.metadata)
            _io.send_all(remote.sock, header, self._send_timeout)
            remote.sock.setblocking(False)
            requests = [
                self._worker.send(remote.endpoint, a, wire.data_tag(remote.key, seq, i))
                for i, a in enumerate(frame.arrays)
            ]
        except Exception as exc:
            if self._book.sent(sub_id, seq):
                self._release(seq)
            self._drop(remote, f"sending frame {seq} failed: {exc}")
            return
        self._sends.append(_Send(sub_id, seq, requests))
        self.frames_sent += 1

    def _reap_sends(self) -> None:
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
        frame = self._frames.pop(seq, None)
        if frame is not None:
            try:
                frame.release()
            except Exception as exc:
                warnings.warn(
                    f"releasing frame {seq} failed: {exc!r}", TeardownWarning, stacklevel=2
                )

    def _read(self, remote: _Remote) -> None:
        try:
            messages, eof = remote.reader.feed(remote.sock)
            for msg in messages:
                if type(msg) is wire.Credit:
                    start = self._book.credit(remote.info.sub_id, msg.slot)
                    if start is not None:
                        self._start_send(remote.info.sub_id, start[0], start[1])
                    if remote.info.sub_id not in self._remotes:
                        return
                elif type(msg) is wire.Bye:
                    self._drop(remote, "said BYE", bye=False)
                    return
                else:
                    raise ProtocolError(f"unexpected {type(msg).__name__} from a subscriber")
        except ProtocolError as exc:
            self._drop(remote, f"protocol error: {exc}")
            return
        if eof:
            self._drop(remote, "disconnected")

    def _drop(self, remote: _Remote, reason: str, *, bye: bool = False) -> None:
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
        if bye:
            with contextlib.suppress(OSError):
                remote.sock.send(wire.encode_bye(), socket.MSG_DONTWAIT)
        with contextlib.suppress(OSError):
            remote.sock.shutdown(socket.SHUT_RDWR)
        remote.sock.close()
        for seq in self._book.remove_subscriber(sub_id):
            self._release(seq)
        req = ucx.close_endpoint(remote.endpoint)
        if req is not None:
            self._closing_eps.append((req, remote.endpoint))

    def _shutdown(self) -> None:
        """End every session, wait (bounded) for sends to finish, release every frame."""
        end = self._source_end
        clean = end is None or end[1]
        for remote in list(self._remotes.values()):
            self._drop(remote, "the server closed" if end is None else end[0], bye=clean)
        deadline = time.monotonic() + 2.0
        while (self._sends or self._closing_eps) and time.monotonic() < deadline:
            self._worker.progress()
            self._reap_sends()
            self._closing_eps = [
                (r, e) for r, e in self._closing_eps if ucx.request_state(r) is None
            ]
            if self._sends or self._closing_eps:
                time.sleep(0.002)
        if self._sends:
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
            _refuse(self._joined.popleft().sock, "the server is closing")
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
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- sources ------------------------------------------------------------------------


class _DeviceFrame:
    __slots__ = ("_frame", "_stream", "arrays", "metadata", "seq")

    def __init__(self, frame: Any, arrays: tuple[Any, ...], stream: Any) -> None:
        self._frame = frame
        self._stream = stream
        self.seq = frame.seq
        self.arrays = arrays
        self.metadata = frame.metadata

    def release(self) -> None:
        self.arrays = ()
        self._frame.release(self._stream)


class DeviceSource:
    """The bridge over a GPU channel: :func:`cupy_ipcpool.subscribe` on ``device``.

    Each frame's stream is synchronised on the host before UCX reads the
    slot (UCX copies on its own streams, which do not wait on the channel's
    GPU-side flag).  Non-contiguous arrays are copied to contiguous ones.
    """

    def __init__(
        self,
        address: str | os.PathLike[str],
        *,
        mode: str = "block",
        credit: int | None = None,
        device: int | None = None,
        timeout: float = 10.0,
        allowed_uids: Iterable[int] | None = None,
    ) -> None:
        from .._arrays import cupy_module
        from ..channel import subscribe

        self._cp = cupy_module()
        self._sub = subscribe(
            address,
            mode=mode,
            credit=credit,
            device=device,
            timeout=timeout,
            allowed_uids=allowed_uids,
        )
        self.slot_nbytes = self._sub.peer.slot_nbytes
        self.device = self._sub.peer.device
        self._stream: Any = None

    def recv(self, timeout: float | None = None) -> _DeviceFrame:
        cp = self._cp
        with cp.cuda.Device(self.device):
            if self._stream is None:
                self._stream = cp.cuda.Stream(non_blocking=True)
            stream = self._stream
            frame = self._sub.recv(timeout, stream=stream)
            with stream:
                arrays = tuple(
                    a if a.flags.c_contiguous else cp.ascontiguousarray(a) for a in frame.arrays
                )
            stream.synchronize()
        return _DeviceFrame(frame, arrays, stream)

    def close(self) -> None:
        self._sub.close()


def serve(
    address: str | os.PathLike[str],
    *,
    listen: str = f"127.0.0.1:{wire.DEFAULT_PORT}",
    token: str | bytes | None = None,
    insecure: bool = False,
    memory: str = "device",
    mode: str = "block",
    credit: int | None = None,
    device: int | None = None,
    max_subscribers: int = 16,
    timeout: float = 10.0,
    linger: float = 5.0,
) -> RemoteServer:
    """Serve the channel at ``address`` (a local socket path) to remote subscribers.

    Parameters
    ----------
    address:
        The producer's channel: a :class:`cupy_ipcpool.Publisher` socket
        (``memory="device"``) or a :class:`HostChannelPublisher` socket
        (``memory="host"``).
    listen, token, insecure, max_subscribers, linger:
        See :class:`RemoteServer`.
    mode, credit:
        How the bridge subscribes locally.  ``"block"`` (default): the bridge
        receives every frame, so remote ``"block"`` subscribers miss none (and
        can slow the producer, as local ones can).  ``"latest"``: the remote
        side never slows the producer; every remote subscriber may miss frames.
    device:
        GPU the bridge maps the producer's pool on (default: the producer's).
    timeout:
        Seconds to connect to the local channel.

    Returns
    -------
    RemoteServer
        Already serving; close it (or use it as a context manager) when done.
    """
    source: Any
    if memory == "device":
        source = DeviceSource(address, mode=mode, credit=credit, device=device, timeout=timeout)
    elif memory == "host":
        from ._host import HostChannelSubscriber

        source = HostChannelSubscriber(
            address, mode=mode, credit=credit, timeout=timeout, writable=True
        )
    else:
        raise UsageError(f"memory must be 'device' or 'host', not {memory!r}")
    try:
        return RemoteServer(
            source,
            listen=listen,
            token=token,
            insecure=insecure,
            max_subscribers=max_subscribers,
            linger=linger,
            own_source=True,
        )
    except BaseException:
        source.close()
        raise
