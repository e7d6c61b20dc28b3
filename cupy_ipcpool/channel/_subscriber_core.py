"""The consumer side of a channel session, without the GPU parts: :class:`SubscriberCore`.

It connects to a publisher's socket, receives frames and releases them.  The
GPU layer (:mod:`._subscriber`) wraps it: it maps the slots from the WELCOME
and turns each frame's payload into arrays.

Hot path (``recv``/``release``): the caller's thread, one ``recv``/``send``
per message, ``poll(2)`` for waiting; the socket work of each step is one
compiled call (``recv_frame``, ``release_frame``).  One rule decides whether a
frame taken from the socket is handed out (:meth:`SubscriberCore._revoked`):
only if, after it was received, the publisher had not hung up with an
eviction notice queued.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import socket
import time
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, NoReturn

from .._compiled import loader
from .._errors import (
    ChannelTimeoutError,
    EndOfStream,
    EvictedError,
    PoolClosedError,
    ProtocolError,
    TransportError,
    UsageError,
)
from .._transport import allowed_uid_set, check_socket_path
from .._transport._closing import ClosedFlag, close_in_forked_children
from . import _protocol as proto
from . import _sockets
from ._protocol import Frame
from ._sockets import (
    _FRAME_HEAD_SIZE,
    _POLLOUT,
    _POLLRDHUP,
    DEFAULT_BLOCK_CREDIT,
    _ms,
    _say_bye_and_close,
    _spin_ns,
    _warn,
)

if TYPE_CHECKING:  # the engine is loaded at the first subscriber (_engine below)
    from .._engine import OwedReleases

#: The longest handshake the engine takes (a C int of milliseconds: 24.8 days).
_MAX_TIMEOUT_MS = 2**31 - 1
#: the engine, for its frame ledger (FrameLedger: rule 1 and the frames held)
_engine = loader("cupy_ipcpool._engine", PROTOCOL=proto.ENGINE_PROTOCOL)
#: Most fds :meth:`SubscriberCore.watch` takes (the compiled poll set holds 16, the socket too).
_MAX_WATCHED = 15


def _close_subscriber(sock: socket.socket, fds: list[int], owed: OwedReleases, pid: int) -> None:
    """Tear a subscriber made in process ``pid`` down (also its finalizer); warns instead
    of raising.

    The RELEASEs still ``owed`` go first, as far as the socket takes them now
    (the hang-up returns every lease anyway), then the BYE.

    In another process (a child forked from ``pid``: it dropped its copy of the
    subscriber, exited holding it, or called ``close()``) the connection is the
    parent's: no RELEASE, no BYE, nothing read from the socket and its flags
    (shared with the parent) left as they are; only this process's copies of the
    socket and of the slot fds are closed, which the parent does not notice.
    """
    if os.getpid() != pid:  # a forked child: our copies only
        owed.clear()  # this process's memory: the parent's queue is its own
        try:
            sock.close()  # close(2) of our copy: no shutdown, the parent's stays open
        except OSError as exc:
            _warn(f"closing the subscriber socket failed: {exc!r}")
    try:
        if sock.fileno() >= 0:  # (-1 once closed: in a forked child, on to the slot fds)
            with contextlib.suppress(OSError):
                owed.flush(sock.fileno())
            owed.clear()
            _say_bye_and_close(sock)
    except Exception as exc:
        _warn(f"closing the subscriber socket failed: {exc!r}")
    while fds:
        fd = fds.pop()
        try:
            os.close(fd)
        except OSError as exc:
            _warn(f"closing slot fd {fd} failed: {exc}")


class SubscriberCore(ClosedFlag):
    """The consumer side of a channel: subscribe, receive frames, release them.

    Parameters
    ----------
    address:
        Filesystem path of the publisher's socket.
    mode:
        ``"block"``: receive every frame, the producer waits for releases;
        ``"latest"``: frames are skipped while ``credit`` are held;
        ``"ahead"``: as ``"block"`` here (the GPU layer takes frames ahead of
        their messages).
    credit:
        Most frames held at once; default 1 for ``"latest"``, 64 otherwise.
        The publisher may grant less (its ``max_credit``): :attr:`credit` is
        the credit granted.
    hello:
        Opaque bytes for the publisher (at most 64 KiB).
    timeout:
        Seconds for connect and handshake together (a full listen backlog is
        retried until then).
    allowed_uids:
        Uids the publisher may run as (``SO_PEERCRED``); default: own euid.
    spin_us:
        Microseconds :meth:`recv` busy-polls the socket before it sleeps in
        ``poll(2)`` (default 0: sleep at once, no CPU while idle).  A few tens
        of microseconds save the scheduler's wake-up latency when frames come
        at a high rate, at the cost of that much CPU per call.

    Attributes
    ----------
    credit:
        The credit the publisher granted.
    lease_timeout:
        Seconds the publisher lets this subscriber hold a frame before it
        evicts it (None: no limit).

    Raises
    ------
    PeerRefusedError
        The publisher refused (the reason is in the message) or runs as a uid
        not allowed here.
    TransportError
        Connecting failed (no publisher, no permission).
    ChannelTimeoutError
        No WELCOME within ``timeout`` (or the backlog stayed full).
    ProtocolError
        The publisher's reply is malformed.
    EndOfStream
        The publisher closed or reset the connection during the handshake.
    """

    def __init__(
        self,
        address: str | os.PathLike[str],
        *,
        mode: str = "block",
        credit: int | None = None,
        hello: bytes = b"",
        timeout: float = 10.0,
        allowed_uids: Iterable[int] | None = None,
        spin_us: float = 0.0,
    ) -> None:
        _sockets._load_frameio()
        if mode not in proto.MODE_CODES:
            raise UsageError(f"mode must be 'block', 'latest' or 'ahead', not {mode!r}")
        self.spin_ns = _spin_ns(spin_us)
        if credit is None:
            credit = 1 if mode == "latest" else DEFAULT_BLOCK_CREDIT
        self.address = os.fspath(address)
        self.mode = mode
        self.credit = int(credit)
        self.lease_timeout: float | None = None
        allowed = allowed_uid_set(allowed_uids, os.geteuid())
        self._eos: str | None = None
        self._eos_clean = False
        self._evicted = False
        self._backlog: collections.deque[bytes] = collections.deque()
        #: what the read of everything queued at the publisher's hang-up found
        #: (:meth:`_scan_after_hangup`): None (not read yet), "bye" (a BYE: the frames
        #: before it are handed out) or "bad" (a malformed eviction notice: none is)
        self._hangup_read: str | None = None
        self._closed = False
        # the engine's handshake (the C subscriber's): connect, who is there, HELLO,
        # WELCOME; it raises each failure as what it is and leaves nothing open then
        (
            sock_fd,
            self.producer_pid,
            self.producer_uid,
            self.sub_id,
            self.num_slots,
            self.next_seq,
            self.credit,
            lease_timeout_ms,
            self.welcome_payload,
            self._fds,
        ) = _engine().handshake(
            check_socket_path(self.address),
            proto.MODE_CODES[mode],
            self.credit,
            hello,
            sorted(allowed),
            min(_ms(timeout), _MAX_TIMEOUT_MS),
        )
        try:
            #: rule 1 (the order of frames, one held per slot), the frames held and those
            #: released ahead of their message: the engine's ledger, the C subscriber's
            self._ledger = _engine().FrameLedger(self.num_slots, self.next_seq)
            #: the engine's queue of RELEASEs the socket did not take yet (bounded by the
            #: ring): sent before any other, at the next recv or release
            self._owed: OwedReleases = _engine().OwedReleases(self.num_slots)
            # blocking from now on: every call that must not wait passes MSG_DONTWAIT
            self._sock = socket.socket(fileno=sock_fd)
            self._sock.setblocking(True)
        except BaseException:
            os.close(sock_fd)
            for fd in self._fds:
                os.close(fd)
            raise
        #: the process that made it: in another (a forked child) closing touches nothing
        #: of the parent's connection (_close_subscriber)
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(
            self, _close_subscriber, self._sock, self._fds, self._owed, self._pid
        )
        close_in_forked_children(self)  # a child's copy would hide this process's death
        if lease_timeout_ms:
            self.lease_timeout = lease_timeout_ms / 1000.0
        self._buf = bytearray(proto.MAX_FRAME_SIZE + 1)
        self._view = memoryview(self._buf)
        self._hangup = select.poll()
        self._hangup.register(self._sock, _POLLRDHUP)
        self._sock_fd = self._sock.fileno()
        # the same check for the compiled per-frame calls (recv_frame, release_frame)
        self._hup_pairs: list[tuple[int, int]] = [(self._sock_fd, _POLLRDHUP)]
        self._hup_set = _sockets.pollfds(self._hup_pairs)
        self._waited = False  # the last recv had to wait for its frame
        #: True once a hang-up (or a watched fd, :meth:`watch`) was seen: from then on
        #: the caller should look at its own death signals for every frame.
        self.alarm = False

    def watch(self, fd: int) -> None:
        """Add ``fd`` (readable = trouble, e.g. the producer's pidfd) to the hang-up check.

        The check that :meth:`recv` and :meth:`connected` make anyway (one
        ``poll(0)``) then covers it too: when it fires, :attr:`alarm` is set
        and :meth:`connected` answers False.  This saves the caller a system
        call per frame.
        """
        pairs = [p for p in self._hup_pairs if p[0] != fd] + [(fd, select.POLLIN)]
        if len(pairs) > _MAX_WATCHED + 1:
            raise UsageError(f"at most {_MAX_WATCHED} fds can be watched")
        self._hangup.register(fd, select.POLLIN)
        self._hup_pairs = pairs
        self._hup_set = _sockets.pollfds(pairs)

    def _hung_up(self) -> bool:
        """One ``poll(0)`` of the socket's hang-up and the watched fds; True if any fired.

        Reads what is still queued when the socket itself hung up (to notice an
        eviction notice).
        """
        ready = self._hangup.poll(0)
        if not ready:
            return False
        self.alarm = True
        if any(fd == self._sock_fd for fd, _ev in ready):
            self._scan_after_hangup()
        return True

    # -- context manager / teardown --

    def close(self) -> None:
        """Say BYE, close the socket and every fd not taken. Idempotent; never raises.

        In a process other than the one that made the subscriber (a child forked
        from it, which does this at the fork) the connection is the parent's:
        nothing is sent or read (no RELEASE owed, no BYE, the parent's frames left
        queued for it) and the socket's flags are left alone; only this process's
        copies of the socket and of the fds not taken are closed.  Either way the
        subscriber is closed here from then on (its calls raise
        :class:`PoolClosedError`); returns None.
        """
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def _closed_error(self) -> PoolClosedError:
        if os.getpid() != self._pid:
            return PoolClosedError(
                f"this subscriber was made in process {self._pid}; a child created by fork "
                "closes its copy at once (a channel end belongs to the process that made it: "
                "subscribe in the child, or start it with spawn)"
            )
        return PoolClosedError("the subscriber is closed")

    def fileno(self) -> int:
        """The socket's fd, readable when a frame (or the end) is waiting."""
        return self._sock.fileno()

    def take_fds(self) -> list[int]:
        """Return the slot fds from the WELCOME; the caller owns (and closes) them now."""
        fds = list(self._fds)
        self._fds.clear()
        return fds

    @property
    def held(self) -> dict[int, int]:
        """Frames received and not yet released, as ``{seq: slot}``."""
        return self._ledger.held

    # -- hot path --

    def recv(self, timeout: float | None = None) -> Frame:
        """Wait for the next frame; the caller holds a lease on it until :meth:`release`.

        Parameters
        ----------
        timeout:
            Seconds to wait (None: forever).

        Returns
        -------
        Frame
            ``(seq, slot, payload)``.

        Raises
        ------
        EvictedError
            The publisher dropped this subscriber while it held frames (lease
            timeout, full socket): the frames it holds may be overwritten and
            must not be read (and on every later call).
        EndOfStream
            The publisher said BYE, closed or died (and on every later call).
        ChannelTimeoutError
            No frame within ``timeout`` (also a ``TimeoutError``).
        ProtocolError
            The publisher sent something malformed; the connection is closed.
        PoolClosedError
            This subscriber is closed.
        """
        seq, slot, payload = self.recv_view(timeout)
        return Frame(seq, slot, bytes(payload))

    def recv_view(self, timeout: float | None = None) -> tuple[int, int, memoryview | bytes]:
        """:meth:`recv`, answering ``(seq, slot, payload)`` without a :class:`Frame` object.

        ``payload`` may be a view of this subscriber's receive buffer: it is
        valid until the next ``recv``/``recv_view`` (copy what must last).
        Raises as :meth:`recv`.
        """
        got = self.next_view(timeout)
        if got is None:
            raise ChannelTimeoutError.no_frame(timeout)
        return got

    def next_view(self, timeout: float | None = None) -> tuple[int, int, memoryview | bytes] | None:
        """:meth:`recv_view`, answering None when no frame came within ``timeout``.

        The per-frame path of the GPU subscriber: a look that finds nothing
        (``timeout=0``, the usual answer of an ``"ahead"`` subscriber's drain)
        costs no exception.  Raises as :meth:`recv` otherwise.
        """
        if self._closed:
            raise self._closed_error()
        if self._eos is not None:
            self._raise_end()
        if self._backlog:
            return self._from_backlog()
        if self._owed:  # RELEASEs the socket did not take before: first
            timeout = self._wait_owed(timeout)
            if self._eos is not None:
                self._raise_end()
            if timeout is not None and timeout < 0.0:
                self._waited = True
                return None
        # One compiled call: the wait (poll(2) of the socket and the hang-up set),
        # the receive, the FRAME's header, and the hang-up check after the receive;
        # with spin_us, non-blocking receives of the same call first.
        try:
            if self.spin_ns and timeout != 0:
                got = self._recv_frame_spinning(timeout)
            else:
                got = _sockets.recv_frame(
                    self._sock_fd,
                    self._buf,
                    -1 if timeout is None else _ms(timeout),
                    self._waited,
                    self._hup_set,
                )
        except OSError as exc:
            self._failed_recv(exc)
            return self._from_backlog()
        if got is None:
            self._waited = True
            return None
        n, seq, slot, self._waited = got
        if seq >= 0:
            # a well-formed FRAME and no hang-up: what _accept checks besides
            try:
                self._ledger.take(seq, slot)
            except ProtocolError as exc:
                self._protocol_error(exc)
            return seq, slot, self._view[_FRAME_HEAD_SIZE:n]
        if n == 0:
            self._end("the publisher closed the connection")
        msg = self._accept(self._view[:n])
        return msg.seq, msg.slot, msg.payload

    def _from_backlog(self) -> tuple[int, int, bytes]:
        msg = self._accept(self._backlog.popleft())
        return msg.seq, msg.slot, msg.payload

    def _recv_frame_spinning(self, timeout: float | None) -> tuple[int, int, int, bool] | None:
        """``recv_frame``, busy-polling (non-blocking receives) up to ``spin_us`` first.

        Returns what ``recv_frame`` returns; None when nothing came within
        ``timeout``.  A frame taken while spinning gets the same compiled header
        and hang-up checks as one that was waited for.
        """
        fd, buf, hup = self._sock_fd, self._buf, self._hup_set
        clock = time.perf_counter_ns
        start = clock()
        spin = self.spin_ns if timeout is None else min(self.spin_ns, int(timeout * 1e9))
        end = start + spin
        while True:
            got = _sockets.recv_frame(fd, buf, 0, False, hup)
            if got is not None:
                return got
            now = clock()
            if now >= end:
                break
        if timeout is None:
            return _sockets.recv_frame(fd, buf, -1, True, hup)
        left = timeout - (now - start) / 1e9
        if left <= 0.0:
            return None
        return _sockets.recv_frame(fd, buf, _ms(left), True, hup)

    def _failed_recv(self, exc: OSError) -> None:
        """A receive failed: return if frames are queued behind a reset (take those), else end."""
        if isinstance(exc, ConnectionResetError):
            # Reported once, before what is still queued (a dropped subscriber's
            # notice among it): look there first.
            self._scan_after_hangup()
            if self._eos is not None:
                self._raise_end()
            if self._backlog:
                return
            self._end("the connection to the publisher was reset")
        self._end(f"the connection to the publisher failed: {exc}")

    def _protocol_error(self, exc: ProtocolError | str) -> NoReturn:
        """Close the connection after a protocol error and raise it."""
        if isinstance(exc, str):
            exc = ProtocolError(exc)
        self._eos = f"the connection was closed after a protocol error: {exc}"
        _close_subscriber(self._sock, [], self._owed, self._pid)
        raise exc

    def _accept(self, data: bytes | memoryview) -> Frame:
        """Judge one message from the publisher (the engine's judge, the C subscriber's);
        return it if it is a frame we may use."""
        try:
            # a FRAME is taken by rule 1 before the hang-up is looked at: a bad frame is a
            # protocol error either way
            got = self._ledger.judge(data)
        except ProtocolError as exc:
            self._protocol_error(exc)
        if got[0] == "frame":
            _kind, seq, slot, held, payload = got
            if self._revoked():
                if held:  # never handed out: not held
                    self._ledger.release(seq, slot)
                self._raise_revoked()
            return Frame(seq, slot, payload)
        if got[0] == "bye":
            self._end("the publisher said BYE", clean=True)
        self._evict(got[1])

    def _revoked(self) -> bool:
        """Whether a FRAME just taken from the socket (or the backlog) must not be handed out.

        The one rule for every frame: it is handed out only if, after it was
        received, the connection had not hung up, or had hung up with a BYE
        queued behind it and no eviction notice (well-formed or not) before
        that BYE.  A hang-up without BYE (the publisher died, or dropped this
        subscriber) hands out nothing still queued: the publisher takes a
        connection's leases back when it ends, so those slots may be written
        again.  The publisher queues its notice and hangs up before it takes
        an evicted subscriber's leases back, so a hang-up not seen here came
        after the frame was handed out.  After a hang-up everything still
        queued is read once (:meth:`_scan_after_hangup`).  (The compiled
        ``recv_frame`` makes the same check after its receive and hands every
        frame it cannot vouch for to this one.)
        """
        if self._eos is not None:
            return True
        if self._hangup_read is None and not self._hung_up():
            return False
        return self._eos is not None or self._hangup_read == "bad"

    def _raise_revoked(self) -> NoReturn:
        """End for a revoked frame: the end found, or the malformed notice queued."""
        if self._eos is None:
            self._from_backlog()  # the malformed notice: a ProtocolError
        self._raise_end()

    def _scan_after_hangup(self) -> None:
        """Read everything still queued (the publisher has hung up), once, and judge it.

        The engine's verdict (``hangup_verdict``, the C subscriber's): the
        first BYE or REFUSE decides.  An eviction notice ends the stream as
        evicted; a malformed one (the publisher's notice cannot be read)
        leaves only itself queued, so the next receive raises
        :class:`ProtocolError` and no frame queued is handed out; a BYE keeps
        the messages up to it (nothing after a BYE counts); a hang-up without
        either drops every frame still queued and ends the stream (``clean``
        False).
        """
        self.alarm = True
        if self._hangup_read is not None or self._eos is not None:
            return
        got: list[bytes] = list(self._backlog)
        if self._sock.fileno() >= 0:  # the engine's read of a hang-up, the C subscriber's
            _engine().hangup_drain(self._sock.fileno(), got)
        self._backlog.clear()
        verdict, at = _engine().hangup_verdict(got)  # the C subscriber's verdict
        if verdict == "bad":
            self._hangup_read = "bad"
            self._backlog.append(got[at])
            return
        if verdict == "evicted":
            msg = proto.decode(got[at])
            assert type(msg) is proto.Refuse
            self._evicted = True
            self._eos = f"the publisher evicted this subscriber: {msg.reason}"
            return
        if verdict == "bye":
            self._hangup_read = "bye"
            self._backlog.extend(got[: at + 1])
            return
        self._eos = (
            "the publisher hung up without BYE (it exited, or dropped this subscriber); "
            "frames still queued are dropped"
        )

    def _evict(self, reason: str) -> NoReturn:
        self._evicted = True
        self._eos = f"the publisher evicted this subscriber: {reason}"
        self._backlog.clear()
        self._raise_end()

    def _raise_end(self) -> NoReturn:
        assert self._eos is not None
        if self._evicted:
            raise EvictedError(self._eos, False)
        raise EndOfStream(self._eos, self._eos_clean)

    def _end(self, reason: str, clean: bool = False) -> NoReturn:
        self._eos = reason
        self._eos_clean = clean
        raise EndOfStream(reason, clean)

    @property
    def evicted(self) -> bool:
        """True once the publisher evicted this subscriber (see :class:`EvictedError`)."""
        return self._evicted

    def connected(self) -> bool:
        """False once the publisher has hung up on this subscriber (ended, died or evicted it).

        One ``poll(0)``; after a hang-up it reads what is still queued, to
        notice an eviction notice (frames queued before a BYE stay for
        :meth:`recv`).  The GPU subscriber asks before it writes its read flag
        in the sync page: an evicted subscriber's row may already belong to a
        newer subscriber, which a late write of an older generation would
        disturb.  (A publisher that evicts between this call and the write is
        not caught: the window is one flag write.)
        """
        if self._closed or self._eos is not None:
            return False
        return not self._hung_up()

    def release(self, seq: int, slot: int) -> None:
        """Return the lease on frame ``seq`` in ``slot``; never waits.

        A RELEASE the socket does not take (the publisher is not reading) is
        kept and sent, in order, at the next :meth:`recv` or release that finds
        room.  After the publisher ended, releasing only forgets the frame locally.

        Raises
        ------
        EvictedError
            The publisher evicted this subscriber: the lease had already been
            taken back, the frame's slot may have been overwritten before this
            release (the frame is forgotten locally all the same).
        ProtocolError
            This subscriber does not hold that frame (never received, released
            twice, wrong slot); nothing is sent.
        TransportError
            The publisher has not read this subscriber's RELEASEs for longer
            than any credit explains; the subscription is closed.
        PoolClosedError
            This subscriber is closed.
        """
        self._release_held(seq, slot)
        self._send_release(seq, slot)

    def _send_release(self, seq: int, slot: int) -> None:
        """RELEASE of frame ``seq`` (forgotten already), unless the publisher ended; never
        waits: behind the RELEASEs still owed, or owed itself if the socket is full."""
        if self._eos is not None:
            if self._evicted:
                self._raise_end()
            return
        try:
            self._owed.send(self._sock_fd, seq, slot)  # or owed, behind those owed already
        except TransportError as exc:  # more owed than any credit explains
            self._owed_too_long(exc)
        except OSError as exc:
            self._release_not_sent(exc)

    def release_ahead(self, seq: int, slot: int) -> None:
        """Return the lease on frame ``seq`` in ``slot`` before its FRAME message came.

        An ``"ahead"`` subscriber hands frames out before their messages
        (channel/_ahead.py) and may release one at once: its RELEASE goes now,
        and the publisher of the fixed schedule (``ahead=True``) ends the lease
        as it publishes the frame, or at once if it did.  The frame's message,
        when it comes, is not held.  After the publisher ended, nothing is sent.

        Raises
        ------
        EvictedError
            The publisher evicted this subscriber.
        ProtocolError
            ``seq`` was received by message, or released ahead already,
            ``slot`` is not one of the ring's, or ``num_slots`` frames are
            released ahead already (no schedule explains more); nothing is
            sent.
        TransportError
            The publisher has not read this subscriber's RELEASEs for longer
            than any credit explains; the subscription is closed.
        PoolClosedError
            This subscriber is closed.
        """
        if self._closed:
            raise self._closed_error()
        self._ledger.release_ahead(seq, slot)
        if self._eos is not None:
            if self._evicted:
                self._raise_end()
            return
        self._send_release(seq, slot)

    def release_with_write(
        self, seq: int, slot: int, fn: int, stream: int, addr: int, value: int, flags: int
    ) -> int:
        """:meth:`release`, preceded by a stream memory operation unless the publisher hung up.

        The GPU subscriber's release in one compiled call
        (the engine's ``release_frame``): the hang-up check of :meth:`connected`;
        if the publisher is still there, ``fn(stream, addr, value, flags)``
        (the driver's ``cuStreamWriteValue32`` of the read flag, as
        ``_fastpath.memop`` calls it); then the RELEASE.  After a hang-up the
        operation is skipped (an evicted subscriber's row may belong to
        another subscriber by now) and the frame is released as by
        :meth:`release`.

        Returns
        -------
        int
            0, or the driver's error code: then nothing was written or sent
            and the frame is still held.

        Raises
        ------
        As :meth:`release`.
        """
        # forgotten before the RELEASE can reach the publisher: the slot's next frame
        # may then come at once (to a recv of another thread, say)
        self._release_held(seq, slot)
        if self._eos is not None:
            self._send_release(seq, slot)
            return 0
        # with RELEASEs owed that the socket does not take yet, the write alone (fd -1)
        # and this RELEASE behind them
        owing = bool(self._owed) and not self._flush_owed()
        try:
            rc = _sockets.release_frame(
                -1 if owing else self._sock_fd,
                self._hup_set,
                fn,
                stream,
                addr,
                value,
                flags,
                seq,
                slot,
            )
        except BlockingIOError:  # the flag was written; the socket is full
            self._owe(seq, slot)
            return 0
        except OSError as exc:  # the flag was written; the RELEASE did not go
            self._release_not_sent(exc)
            return 0
        if rc == 0 and owing:
            self._owe(seq, slot)
        elif rc < 0:  # hung up: no write (as connected() answers False)
            self._hung_up()
            self._send_release(seq, slot)
            return 0
        if rc > 0:  # the driver failed: nothing written or sent, the frame still held
            self._ledger.hold_again(seq, slot)
        return rc

    def _release_held(self, seq: int, slot: int) -> None:
        """Forget frame ``seq`` in ``slot``; raise unless this open subscriber holds it."""
        if self._closed:
            raise self._closed_error()
        self._ledger.release(seq, slot)

    def _release_not_sent(self, exc: OSError) -> None:
        """A RELEASE's send failed other than for room: the publisher is gone; was this
        subscriber dropped?  The RELEASEs owed are moot (the hang-up returned every lease)."""
        self._owed.clear()
        self._scan_after_hangup()
        if self._evicted:
            self._raise_end()

    def _flush_owed(self) -> bool:
        """Send the RELEASEs owed, oldest first, as far as the socket takes them now;
        True when none is owed any more."""
        if self._eos is not None:
            self._owed.clear()  # nobody to send them to: the connection's end returned them
            return True
        try:
            return bool(self._owed.flush(self._sock_fd))
        except OSError as exc:
            self._release_not_sent(exc)  # clears them
        return True

    def _owe(self, seq: int, slot: int) -> None:
        """Keep a RELEASE the socket did not take, behind the ones owed already (the
        engine's queue: past ``MAX_CREDIT + num_slots`` no credit explains it, the end)."""
        try:
            self._owed.owe(seq, slot)
        except TransportError as exc:
            self._owed_too_long(exc)

    def _owed_too_long(self, exc: TransportError) -> NoReturn:
        """The engine refused to keep another RELEASE (``exc``): close, and raise it."""
        self._eos = exc.strerror
        _close_subscriber(self._sock, [], self._owed, self._pid)
        raise exc

    def _wait_owed(self, timeout: float | None) -> float | None:
        """Before a receive while RELEASEs are owed: send them as the socket takes them,
        until none is owed or something arrives to read (or a watched fd fires).

        Returns the timeout left for the receive (``-1.0``: it ran out first).
        """
        poller = select.poll()
        poller.register(self._sock_fd, select.POLLIN | _POLLOUT | _POLLRDHUP)
        for fd, events in self._hup_pairs[1:]:
            poller.register(fd, events)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._flush_owed():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0.0:
                return -1.0
            ready = poller.poll(-1 if left is None else _ms(left))
            if any(fd != self._sock_fd or ev & ~_POLLOUT for fd, ev in ready):
                break  # a message, a hang-up or a watched fd: the receive takes it
        if deadline is None:
            return None
        return max(0.0, deadline - time.monotonic())


__all__ = ["SubscriberCore"]
