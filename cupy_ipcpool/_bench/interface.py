"""What a lane is, and what its two processes run: the schedule, the sides, the loops.

A :class:`Lane` is one way of handing a GPU frame from a producer process to a
consumer process.  Its :class:`ProducerSide` and :class:`ConsumerSide` do one
frame size; :func:`producer_loop` and :func:`consumer_loop` drive the same
schedule on both sides (:class:`Schedule`):

* warm-up frames (every one fully verified, not timed);
* latency frames: the producer times each round trip with
  :func:`time.perf_counter_ns` (write on the GPU -> hand over -> the consumer
  gets a usable array, enqueues its check, signals done -> the producer sees
  it);
* throughput frames: without waiting per frame where the lane allows it
  (:attr:`Lane.pipelined`), else one round trip after the other;
* check frames: a few more frames, fully verified, not timed.

A producer given a turn pipe (:attr:`BenchConfig.turns`) runs only in the
turns its parent grants (:class:`TurnGate`): per size one turn for the set-up
and warm-up, one per :attr:`BenchConfig.turn_frames` latency frames, one for
the rest.  The harness grants the lanes' turns in rotation
(:func:`~.harness.run_turns`), so that lanes measured side by side share the
machine's state from one turn to the next.  A latency turn ends only once the
lane's GPU work is done (its consumers' checks included, :data:`TURN_IDLE`),
so no turn starts behind another lane's backlog.

On timed frames the GPU lanes do not wait for their check: it is enqueued on
the consumer's stream and counts mismatches in a device-side counter, which is
read back (one synchronisation) at the end of each timed phase
(:meth:`ConsumerSide.flush_checks`).  A lane synchronises per frame only where
its own correctness needs it.  The phases are separated by a barrier (the
consumers' ``lat-done`` / ``tput-done``): the latency phase's GPU backlog is
waited for outside the timed regions, and the throughput phase ends only once
every consumer has seen its checks complete, so frames/s counts finished work.

Every frame is written with a new value (1, 2, 3, ...), so a stale or torn
frame cannot pass verification.  Nothing here imports CuPy: the GPU work lives
in the lanes (:mod:`cupy_ipcpool._bench.lanes`).
"""

from __future__ import annotations

import copy
import os
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any


class LaneUnavailable(Exception):
    """Raised inside a lane's process when an optional package lacks what it needs.

    The lane is then reported as ``skipped: <message>``, never as a failure.
    """


# --------------------------------------------------------------------- config
@dataclass(frozen=True)
class Schedule:
    """How many frames of each kind one (lane, size) measurement uses."""

    warmup: int = 20
    iters: int = 300
    tput: int = 300
    checks: int = 3

    @property
    def total(self) -> int:
        """Frames per size, all phases together."""
        return self.warmup + self.iters + self.tput + self.checks


@dataclass(frozen=True)
class BenchConfig:
    """What the producer and consumer processes of one lane run need to know.

    Parameters
    ----------
    sizes:
        Frame sizes in bytes, measured in this order by one process pair.
    schedule:
        Frames per phase.
    n_consumers:
        Number of consumer processes (fan-out); lanes other than
        ``cupy_ipcpool`` use one.
    workdir:
        A private directory for socket paths (made by the harness).
    frame_timeout:
        Seconds any single wait (a frame, a done signal) may take.
    num_slots:
        Ring depth of pooled lanes.
    device:
        CUDA device ordinal.
    extra:
        Lane-specific settings (e.g. the slot counts of the attach scan).
    turn_frames:
        Latency frames per turn (0: the latency phase in one block); every
        latency turn but the last ends with the lane's GPU work done, the
        producer's and the consumers' (:func:`idle_turn_ends`).  Producer and
        consumers alike read it.
    turns:
        The producer's end of its turn pipe (:class:`TurnGate`), set by the
        harness for the producer only; None: the producer runs freely.
    """

    sizes: tuple[int, ...]
    schedule: Schedule = Schedule()
    n_consumers: int = 1
    workdir: str = ""
    frame_timeout: float = 20.0
    num_slots: int = 4
    device: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    turn_frames: int = 0
    turns: Connection | None = None


# --------------------------------------------------------------- lane sides
class ProducerSide:
    """The producer's half of a lane for one frame size.

    Subclasses implement :meth:`send` and :meth:`wait_done`; lanes that
    pipeline also :meth:`drain`.
    """

    def __init__(self) -> None:
        self.failures: list[str] = []

    def send(self, value: int) -> None:
        """Write a frame filled with ``value`` on the GPU and hand it over."""
        raise NotImplementedError

    def wait_done(self, value: int, *, full: bool) -> None:
        """Block until every consumer signalled that it is done with frame ``value``.

        ``full`` asks for a full verification where the producer verifies
        (the in-process floor); other lanes ignore it.
        """
        raise NotImplementedError

    def flush_checks(self) -> int:
        """Wait for the checks this side enqueued since the last call; return the mismatches.

        Called at the end of each timed phase.  Only a producer that verifies
        (the in-process floor) has any; the default is 0.
        """
        return 0

    def drain(self) -> None:
        """After a pipelined phase: absorb completions still in flight (default: none)."""

    def close(self) -> None:
        """Release everything this side made for the size."""


