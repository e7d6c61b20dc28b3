"""One table of consumer scenarios, run against both consumers of the protocol layer.

Each scenario drives a real publisher -- the library's :class:`PublisherCore` over
memfd slots in a spawned process (``test_c_library.Producer``), or a fake one for
malformed input -- and asserts what a user of a consumer relies on: what is refused,
which frames arrive, that a release gives the lease back, how a stream ends.  It
runs once per consumer, through one adapter interface (:class:`Consumer`):

- ``python``: the session core, :class:`SubscriberCore`, with the memfd slots
  mapped as ``_memfd_backend.MemfdConsumer`` maps them, in this process;
- ``c``: the C library's raw session (``cip_sub_open_raw``) in the
  ``c/tests/cip_probe.c`` program, one command at a time.

The adapters turn exceptions and status codes into one vocabulary (:data:`PY_WORDS`,
:data:`C_WORDS`), so one assertion serves both.  Where the two differ by design the
table says so, per consumer, next to the doc that says it (``DIFFERS``); where one
contradicts the docs the case is a strict xfail naming the doc (``KNOWN_BUGS``).
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import platform
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest
from _memfd_backend import MemfdConsumer, pattern
from test_c_library import (
    C_DIR,
    RAW_WELCOMES,
    FakePublisher,
    Probe,
    Producer,
    RecordingPeer,
    _fd_table,
    _mapped_files,
    _memfds,
    _welcome,
    build_c_program,
    frame_of,
    status,
)

from cupy_ipcpool import _errors as errs
from cupy_ipcpool.channel import _protocol as proto
from cupy_ipcpool.channel._payload import MAX_CHANNEL_SLOTS

DEADLINE = 10.0  # seconds any condition below may take to come true

# ---------------------------------------------------------------- one vocabulary

#: Python exceptions -> outcome, most specific first (EvictedError is an EndOfStream,
#: PeerRefusedError a TransportError); an EndOfStream is "end" if clean, else "gone".
PY_WORDS: list[tuple[type[BaseException], str]] = [
    (errs.EvictedError, "evicted"),
    (errs.EndOfStream, "end"),
    (errs.PeerRefusedError, "refused"),
    (errs.ProtocolError, "protocol"),
    (errs.ChannelTimeoutError, "timeout"),
    (errs.TransportError, "transport"),
    (errs.PoolClosedError, "closed"),
]

#: C status names -> outcome (docs/c.md, "Error codes").
C_WORDS = {
    "CIP_ERR_EVICTED": "evicted",
    "CIP_ERR_END_OF_STREAM": "end",
    "CIP_ERR_PUBLISHER_GONE": "gone",
    "CIP_ERR_REFUSED": "refused",
    "CIP_ERR_PROTOCOL": "protocol",
    "CIP_ERR_TIMEOUT": "timeout",
    "CIP_ERR_TRANSPORT": "transport",
    "CIP_ERR_NOT_HELD": "not_held",
    "CIP_ERR_INVALID_ARGUMENT": "invalid",
}


@dataclass(frozen=True)
class Outcome:
    """What a call ended with: ``word`` from the vocabulary ("ok" for success) and the text."""

    word: str
    message: str = ""


@dataclass(frozen=True)
class Got:
    """A frame handed out; ``intact``: its mapped slot holds the frame's pattern."""

    seq: int
    slot: int
    payload: bytes
    intact: bool


@dataclass(frozen=True)
class Info:
    """The WELCOME as the consumer reports it."""

    num_slots: int
    next_seq: int
    credit: int
    lease_ms: int
    producer_pid: int


def _py_outcome(exc: BaseException) -> Outcome:
    for cls, word in PY_WORDS:
        if isinstance(exc, cls):
            if word == "end" and not getattr(exc, "clean", False):
                word = "gone"
            return Outcome(word, str(exc))
    raise exc


def _c_outcome(answer: str) -> Outcome:
    if answer.split()[0] == "ok":
        return Outcome("ok", answer)
    return Outcome(C_WORDS[status(answer)], answer)


# ---------------------------------------------------------------- the two adapters


