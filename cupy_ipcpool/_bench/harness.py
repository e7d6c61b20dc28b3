"""Run one lane of the comparative benchmark in two spawned processes and time it.

A :class:`Lane` is one way of handing a GPU frame from a producer process to a
consumer process.  The harness spawns the producer and the consumer(s) with
``multiprocessing`` ``spawn``, joins them with a duplex pipe per consumer
(``links``), drives the same schedule on both sides and collects what each
side measured:

* warm-up frames (every one fully verified, not timed);
* latency frames: the producer times each round trip with
  :func:`time.perf_counter_ns` (write on the GPU -> hand over -> the consumer
  gets a usable array, enqueues its check, signals done -> the producer sees
  it);
* throughput frames: without waiting per frame where the lane allows it
  (:attr:`Lane.pipelined`), else one round trip after the other;
* check frames: a few more frames, fully verified, not timed.

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
in the lanes (:mod:`cupy_ipcpool._bench.lanes`), and the machinery is tested on
CPU-only machines with a lane that needs no GPU.
"""

from __future__ import annotations

import copy
import math
import multiprocessing
import os
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import Any

MiB = 1 << 20

#: Status of a :class:`Measurement`.
OK, FAILED, SKIPPED = "ok", "failed", "skipped"


class LaneUnavailable(Exception):
    """Raised inside a lane's process when an optional package lacks what it needs.

    The lane is then reported as ``skipped: <message>``, never as a failure.
    """