class ConsumerSide:
    """The consumer's half of a lane for one frame size."""

    def step(self, *, full: bool) -> tuple[int, bool]:
        """Receive one frame, verify it (or enqueue its check), signal done.

        Parameters
        ----------
        full:
            Compare every element, synchronously (warm-up and check frames).
            Else the lane's cheap check: GPU lanes enqueue it on their stream
            without waiting (its outcome comes from :meth:`flush_checks`).

        Returns
        -------
        value : int
            The value the frame says it was written with.
        ok : bool
            Whether the data held that value, as far as known now (a frame
            whose check was only enqueued is ``True`` until the flush).
        """
        raise NotImplementedError

    def flush_checks(self) -> int:
        """Wait for the checks enqueued since the last call; return how many samples mismatched.

        Called once at the end of each timed phase (one synchronisation).
        Lanes that verify on the host as they go return 0 (the default).
        """
        return 0

    def close(self) -> None:
        """Release everything this side made for the size."""


class Lane:
    """One way of handing a frame from a producer process to a consumer process.

    Attributes
    ----------
    name:
        Short identifier used on the command line and in reports.
    title:
        Human-readable description.
    processes:
        2 for a producer/consumer pair, 1 for the in-process floor.
    pipelined:
        Whether the throughput phase may keep several frames in flight.
    sync_note:
        The per-frame host synchronisation the lane keeps and why (printed in
        the report's notes); empty for a lane without GPU work.
    """

    name = "lane"
    title = "lane"
    processes = 2
    pipelined = False
    sync_note = ""

    def available(self) -> str | None:
        """Return why this lane cannot run here (cheap, in the parent), or None."""
        return None

    def prepare(self, ctx: Any) -> Lane:
        """Return the instance sent to the children (it may carry a queue made with ``ctx``)."""
        return self

    # Sides for one size; used by the default entry points.
    def open_producer(
        self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> ProducerSide:
        """Set up the producer side for frames of ``nbytes``."""
        raise NotImplementedError

    def open_consumer(self, link: Connection, cfg: BenchConfig, nbytes: int) -> ConsumerSide:
        """Set up the consumer side for frames of ``nbytes``."""
        raise NotImplementedError

    # Entry points, run in the spawned processes.
    def producer(self, links: Sequence[Connection], cfg: BenchConfig) -> dict[str, Any]:
        """Run the producer over every size of ``cfg``; return per-size timings."""
        return producer_loop(self, links, cfg)

    def consumer(self, link: Connection, cfg: BenchConfig) -> dict[str, Any]:
        """Run one consumer over every size of ``cfg``; return per-size verification counts."""
        return consumer_loop(self, link, cfg)


# ----------------------------------------------------------------- helpers
def raw_socket(link: Connection) -> socket.socket:
    """A blocking ``socket.socket`` over a duplicate of ``link``'s fd (for hot paths)."""
    return socket.socket(fileno=os.dup(link.fileno()))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes from a stream socket (raises ``EOFError`` on close)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the peer closed the connection")
        got += k
    return bytes(buf)


def expect(link: Connection, what: bytes, timeout: float) -> bytes:
    """Receive a control message on ``link`` and check that it starts with ``what``."""
    if not link.poll(timeout):
        raise TimeoutError(f"no {what!r} from the peer within {timeout} s")
    msg = link.recv_bytes()
    if not msg.startswith(what):
        raise RuntimeError(f"expected {what!r} from the peer, got {msg[:40]!r}")
    return msg


# ------------------------------------------------------------------ turns
#: Turn pipe messages: the parent's "run now", the producer's "my turn is over".
TURN_GO, TURN_DONE = b"go", b"done"


class TurnGate:
    """The producer's side of turn-taking: run a phase only once the parent says so.

    ``conn`` None: every turn starts at once (the lane runs freely).  The wait
    for a turn has no limit of its own: the parent limits each turn it grants,
    and its death ends the wait (``EOFError``).
    """

    def __init__(self, conn: Connection | None) -> None:
        self._conn = conn

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Wait for the parent's go, run the block, then hand the machine back."""
        conn = self._conn
        if conn is None:
            yield
            return
        msg = conn.recv_bytes()
        if msg != TURN_GO:
            raise RuntimeError(f"expected {TURN_GO!r} on the turn pipe, got {msg[:40]!r}")
        yield
        conn.send_bytes(TURN_DONE)


def latency_blocks(iters: int, turn_frames: int) -> list[int]:
    """The latency phase's frames per turn: ``turn_frames`` each, the last one the rest.

    One block of ``iters`` frames when ``turn_frames`` is 0 (no turns).
    """
    if turn_frames <= 0 or iters <= turn_frames:
        return [iters] if iters else []
    full, rest = divmod(iters, turn_frames)
    return [turn_frames] * full + ([rest] if rest else [])


def idle_turn_ends(sched: Schedule, turn_frames: int) -> frozenset[int]:
    """The frames (0-based, all phases) after which a latency turn ends with the GPU idle.

    Every latency block but the last: after it the consumers wait for their
    enqueued checks and say so (:data:`TURN_IDLE`), and the producer for its
    own work, before its turn ends, so that no turn starts behind the previous
    lane's GPU work.  (The last block is followed by the latency phase's own
    flush.)
    """
    ends: set[int] = set()
    i = sched.warmup
    for block in latency_blocks(sched.iters, turn_frames)[:-1]:
        i += block
        ends.add(i - 1)
    return frozenset(ends)


# ------------------------------------------------------------------ loops
def _full_check(i: int, sched: Schedule) -> bool:
    """Whether frame ``i`` (0-based, all phases) gets a full verification."""
    return i < sched.warmup or i >= sched.warmup + sched.iters + sched.tput


#: Control messages that end the timed phases (consumer -> producer).
LAT_DONE, TPUT_DONE = b"lat-done", b"tput-done"
#: A consumer's checks of a latency turn are done (consumer -> producer, :func:`idle_turn_ends`).
TURN_IDLE = b"turn-idle"


def _flush_producer(side: ProducerSide, phase: str) -> None:
    n = side.flush_checks()
    if n:
        side.failures.append(f"{phase}: the device-side check found {n} mismatching sample(s)")


def producer_loop(lane: Lane, links: Sequence[Connection], cfg: BenchConfig) -> dict[str, Any]:
    """Drive the schedule for every size on the producer side.

    After the latency frames the producer waits (untimed) for every consumer's
    ``lat-done``, sent once its enqueued checks have completed; the throughput
    clock stops at the last consumer's ``tput-done``, sent likewise.

    Returns
    -------
    dict
        ``{str(nbytes): {"latencies_ns": [...], "tput_frames": int,
        "tput_ns": int, "failures": [...]}}``; a size whose setup or loop
        raised carries ``"error"`` instead and ends the run.
    """
    sched = cfg.schedule
    gate = TurnGate(cfg.turns)
    blocks = latency_blocks(sched.iters, cfg.turn_frames)
    idle_ends = idle_turn_ends(sched, cfg.turn_frames)
    out: dict[str, Any] = {}
    value = 0
    for nbytes in cfg.sizes:
        side: ProducerSide | None = None
        lat: list[int] = []
        try:
            with gate.turn():  # set-up and warm-up
                side = lane.open_producer(links, cfg, nbytes)
                for _ in range(sched.warmup):
                    value += 1
                    side.send(value)
                    side.wait_done(value, full=True)
            for block in blocks:
                with gate.turn():
                    for _ in range(block):
                        value += 1
                        t0 = time.perf_counter_ns()
                        side.send(value)
                        side.wait_done(value, full=False)
                        lat.append(time.perf_counter_ns() - t0)
                    if sched.warmup + len(lat) - 1 in idle_ends:  # the turn ends GPU-idle
                        _flush_producer(side, "latency phase")
                        for link in links:
                            expect(link, TURN_IDLE, cfg.frame_timeout)
            with gate.turn():  # the rest of the size, its teardown included
                value, tput_ns = _finish_size(side, links, cfg, value, lane.pipelined)
                done, side = side, None
                done.close()
                for link in links:  # the consumers closed their side of this size
                    expect(link, b"size-done", cfg.frame_timeout)
        finally:
            if side is not None:
                side.close()
        out[str(nbytes)] = {
            "latencies_ns": lat,
            "tput_frames": sched.tput,
            "tput_ns": tput_ns,
            "failures": list(done.failures),
        }
    return out


def _finish_size(
    side: ProducerSide, links: Sequence[Connection], cfg: BenchConfig, value: int, pipelined: bool
) -> tuple[int, int]:
    """After the latency frames: its barrier, the throughput phase, the check frames.

    Returns the last value written and the throughput phase's nanoseconds.
    """
    sched = cfg.schedule
    _flush_producer(side, "latency phase")
    for link in links:
        expect(link, LAT_DONE, cfg.frame_timeout + sched.iters)
    t0 = time.perf_counter_ns()
    for _ in range(sched.tput):
        value += 1
        side.send(value)
        if not pipelined:
            side.wait_done(value, full=False)
    _flush_producer(side, "throughput phase")
    for link in links:
        expect(link, TPUT_DONE, cfg.frame_timeout + sched.tput)
    tput_ns = time.perf_counter_ns() - t0
    if pipelined:
        side.drain()
    for _ in range(sched.checks):
        value += 1
        side.send(value)
        side.wait_done(value, full=True)
    return value, tput_ns


class CheckTally:
    """One consumer's verification count for one size.

    A frame checked fully (or on the host) counts when its step returns; a
    timed frame whose check was only enqueued counts once :meth:`flush`
    reports no mismatch for its phase.  A non-zero flush fails every frame of
    the phase, since the counter cannot say which one was wrong.
    """

    def __init__(self) -> None:
        self.verified = 0
        self.full_checks = 0
        self.pending = 0
        self.device_checked = 0
        self.device_mismatches = 0
        self.failures: list[str] = []

    def frame(self, i: int, expected: int, got: int, ok: bool, *, full: bool) -> None:
        """Record frame ``i`` (0-based, all phases) that should hold ``expected``."""
        if got != expected:
            self.failures.append(f"frame {i}: expected value {expected}, the message said {got}")
        elif not ok:
            kind = "full" if full else "spot"
            self.failures.append(f"frame {i}: data does not hold {expected} ({kind} check)")
        elif full:
            self.verified += 1
            self.full_checks += 1
        else:
            self.pending += 1

    def flush(self, phase: str, mismatches: int) -> None:
        """Settle the frames of ``phase`` with the device-side counter's ``mismatches``."""
        self.device_checked += self.pending
        if mismatches:
            self.device_mismatches += mismatches
            self.failures.append(
                f"{phase}: the device-side check found {mismatches} mismatching sample(s) "
                f"in {self.pending} timed frame(s)"
            )
        else:
            self.verified += self.pending
        self.pending = 0

    def result(self) -> dict[str, Any]:
        """The consumer's report for the size (frames never flushed are not verified)."""
        return {
            "verified": self.verified,
            "full_checks": self.full_checks,
            "device_checked": self.device_checked,
            "device_mismatches": self.device_mismatches,
            "failures": self.failures[:10],
            "n_failures": len(self.failures),
        }


def consumer_loop(lane: Lane, link: Connection, cfg: BenchConfig) -> dict[str, Any]:
    """Drive the schedule for every size on one consumer.

    Every frame's value is compared with the value expected at that point of
    the schedule, and its data with its value: at once on warm-up and check
    frames, through the lane's device-side counter at the end of each timed
    phase (:class:`CheckTally`).

    Returns
    -------
    dict
        ``{str(nbytes): {"verified": int, "full_checks": int, "device_checked": int,
        "device_mismatches": int, "failures": [...], "n_failures": int}}``.
    """
    sched = cfg.schedule
    out: dict[str, Any] = {}
    value = 0
    lat_end = sched.warmup + sched.iters
    tput_end = lat_end + sched.tput
    idle_ends = idle_turn_ends(sched, cfg.turn_frames)
    for nbytes in cfg.sizes:
        side = lane.open_consumer(link, cfg, nbytes)
        tally = CheckTally()
        try:
            for i in range(sched.total):
                if i == lat_end:
                    tally.flush("latency phase", side.flush_checks())
                    link.send_bytes(LAT_DONE)
                if i == tput_end:
                    tally.flush("throughput phase", side.flush_checks())
                    link.send_bytes(TPUT_DONE)
                value += 1
                full = _full_check(i, sched)
                got, ok = side.step(full=full)
                tally.frame(i, value, got, ok, full=full)
                if i in idle_ends:
                    tally.flush("latency phase", side.flush_checks())
                    link.send_bytes(TURN_IDLE)
            # Phases that end the schedule (no check frames after them).
            if sched.total == lat_end:
                tally.flush("latency phase", side.flush_checks())
                link.send_bytes(LAT_DONE)
            if sched.total == tput_end:
                tally.flush("throughput phase", side.flush_checks())
                link.send_bytes(TPUT_DONE)
        finally:
            side.close()
        link.send_bytes(b"size-done")
        out[str(nbytes)] = tally.result()
    return out


def with_copy(lane: Lane, **attrs: Any) -> Lane:
    """A shallow copy of ``lane`` with ``attrs`` set (used by :meth:`Lane.prepare`)."""
    new = copy.copy(lane)
    for k, v in attrs.items():
        setattr(new, k, v)
    return new