def _session_fds(pid: int) -> set[tuple[int, str, tuple[int, int]]]:
    """The fds of process ``pid`` a session may hold: sockets, memfds, pidfds."""
    return {
        (fd, target, key)
        for fd, (target, key) in _fd_table(pid).items()
        if target.startswith(("socket:", "/memfd:")) or "pidfd" in target
    }


class Consumer(Protocol):
    kind: str
    pid: int
    info: Info
    mapped: int  # slots mapped from the WELCOME's fds (raw: whatever fds it carried)

    def open(
        self, address: str, mode: str = "block", credit: int = 0, uids: list[int] | None = None
    ) -> Outcome:
        """Subscribe (raw) and map the WELCOME's memfds; ``credit`` 0: the default."""
        ...

    def recv(self, timeout_ms: int = 5000) -> Got | Outcome: ...

    def recv_in_background(self, timeout_ms: int) -> Callable[[], Got | Outcome]:
        """Start a recv; the returned call waits for its result."""
        ...

    def waiting_thread(self) -> tuple[int, int]:
        """``(pid, tid)`` of the thread a background recv runs in."""
        ...

    def check(self, seq: int, slot: int) -> bool:
        """Whether the mapped ``slot`` still holds frame ``seq``'s pattern."""
        ...

    def release(self, seq: int, slot: int) -> Outcome: ...

    def close(self) -> Outcome: ...

    def leaked(self) -> set[tuple[int, str, tuple[int, int]]]:
        """Session fds opened since :meth:`open` began that are still open."""
        ...


class PyConsumer:
    """:class:`MemfdConsumer` (the session core and its mapped memfd slots), in this process."""

    kind = "python"

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.mc: MemfdConsumer | None = None
        self.before: set[tuple[int, str, tuple[int, int]]] = set()
        self.thread: threading.Thread | None = None

    def open(
        self, address: str, mode: str = "block", credit: int = 0, uids: list[int] | None = None
    ) -> Outcome:
        self.before = _session_fds(self.pid)
        try:
            self.mc = MemfdConsumer(
                address, mode=mode, credit=credit or None, allowed_uids=uids, timeout=5.0
            )
        except Exception as exc:
            return _py_outcome(exc)
        core = self.mc.core
        lease_ms = round(core.lease_timeout * 1000) if core.lease_timeout else 0
        self.info = Info(core.num_slots, core.next_seq, core.credit, lease_ms, core.producer_pid)
        self.mapped = len(self.mc.maps)
        return Outcome("ok")

    def recv(self, timeout_ms: int = 5000) -> Got | Outcome:
        assert self.mc is not None
        try:
            frame = self.mc.core.recv(timeout_ms / 1000)
        except Exception as exc:
            return _py_outcome(exc)
        return Got(frame.seq, frame.slot, frame.payload, self.check(frame.seq, frame.slot))

    def recv_in_background(self, timeout_ms: int) -> Callable[[], Got | Outcome]:
        result: list[Got | Outcome] = []
        self.thread = threading.Thread(target=lambda: result.append(self.recv(timeout_ms)))
        self.thread.start()

        def wait() -> Got | Outcome:
            assert self.thread is not None
            self.thread.join(DEADLINE + timeout_ms / 1000)
            return result[0]

        return wait

    def waiting_thread(self) -> tuple[int, int]:
        assert self.thread is not None and self.thread.native_id is not None
        return self.pid, self.thread.native_id

    def check(self, seq: int, slot: int) -> bool:
        assert self.mc is not None
        return self.mc.maps[slot][:] == pattern(seq, self.mc.slot_size)

    def release(self, seq: int, slot: int) -> Outcome:
        assert self.mc is not None
        try:
            self.mc.core.release(seq, slot)
        except Exception as exc:
            return _py_outcome(exc)
        return Outcome("ok")

    def close(self) -> Outcome:
        if self.mc is not None:
            self.mc.close()  # never raises
        return Outcome("ok")

    def leaked(self) -> set[tuple[int, str, tuple[int, int]]]:
        return _session_fds(self.pid) - self.before