class VerificationError(Exception):
    """A frame did not hold the value it was written with."""


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
    """

    sizes: tuple[int, ...]
    schedule: Schedule = Schedule()
    n_consumers: int = 1
    workdir: str = ""
    frame_timeout: float = 20.0
    num_slots: int = 4
    device: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


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


# ------------------------------------------------------------------ loops
def _full_check(i: int, sched: Schedule) -> bool:
    """Whether frame ``i`` (0-based, all phases) gets a full verification."""
    return i < sched.warmup or i >= sched.warmup + sched.iters + sched.tput


#: Control messages that end the timed phases (consumer -> producer).
LAT_DONE, TPUT_DONE = b"lat-done", b"tput-done"


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
    out: dict[str, Any] = {}
    value = 0
    for nbytes in cfg.sizes:
        side = lane.open_producer(links, cfg, nbytes)
        lat: list[int] = []
        try:
            for _ in range(sched.warmup):
                value += 1
                side.send(value)
                side.wait_done(value, full=True)
            for _ in range(sched.iters):
                value += 1
                t0 = time.perf_counter_ns()
                side.send(value)
                side.wait_done(value, full=False)
                lat.append(time.perf_counter_ns() - t0)
            _flush_producer(side, "latency phase")
            for link in links:
                expect(link, LAT_DONE, cfg.frame_timeout + sched.iters)
            t0 = time.perf_counter_ns()
            for _ in range(sched.tput):
                value += 1
                side.send(value)
                if not lane.pipelined:
                    side.wait_done(value, full=False)
            _flush_producer(side, "throughput phase")
            for link in links:
                expect(link, TPUT_DONE, cfg.frame_timeout + sched.tput)
            tput_ns = time.perf_counter_ns() - t0
            if lane.pipelined:
                side.drain()
            for _ in range(sched.checks):
                value += 1
                side.send(value)
                side.wait_done(value, full=True)
        finally:
            side.close()
        for link in links:  # the consumers closed their side of this size
            expect(link, b"size-done", cfg.frame_timeout)
        out[str(nbytes)] = {
            "latencies_ns": lat,
            "tput_frames": sched.tput,
            "tput_ns": tput_ns,
            "failures": list(side.failures),
        }
    return out


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


# --------------------------------------------------------------- processes
def _child(role: str, lane: Lane, links: Any, result: Connection, cfg: BenchConfig) -> None:
    """Target of the spawned processes: run one side, send back one message."""
    try:
        multiprocessing.set_start_method("spawn", force=True)  # what CUDA libraries expect
        data = lane.producer(links, cfg) if role == "producer" else lane.consumer(links, cfg)
        result.send(("ok", data))
    except LaneUnavailable as exc:
        result.send(("skip", str(exc)))
    except ImportError as exc:
        result.send(("skip", f"{type(exc).__name__}: {exc}"))
    except BaseException as exc:
        result.send(("error", f"{role}: {type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        result.close()


@dataclass
class PairResult:
    """What the processes of one lane run sent back."""

    status: str
    reason: str = ""
    producer: dict[str, Any] = field(default_factory=dict)
    consumers: list[dict[str, Any]] = field(default_factory=list)
    traceback: str = ""


def run_pair(lane: Lane, cfg: BenchConfig, *, timeout: float) -> PairResult:
    """Spawn the lane's producer and consumer(s), wait for their results.

    Parameters
    ----------
    lane:
        The lane (pickled into the children).
    cfg:
        Sizes, schedule and fan-out; ``workdir`` is filled in here.
    timeout:
        Seconds the whole run may take before its processes are terminated.

    Returns
    -------
    PairResult
        ``status`` is ``"ok"``, ``"skipped"`` (a side raised
        :class:`LaneUnavailable` or ``ImportError``) or ``"failed"`` (an
        exception, a crash or the timeout; ``reason`` says which).
    """
    ctx = multiprocessing.get_context("spawn")
    workdir = tempfile.mkdtemp(prefix="cipbench-")
    cfg = replace(cfg, workdir=workdir)
    n_cons = cfg.n_consumers if lane.processes == 2 else 0
    procs: list[Any] = []
    results: list[Connection] = []
    child_ends: list[Connection] = []  # closed here once the children have their copies
    replies: list[Any] = []
    try:
        sent = lane.prepare(ctx)
        pairs = [ctx.Pipe(duplex=True) for _ in range(n_cons)]
        roles: list[tuple[str, Any]] = [("producer", [p[0] for p in pairs])]
        roles += [("consumer", p[1]) for p in pairs]
        for p in pairs:
            child_ends += p
        for i, (role, links) in enumerate(roles):
            r_recv, r_send = ctx.Pipe(duplex=False)
            results.append(r_recv)
            child_ends.append(r_send)
            name = f"bench-{lane.name}-{role}{i if role == 'consumer' else ''}"
            procs.append(
                ctx.Process(
                    target=_child, args=(role, sent, links, r_send, cfg), name=name, daemon=True
                )
            )
        for proc in procs:
            proc.start()
        # Without our copies, a child that dies shows up as EOF on its peers and here.
        for c in child_ends:
            c.close()
        replies = _collect(procs, results, timeout)
    finally:
        for c in child_ends + results:
            c.close()
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        shutil.rmtree(workdir, ignore_errors=True)
    return _combine(replies)


#: Seconds the other sides get to report their own error once one side has failed.
FAILURE_GRACE_S = 3.0

#: Error texts that are usually the consequence of the peer's failure, not its cause.
_CONSEQUENCES = ("EOFError", "EndOfStream", "TimeoutError", "BrokenPipe", "ConnectionReset")


def _collect(procs: list[Any], results: list[Connection], timeout: float) -> list[Any]:
    """Wait for one reply per process; a dead or late process gets an error reply.

    Once a side has failed, the others get :data:`FAILURE_GRACE_S` to report
    (they usually fail too, and one of them may hold the real cause) and are
    then given up on rather than waited for until their own timeouts.
    """
    deadline = time.monotonic() + timeout
    replies: list[Any] = [None] * len(procs)
    pending = {id(c): i for i, c in enumerate(results)}
    late = f"no result within {timeout:.0f} s"
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            for i in pending.values():
                replies[i] = ("error", f"{procs[i].name}: {late}", "")
            break
        conns = [results[i] for i in pending.values()]
        for c in wait(conns, timeout=min(remaining, 1.0)):
            i = pending.pop(id(c))
            try:
                replies[i] = results[i].recv()
            except EOFError:
                procs[i].join(5)
                replies[i] = ("error", f"{procs[i].name} died (exit code {procs[i].exitcode})", "")
        if pending and any(r is not None and r[0] != "ok" for r in replies):
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            late = "stopped after its peer failed"
    return replies


def _rank(error: Any) -> int:
    text = error[1]
    if "stopped after its peer failed" in text:
        return 3
    if any(c in text for c in _CONSEQUENCES):
        return 2
    return 1 if " died " in text else 0


def _combine(replies: list[Any]) -> PairResult:
    skips = [r[1] for r in replies if r[0] == "skip"]
    if skips:
        return PairResult(SKIPPED, skips[0])
    errors = sorted((r for r in replies if r[0] == "error"), key=_rank)
    if errors:
        reason = errors[0][1]
        others = [e[1] for e in errors[1:] if _rank(e) < 3]
        if others:
            reason += " (then: " + "; ".join(others) + ")"
        return PairResult(FAILED, reason, traceback=errors[0][2] if len(errors[0]) > 2 else "")
    return PairResult(OK, producer=replies[0][1], consumers=[r[1] for r in replies[1:]])


# -------------------------------------------------------------------- stats
def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation, as ``numpy.percentile``.

    Raises
    ------
    ValueError
        ``samples`` is empty or ``q`` is outside 0..100.
    """
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in 0..100, got {q}")
    s = sorted(samples)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Measurement:
    """One cell of the result table: a lane at a frame size.

    Latencies are in microseconds; ``fps`` in frames per second.  ``status``
    is ``"ok"``, ``"failed"`` (with ``reason``) or ``"skipped"`` (with
    ``reason``); numbers are None unless ``"ok"``.
    """

    lane: str
    nbytes: int
    status: str
    reason: str = ""
    p50_us: float | None = None
    p99_us: float | None = None
    mean_us: float | None = None
    min_us: float | None = None
    max_us: float | None = None
    fps: float | None = None
    pipelined: bool = False
    frames_verified: int = 0
    full_checks: int = 0
    samples_us: list[float] = field(default_factory=list)

    @property
    def size_mib(self) -> float:
        """Frame size in MiB."""
        return self.nbytes / MiB

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (with ``size_mib``)."""
        d = asdict(self)
        d["size_mib"] = self.size_mib
        return d


def summarize(
    lane: str,
    nbytes: int,
    latencies_ns: Sequence[int],
    *,
    tput_frames: int,
    tput_ns: int,
    pipelined: bool,
    frames_verified: int = 0,
    full_checks: int = 0,
) -> Measurement:
    """Turn raw timings into a :class:`Measurement` (``status="ok"``).

    Throughput is ``tput_frames / tput_ns``; where that phase did not run
    (``tput_frames == 0``) it falls back to ``1 / mean round trip``.
    """
    if not latencies_ns:
        raise ValueError(f"{lane}: no latency samples")
    us = [v / 1e3 for v in latencies_ns]
    mean = sum(us) / len(us)
    if tput_frames > 0 and tput_ns > 0:
        fps = tput_frames * 1e9 / tput_ns
    else:
        fps = 1e6 / mean if mean > 0 else float("inf")
    return Measurement(
        lane=lane,
        nbytes=nbytes,
        status=OK,
        p50_us=percentile(us, 50),
        p99_us=percentile(us, 99),
        mean_us=mean,
        min_us=min(us),
        max_us=max(us),
        fps=fps,
        pipelined=pipelined,
        frames_verified=frames_verified,
        full_checks=full_checks,
        samples_us=[round(v, 3) for v in us],
    )


def measurements_from(lane: Lane, cfg: BenchConfig, res: PairResult) -> list[Measurement]:
    """One :class:`Measurement` per size from a lane run (FAILED wherever data was wrong)."""
    out = []
    for nbytes in cfg.sizes:
        if res.status != OK:
            out.append(Measurement(lane.name, nbytes, res.status, res.reason))
            continue
        key = str(nbytes)
        prod = res.producer.get(key)
        if prod is None:
            out.append(Measurement(lane.name, nbytes, FAILED, "the producer sent no result"))
            continue
        problems = list(prod.get("failures", []))
        verified = full = 0
        for i, cons in enumerate(res.consumers):
            c = cons.get(key, {})
            if c.get("n_failures", 0):
                problems.append(
                    f"consumer {i}: {c['n_failures']} bad frame(s), first: {c['failures'][0]}"
                )
            verified += c.get("verified", 0)
            full += c.get("full_checks", 0)
        expected = cfg.schedule.total * (len(res.consumers) or 1)
        if not res.consumers:  # in-process floor: the producer verified every frame
            verified, full = expected, cfg.schedule.warmup + cfg.schedule.checks
        if not problems and verified != expected:
            problems.append(f"{verified} of {expected} frames verified")
        if problems:
            out.append(
                Measurement(lane.name, nbytes, FAILED, "verification failed: " + problems[0])
            )
            continue
        out.append(
            summarize(
                lane.name,
                nbytes,
                prod["latencies_ns"],
                tput_frames=prod["tput_frames"],
                tput_ns=prod["tput_ns"],
                pipelined=lane.pipelined,
                frames_verified=verified,
                full_checks=full,
            )
        )
    return out


def run_lane(lane: Lane, cfg: BenchConfig, *, timeout: float | None = None) -> list[Measurement]:
    """Measure ``lane`` at every size of ``cfg`` (skipped lanes are reported, not hidden).

    Parameters
    ----------
    lane:
        The lane.
    cfg:
        Sizes, schedule, fan-out.
    timeout:
        Seconds for the whole run (default: generous, from the sizes and schedule).

    Returns
    -------
    list of Measurement
        One per size, in the order of ``cfg.sizes``.
    """
    reason = lane.available()
    if reason is not None:
        return [Measurement(lane.name, n, SKIPPED, reason) for n in cfg.sizes]
    if timeout is None:
        timeout = 120.0 + sum(cfg.schedule.total * (0.001 + n / 1e9) * 4 for n in cfg.sizes)
    return measurements_from(lane, cfg, run_pair(lane, cfg, timeout=timeout))


def with_copy(lane: Lane, **attrs: Any) -> Lane:
    """A shallow copy of ``lane`` with ``attrs`` set (used by :meth:`Lane.prepare`)."""
    new = copy.copy(lane)
    for k, v in attrs.items():
        setattr(new, k, v)
    return new