class CConsumer:
    """The C library's raw session in ``cip_probe`` (``open_raw`` + ``map``)."""

    kind = "c"

    def __init__(self, exe: Path) -> None:
        self.probe = Probe(exe)
        self.pid = self.probe.proc.pid
        self.before: set[tuple[int, str, tuple[int, int]]] = set()

    def open(
        self, address: str, mode: str = "block", credit: int = 0, uids: list[int] | None = None
    ) -> Outcome:
        self.before = _session_fds(self.pid)
        allowed = ",".join(map(str, uids)) if uids is not None else "-"
        answer = self.probe(f"open_raw {address} {mode} {credit} 5000 {allowed}")
        if not answer.startswith("ok "):
            return _c_outcome(answer)
        _, _sub_id, num_slots, next_seq, granted, lease_ms, _payload, pid = answer.split()
        self.info = Info(int(num_slots), int(next_seq), int(granted), int(lease_ms), int(pid))
        mapped = self.probe("map")
        assert mapped.startswith("ok "), mapped
        self.mapped = int(mapped.split()[1])
        return Outcome("ok")

    def _frame_or_outcome(self, answer: str) -> Got | Outcome:
        if not answer.startswith("frame "):
            return _c_outcome(answer)
        seq, slot, payload, match = frame_of(answer)
        return Got(seq, slot, payload, match == "1")

    def recv(self, timeout_ms: int = 5000) -> Got | Outcome:
        return self._frame_or_outcome(self.probe(f"recv {timeout_ms}"))

    def recv_in_background(self, timeout_ms: int) -> Callable[[], Got | Outcome]:
        self.probe.send(f"recv {timeout_ms}")
        return lambda: self._frame_or_outcome(self.probe.answer(DEADLINE + timeout_ms / 1000))

    def waiting_thread(self) -> tuple[int, int]:
        return self.pid, self.pid

    def check(self, seq: int, slot: int) -> bool:
        return self.probe(f"check {seq} {slot}") == "ok 1"

    def release(self, seq: int, slot: int) -> Outcome:
        return _c_outcome(self.probe(f"release {seq} {slot}"))

    def close(self) -> Outcome:
        return _c_outcome(self.probe("close"))

    def leaked(self) -> set[tuple[int, str, tuple[int, int]]]:
        return _session_fds(self.pid) - self.before


@pytest.fixture(scope="module")
def cip_probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``test_c_library.probe_exe``, built once for this module (skips without a compiler)."""
    return build_c_program(
        tmp_path_factory.mktemp("cbuild"), "cip_probe", [C_DIR / "tests" / "cip_probe.c"]
    )


@contextlib.contextmanager
def consumer_of(kind: str, request: pytest.FixtureRequest) -> Iterator[Consumer]:
    """A consumer of ``kind`` (``"c"``: the C library's raw session through ``cip_probe``;
    else the Python session core), closed (and its probe) afterwards."""
    made: Consumer = (
        CConsumer(request.getfixturevalue("cip_probe")) if kind == "c" else PyConsumer()
    )
    try:
        yield made
    finally:
        made.close()
        if isinstance(made, CConsumer):
            made.probe.close()


@pytest.fixture
def consumer(request: pytest.FixtureRequest) -> Iterator[Consumer]:
    with consumer_of(request.param, request) as made:
        yield made


class Env:
    """What a scenario runs against: an address and the publishers it starts (all stopped)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="cip-scn-")
        self.address = os.path.join(self.dir, "pub.sock")
        self.producers: list[Producer] = []
        self.closers: list[Callable[[], object]] = []

    def producer(self, **kw: Any) -> Producer:
        pub = Producer(self.address, **kw)
        self.producers.append(pub)
        return pub

    def close(self) -> None:
        for pub in self.producers:
            pub.stop()
        for close in reversed(self.closers):
            close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def env() -> Iterator[Env]:
    e = Env()
    try:
        yield e
    finally:
        e.close()


# ---------------------------------------------------------------- helpers of the scenarios


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def until(cond: Callable[[], bool], what: str) -> None:
    """Wait (at most :data:`DEADLINE`) until ``cond()``; each call of it waits a little."""
    deadline = time.monotonic() + DEADLINE
    while not cond():
        assert time.monotonic() < deadline, what


def leases_after_poll(pub: Producer) -> int:
    """The leases the publisher's book shows after one poll (20 ms) for RELEASEs."""
    pub("poll", 0.02)
    return int(pub("leases"))


def evictions_after_poll(pub: Producer) -> int:
    pub("poll", 0.02)
    return int(pub("state")[0])


def frame(got: Got | Outcome) -> Got:
    assert isinstance(got, Got), got
    return got


def outcome(got: Got | Outcome) -> str:
    """The outcome's word; a frame where an end was expected fails here."""
    assert isinstance(got, Outcome), f"a frame was handed out: {got}"
    return got.word


def joined(c: Consumer, env: Env, pub: Producer, **kw: Any) -> Info:
    """Open ``c`` on ``pub`` (at ``env.address``) and wait until the publisher adopted it."""
    opened = c.open(env.address, **kw)
    assert opened.word == "ok", opened
    pub("wait_subs", 1)
    return c.info


def _syscall_waits(pid: int, tid: int) -> bool:
    """Whether thread ``tid`` of ``pid`` sits in poll(2)/ppoll(2) (unknown arch: True)."""
    numbers = {"x86_64": {"7", "271"}, "aarch64": {"73"}}.get(platform.machine())
    if numbers is None:
        return True
    with open(f"/proc/{pid}/task/{tid}/syscall") as f:
        return f.read().split()[0] in numbers


class ScriptedPublisher(FakePublisher):
    """A fake publisher that answers the HELLO with ``messages[0]`` (and ``fds``), then
    sends the rest of ``messages`` one datagram each."""

    def __init__(self, address: str, messages: list[bytes], fds: list[int]) -> None:
        self.after = messages[1:]
        super().__init__(address, lambda _hello: (messages[0], fds))

    def _serve(self) -> None:
        super()._serve()
        assert self.conn is not None
        for msg in self.after:
            self.conn.send(msg)


# ---------------------------------------------------------------- the scenarios
#
# Each takes the consumer and the environment (and its case); where Python and C
# differ, ``c.kind`` picks the documented answer of each, with the doc cited.

SLOT_SIZE = struct.Struct("<Q")


def refused_uid(c: Consumer, env: Env) -> None:
    """A publisher whose uid is not allowed is refused: no HELLO, no fd kept, hung up."""
    peer = RecordingPeer(env.address)
    env.closers.append(peer.close)
    got = c.open(env.address, uids=[os.geteuid() + 1])
    assert got.word == "refused", got
    assert f"runs as uid {os.geteuid()}" in got.message
    peer.thread.join(DEADLINE)
    assert peer.hung_up, "the consumer kept the refused connection open"
    hello = [m for m in peer.received if proto.decode(m).__class__ is proto.Hello]
    assert hello == [], "a HELLO reached a publisher of a uid not allowed"
    assert c.leaked() == set()


def refused_uid_is_sent_nothing(c: Consumer, env: Env) -> None:
    """Not even a BYE reaches it (docs/c.md, "What it checks": "As the Python subscriber
    does ... a publisher whose uid is not gets nothing, not even a BYE")."""
    peer = RecordingPeer(env.address)
    env.closers.append(peer.close)
    assert c.open(env.address, uids=[os.geteuid() + 1]).word == "refused"
    peer.thread.join(DEADLINE)
    assert peer.received == [], f"bytes reached a refused peer: {peer.received!r}"


def malformed_welcome(c: Consumer, env: Env, case: str) -> None:
    """A malformed WELCOME is refused before anything is mapped, its fds closed."""
    data, c_status, words = RAW_WELCOMES[case]
    if case == "too large" and os.geteuid() != 0:
        pytest.skip("sending a datagram over 1 MiB needs SO_SNDBUFFORCE (root)")
    fds = _memfds(3)  # travel with every reply: the consumer must close its copies
    env.closers.append(functools.partial(_close_fds, fds))
    sent = {(st.st_dev, st.st_ino) for st in map(os.fstat, fds)}
    fake = FakePublisher(env.address, lambda _hello: (data, fds))
    got = c.open(env.address)
    fake.close()  # its end of the connection too: what is left below is the consumer's
    assert got.word == C_WORDS[c_status], got
    assert words in got.message, got
    assert not sent & _mapped_files(c.pid), "a memfd was mapped"
    assert {key for _, _, key in c.leaked()} & sent == set(), "a memfd stayed open"
    assert c.leaked() == set()
    hello = proto.decode(fake.hello)
    assert isinstance(hello, proto.Hello)
    assert (hello.mode, hello.credit) == (proto.MODE_BLOCK, 64)  # both ask 64 in block


def welcome_slot_limits(c: Consumer, env: Env, num_slots: int) -> None:
    """A raw WELCOME of up to MAX_SLOTS slots is taken; one more is refused."""
    fake = FakePublisher(
        env.address, lambda _hello: (_welcome(num_slots, payload=SLOT_SIZE.pack(4096)), [])
    )
    env.closers.append(fake.close)
    got = c.open(env.address)
    if num_slots <= proto.MAX_SLOTS:
        assert got.word == "ok", got
        # the raw layers leave the fds to the caller (docs/c.md, "Layers and the other
        # calls": cip_sub_open_raw); none came, none is asked for
        assert (c.info.num_slots, c.mapped) == (num_slots, 0)
    else:
        assert got.word == "protocol", got
        assert f"num_slots {num_slots}" in got.message


def no_publisher(c: Consumer, env: Env) -> None:
    got = c.open(env.address)
    assert got.word == "transport", got
    assert "is the publisher running?" in got.message


def frames_in_order(c: Consumer, env: Env) -> None:
    """The WELCOME's values, then each frame in order with its seq, slot and payload."""
    pub = env.producer(num_slots=4)
    info = joined(c, env, pub)
    assert info == Info(num_slots=4, next_seq=0, credit=2, lease_ms=0, producer_pid=pub.pid)
    assert c.mapped == 4
    payloads = [b"first", b"", b"x" * proto.MAX_FRAME_PAYLOAD]
    seqs = [pub("publish", 1, p)[0] for p in payloads]
    got = [frame(c.recv()) for _ in payloads]
    assert [(g.seq, g.payload, g.intact) for g in got] == [
        (s, p, True) for s, p in zip(seqs, payloads, strict=True)
    ]
    assert [g.slot for g in got] == [0, 1, 2]  # round-robin over a fresh ring
    assert outcome(c.recv(50)) == "timeout"
    for g in got:
        assert c.check(g.seq, g.slot), "a held frame's slot changed"
        assert c.release(g.seq, g.slot).word == "ok"
    assert c.close().word == "ok"
    assert c.leaked() == set()


def release_returns_the_lease(c: Consumer, env: Env) -> None:
    """Each release shows in the publisher's lease book; a frame not held is refused
    and the session goes on."""
    pub = env.producer(num_slots=4)
    joined(c, env, pub)
    pub("publish", 2, b"")
    first, second = frame(c.recv()), frame(c.recv())
    assert pub("leases") == 2
    assert c.release(first.seq, first.slot).word == "ok"
    until(lambda: leases_after_poll(pub) == 1, "the first RELEASE never reached the publisher")
    assert c.release(second.seq, second.slot).word == "ok"
    until(lambda: leases_after_poll(pub) == 0, "the second RELEASE never reached the publisher")
    # released twice: DIFFERS by name -- docs/c.md, "Error codes": CIP_ERR_NOT_HELD;
    # SubscriberCore.release's docstring: ProtocolError ("This subscriber does not hold
    # that frame ...; nothing is sent"). Neither ends the session.
    again = c.release(first.seq, first.slot)
    assert again.word == {"c": "not_held", "python": "protocol"}[c.kind], again
    assert "which is not held" in again.message
    (seq,) = pub("publish", 1, b"on")
    assert frame(c.recv()) == Got(seq, 2, b"on", True)  # the slot after the last published


def close_returns_the_leases(c: Consumer, env: Env) -> None:
    """Closing with frames held gives their leases back and leaves the publisher."""
    pub = env.producer(num_slots=4)
    joined(c, env, pub)
    pub("publish", 2, b"")
    frame(c.recv())
    frame(c.recv())
    assert c.close().word == "ok"
    until(lambda: leases_after_poll(pub) == 0, "a closed consumer's leases never came back")
    assert pub("state")[1] == 0, "the publisher still counts the closed consumer"
    assert c.leaked() == set()


def latest_skips_while_credit_is_held(c: Consumer, env: Env) -> None:
    pub = env.producer(num_slots=4)
    joined(c, env, pub, mode="latest", credit=1)
    pub("publish", 1, b"")
    held = frame(c.recv())
    pub("publish", 3, b"")  # the one frame of credit is held: all three skipped
    assert outcome(c.recv(100)) == "timeout"
    assert c.release(held.seq, held.slot).word == "ok"
    until(lambda: leases_after_poll(pub) == 0, "the RELEASE never reached the publisher")
    (last,) = pub("publish", 1, b"")
    assert frame(c.recv()).seq == last == 4, "frames 1-3 were skipped: the gap shows in seq"


def eviction_by_lease_timeout(c: Consumer, env: Env) -> None:
    """Held past lease_timeout: evicted, and neither frame queued behind the notice is
    handed out, now or later; the release of the held frame says so too."""
    pub = env.producer(num_slots=5, lease_timeout=0.3)
    assert joined(c, env, pub).lease_ms == 300
    pub("publish", 1, b"")
    held = frame(c.recv())
    pub("publish", 2, b"")  # queued in the consumer's socket, not read
    until(lambda: evictions_after_poll(pub) == 1, "the publisher never evicted")
    assert pub("leases") == 0, "the eviction gave the leases back"
    first = c.recv()
    assert outcome(first) == "evicted"
    assert isinstance(first, Outcome) and "lease_timeout" in first.message
    assert outcome(c.recv(0)) == "evicted"
    # docs/c.md, "How a stream ends": "after an eviction CIP_ERR_EVICTED";
    # SubscriberCore.release's docstring: EvictedError (the GPU Subscriber's release
    # returns quietly instead: docs/protocol.md, "What an evicted subscriber may assume")
    assert c.release(held.seq, held.slot).word == "evicted"
    assert c.close().word == "ok"
    assert c.leaked() == set()


def eviction_by_full_socket(c: Consumer, env: Env) -> None:
    """A block consumer that does not read until its socket stays full for send_timeout:
    evicted, and none of the frames filling its socket is handed out."""
    num_slots = 16
    pub = env.producer(num_slots=num_slots, send_timeout=0.2)
    joined(c, env, pub)
    published = 0

    def publish_until_evicted() -> bool:
        nonlocal published
        assert published < num_slots, "16 frames of 64 KiB never filled the socket"
        pub("publish", 1, b"p" * proto.MAX_FRAME_PAYLOAD)
        published += 1
        return int(pub("state")[0]) == 1

    until(publish_until_evicted, "the consumer whose socket stayed full was never evicted")
    assert published >= 2
    evictions, subscribers, reason = pub("state")
    assert (evictions, subscribers) == (1, 0), reason
    assert "stayed full" in reason
    got = c.recv()
    assert outcome(got) == "evicted"
    assert isinstance(got, Outcome) and "stayed full" in got.message
    assert outcome(c.recv(0)) == "evicted"


def clean_close_after_queued_frames(c: Consumer, env: Env) -> None:
    """BYE: the frames queued before it are handed out, then the end, on every call;
    releasing after the end only forgets the frame."""
    pub = env.producer(num_slots=5)
    joined(c, env, pub)
    seqs = pub("publish", 3, b"x")
    pub.stop()  # BYE, then the process exits
    got = [frame(c.recv()) for _ in seqs]
    assert [(g.seq, g.payload, g.intact) for g in got] == [(s, b"x", True) for s in seqs]
    assert outcome(c.recv()) == "end"
    assert outcome(c.recv(0)) == "end"
    # docs/c.md, "How a stream ends": "releasing a held frame only forgets it (CIP_OK)";
    # SubscriberCore.release's docstring: "releasing only forgets the frame locally"
    assert [c.release(g.seq, g.slot).word for g in got] == ["ok"] * 3
    assert c.close().word == "ok"
    assert c.leaked() == set()


def publisher_sigkilled(c: Consumer, env: Env) -> None:
    """SIGKILL of the publisher's process: publisher-gone, on every call; the held frame
    stays readable and its release is a no-op."""
    pub = env.producer(num_slots=4)
    joined(c, env, pub)
    pub("publish", 2, b"")
    held = frame(c.recv())
    pub.kill()
    # docs/protocol.md, "Failures": a hang-up without BYE hands out no frame still queued
    # (docs/c.md, "How a stream ends": CIP_ERR_PUBLISHER_GONE, dropped)
    assert outcome(c.recv()) == "gone", "the frame queued at the death was handed out"
    assert outcome(c.recv(0)) == "gone"
    assert c.check(held.seq, held.slot), "the held frame's memory stays readable"
    # docs/c.md, "How a stream ends"; SubscriberCore.release: "only forgets the frame"
    assert c.release(held.seq, held.slot).word == "ok"
    assert c.close().word == "ok"
    assert c.leaked() == set()


def publisher_sigkilled_while_waiting(c: Consumer, env: Env) -> None:
    """A consumer asleep in recv learns of the death at once, not at its timeout."""
    pub = env.producer(num_slots=4)
    joined(c, env, pub)
    result = c.recv_in_background(60_000)
    pid, tid = c.waiting_thread()
    until(lambda: _syscall_waits(pid, tid), "the consumer never went to sleep in poll(2)")
    t0 = time.monotonic()
    pub.kill()
    assert outcome(result()) == "gone"
    assert time.monotonic() - t0 < DEADLINE


def protocol_error_after_welcome(c: Consumer, env: Env, case: str) -> None:
    """A malformed message after the WELCOME: a protocol error; nothing more is handed out."""
    fds = _memfds(2)
    env.closers.append(functools.partial(_close_fds, fds))
    for fd, seq in zip(fds, (0, 1), strict=True):
        with mmap.mmap(fd, 4096) as m:
            m[:] = pattern(seq, 4096)
    bad = {
        "slot out of range": proto.encode_frame(1, 5),
        "frame twice": proto.encode_frame(0, 1),
        "a HELLO": proto.encode_hello(proto.MODE_BLOCK, 1, 1, b""),
        "truncated frame": proto.encode_frame(1, 1)[:-3],
    }[case]
    welcome = _welcome(num_slots=2, credit=2, payload=SLOT_SIZE.pack(4096))
    fake = ScriptedPublisher(env.address, [welcome, proto.encode_frame(0, 0, b"ok"), bad], fds)
    env.closers.append(fake.close)
    assert c.open(env.address).word == "ok"
    assert frame(c.recv()) == Got(0, 0, b"ok", True)
    assert outcome(c.recv()) == "protocol"
    later = outcome(c.recv(0))
    # DIFFERS: docs/c.md, "How a stream ends": "the end is reported again by every
    # later call" (CIP_ERR_PROTOCOL again); the Python core raises ProtocolError once,
    # then EndOfStream(clean=False), "the connection was closed after a protocol error"
    # (docs/protocol.md, "Failures", says only "ProtocolError, subscription closed").
    assert later == {"c": "protocol", "python": "gone"}[c.kind]


def credit_granted(
    c: Consumer, env: Env, mode: str, asked: int, max_credit: int | None, num_slots: int
) -> None:
    """credit granted = min(asked, max_credit) (default num_slots - 2); in latest mode
    exactly that many frames are handed out while all are held."""
    pub = env.producer(num_slots=num_slots, max_credit=max_credit)
    cap = max_credit if max_credit is not None else max(1, num_slots - 2)
    # asked 0: each side's default, 1 for latest, 64 for block (docs/protocol.md,
    # "Consumer": credit; cupy_ipcpool.h: cip_sub_options.credit)
    default = 1 if mode == "latest" else 64
    granted = min(asked or default, cap)
    assert joined(c, env, pub, mode=mode, credit=asked).credit == granted
    if mode == "latest":
        pub("publish", granted + 2, b"")
        got = [frame(c.recv()) for _ in range(granted)]
        assert [g.seq for g in got] == list(range(granted))
        assert outcome(c.recv(100)) == "timeout", "a frame past the credit was handed out"


def max_channel_slots(c: Consumer, env: Env) -> None:
    """The largest channel (MAX_CHANNEL_SLOTS fds in one WELCOME) is mapped whole."""
    pub = env.producer(num_slots=MAX_CHANNEL_SLOTS)
    assert joined(c, env, pub).num_slots == MAX_CHANNEL_SLOTS
    assert c.mapped == MAX_CHANNEL_SLOTS
    pub("publish", 1, b"")
    got = frame(c.recv())
    assert got.intact
    assert c.close().word == "ok"
    assert c.leaked() == set()


# ---------------------------------------------------------------- the table

TABLE: list[tuple[str, Callable[..., None], tuple[Any, ...]]] = [
    ("refused_uid", refused_uid, ()),
    ("refused_uid_is_sent_nothing", refused_uid_is_sent_nothing, ()),
    *[(f"malformed_welcome[{case}]", malformed_welcome, (case,)) for case in sorted(RAW_WELCOMES)],
    *[
        (f"welcome_slot_limits[{n}]", welcome_slot_limits, (n,))
        for n in (proto.MAX_SLOTS, proto.MAX_SLOTS + 1)
    ],
    ("no_publisher", no_publisher, ()),
    ("frames_in_order", frames_in_order, ()),
    ("release_returns_the_lease", release_returns_the_lease, ()),
    ("close_returns_the_leases", close_returns_the_leases, ()),
    ("latest_skips_while_credit_is_held", latest_skips_while_credit_is_held, ()),
    ("eviction_by_lease_timeout", eviction_by_lease_timeout, ()),
    ("eviction_by_full_socket", eviction_by_full_socket, ()),
    ("clean_close_after_queued_frames", clean_close_after_queued_frames, ()),
    ("publisher_sigkilled", publisher_sigkilled, ()),
    ("publisher_sigkilled_while_waiting", publisher_sigkilled_while_waiting, ()),
    *[
        (f"protocol_error_after_welcome[{case}]", protocol_error_after_welcome, (case,))
        for case in ("slot out of range", "frame twice", "a HELLO", "truncated frame")
    ],
    *[
        (f"credit_granted[{mode}-{asked}-{cap}-{n}]", credit_granted, (mode, asked, cap, n))
        for mode, asked, cap, n in [
            ("latest", 0, None, 4),
            ("latest", 65535, None, 4),
            ("latest", 5, 3, 8),
            ("latest", 2, 3, 8),
            ("block", 0, None, 4),
            ("block", 2, 5, 8),
            ("block", 65535, 5, 8),
        ]
    ],
    ("max_channel_slots", max_channel_slots, ()),
]

#: Where one consumer contradicts the docs: a strict xfail, so a fix shows.
KNOWN_BUGS: dict[tuple[str, str], str] = {}

CASES = [
    pytest.param(
        kind,
        fn,
        args,
        id=f"{kind}-{name}",
        marks=[pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[name, kind])]
        if (name, kind) in KNOWN_BUGS
        else [],
    )
    for name, fn, args in TABLE
    for kind in ("python", "c")
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("consumer", "scenario", "args"), CASES, indirect=["consumer"])
def test_scenario(
    consumer: Consumer, env: Env, scenario: Callable[..., None], args: tuple[Any, ...]
) -> None:
    scenario(consumer, env, *args)


def test_the_table_names_each_scenario_once() -> None:
    names = [name for name, _, _ in TABLE]
    assert len(names) == len(set(names))
    assert {name for name, _ in KNOWN_BUGS} <= set(names)
    # one vocabulary: every Python outcome but "closed" (a closed handle) has a C status
    assert set(C_WORDS.values()) >= {w for _, w in PY_WORDS} - {"closed"} | {"gone"}
