"""Run one lane of the comparative benchmark in spawned processes and time it.

:func:`run_pair` spawns the producer and the consumer(s) of a
:class:`~.interface.Lane` with ``multiprocessing`` ``spawn``, joins them with a
duplex pipe per consumer (``links``), and collects what each side measured
(:func:`~.interface.producer_loop`, :func:`~.interface.consumer_loop`); a side
that fails, dies or runs late is reported, with the most likely cause first.
:func:`run_lane` turns that into one :class:`Measurement` per frame size.
Nothing here imports CuPy, and the machinery is tested on CPU-only machines
with a lane that needs no GPU.
"""

from __future__ import annotations

import math
import multiprocessing
import shutil
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import Any

from .interface import TURN_DONE, TURN_GO, BenchConfig, Lane, LaneUnavailable

MiB = 1 << 20

#: Status of a :class:`Measurement`.
OK, FAILED, SKIPPED = "ok", "failed", "skipped"


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


@dataclass
class _Spawned:
    """The processes of one lane run, and what is needed to collect and reap them."""

    procs: list[Any]
    results: list[Connection]
    child_ends: list[Connection]
    workdir: str
    turns: Connection | None = None  # the parent's end of the producer's turn pipe
    # What lane.prepare() made, kept for the run: a child unpickles its arguments after
    # start() returns, and a queue's semaphores are unlinked once the parent drops it.
    sent: Lane | None = None

    def close_child_ends(self) -> None:
        """Close our copies of the children's ends: a child that dies then shows as EOF."""
        for c in self.child_ends:
            c.close()

    def reap(self) -> None:
        """Close every pipe, end the processes that are still there, remove the workdir."""
        for c in self.child_ends + self.results + ([self.turns] if self.turns else []):
            c.close()
        for proc in self.procs:
            if proc.pid is None:  # its start failed (or never came)
                continue
            if proc.is_alive():
                proc.terminate()
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _spawn(lane: Lane, cfg: BenchConfig, ctx: Any, *, turns: bool = False) -> _Spawned:
    """Start the lane's producer and consumer(s); with ``turns``, the producer takes turns."""
    workdir = tempfile.mkdtemp(prefix="cipbench-")
    cfg = replace(cfg, workdir=workdir)
    n_cons = cfg.n_consumers if lane.processes == 2 else 0
    run = _Spawned([], [], [], workdir)
    try:
        sent = run.sent = lane.prepare(ctx)
        pairs = [ctx.Pipe(duplex=True) for _ in range(n_cons)]
        producer_cfg = cfg
        if turns:
            run.turns, child_turns = ctx.Pipe(duplex=True)
            run.child_ends.append(child_turns)
            producer_cfg = replace(cfg, turns=child_turns)
        roles: list[tuple[str, Any, BenchConfig]] = [
            ("producer", [p[0] for p in pairs], producer_cfg)
        ]
        roles += [("consumer", p[1], cfg) for p in pairs]
        for p in pairs:
            run.child_ends += p
        for i, (role, links, role_cfg) in enumerate(roles):
            r_recv, r_send = ctx.Pipe(duplex=False)
            run.results.append(r_recv)
            run.child_ends.append(r_send)
            name = f"bench-{lane.name}-{role}{i if role == 'consumer' else ''}"
            run.procs.append(
                ctx.Process(
                    target=_child,
                    args=(role, sent, links, r_send, role_cfg),
                    name=name,
                    daemon=True,
                )
            )
        for proc in run.procs:
            proc.start()
    except BaseException:
        run.reap()
        raise
    return run


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
    run = _spawn(lane, cfg, multiprocessing.get_context("spawn"))
    try:
        run.close_child_ends()
        replies = _collect(run.procs, run.results, timeout)
    finally:
        run.reap()
    return _combine(replies)


#: Seconds one granted turn may take (a set-up turn opens the lane's side for a size).
TURN_TIMEOUT_S = 120.0


def run_turns(
    runs: Sequence[tuple[Lane, BenchConfig]],
    *,
    timeout: float | None = None,
    turn_timeout: float = TURN_TIMEOUT_S,
) -> list[PairResult]:
    """Run several lanes at once, their producers taking turns in rotation.

    Every lane's processes are started together; each producer then runs a
    phase only when granted a turn (:class:`~.interface.TurnGate`): per size
    the set-up and warm-up, each ``cfg.turn_frames`` latency frames, then the
    rest.  Round *r* grants one turn to every lane still running, the order
    rotated by *r*, so that each lane goes first as often as the others and
    lanes measured side by side share the machine's state from turn to turn.
    A lane whose producer ends (its result comes, or it dies) drops out of the
    rotation; a turn that takes longer than ``turn_timeout`` seconds fails
    that lane and ends its processes.  A lane that is not available here is
    skipped without spawning; ``timeout`` (default: the lanes'
    :func:`run_timeout` together) bounds the whole run.

    Returns
    -------
    list of PairResult
        One per run, in the order of ``runs``.
    """
    if len(runs) < 1:
        raise ValueError("run_turns needs a lane")
    if timeout is None:
        timeout = sum(run_timeout(cfg) for _lane, cfg in runs)
    unavailable = {i: why for i, (lane, _cfg) in enumerate(runs) if (why := lane.available())}
    ready = [run for i, run in enumerate(runs) if i not in unavailable]
    ctx = multiprocessing.get_context("spawn")
    spawned: list[_Spawned] = []
    late: dict[int, str] = {}  # index in ready -> why its turn failed
    replies: list[list[Any]] = []
    try:
        for lane, cfg in ready:
            spawned.append(_spawn(lane, cfg, ctx, turns=True))
        for run in spawned:
            run.close_child_ends()
        deadline = time.monotonic() + timeout
        active = list(range(len(spawned)))
        rnd = 0
        while active:
            k = rnd % len(active)
            for i in active[k:] + active[:k]:
                why = _grant_turn(spawned[i], min(turn_timeout, deadline - time.monotonic()))
                if why is None:
                    continue
                active.remove(i)
                if why:
                    late[i] = why
                    spawned[i].reap()
            rnd += 1
        for i, run in enumerate(spawned):
            left = max(deadline - time.monotonic(), FAILURE_GRACE_S)
            replies.append([] if i in late else _collect(run.procs, run.results, left))
    finally:
        for run in spawned:
            run.reap()
    done = iter(
        PairResult(FAILED, f"{ready[i][0].name}: {late[i]}") if i in late else _combine(rep)
        for i, rep in enumerate(replies)
    )
    return [
        PairResult(SKIPPED, unavailable[i]) if i in unavailable else next(done)
        for i in range(len(runs))
    ]


def _grant_turn(run: _Spawned, timeout: float) -> str | None:
    """Grant the producer of ``run`` a turn and wait for its end.

    Returns None when the turn ended, ``""`` when the producer has ended (its
    result or its error is on the result pipe), or why the turn failed.
    """
    conn = run.turns
    assert conn is not None
    try:
        conn.send_bytes(TURN_GO)
    except OSError:  # the producer closed its end: it returned or died
        return ""
    if timeout <= 0 or not conn.poll(timeout):
        return f"a turn took longer than {max(timeout, 0.0):.0f} s"
    try:
        msg = conn.recv_bytes()
    except (EOFError, OSError):  # it ended with our go unread (a reset, not an EOF)
        return ""
    if msg != TURN_DONE:
        return f"expected {TURN_DONE!r} on the turn pipe, got {msg[:40]!r}"
    return None


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
        timeout = run_timeout(cfg)
    return measurements_from(lane, cfg, run_pair(lane, cfg, timeout=timeout))


def run_timeout(cfg: BenchConfig) -> float:
    """Seconds one lane's run over all of ``cfg``'s sizes may take (generous)."""
    return 120.0 + sum(cfg.schedule.total * (0.001 + n / 1e9) * 4 for n in cfg.sizes)


def turn_measurements(m: Measurement, turn_frames: int, skip: int) -> list[Measurement]:
    """Split a lane's latency samples (in frame order) into one :class:`Measurement` per turn.

    Each turn's first ``skip`` frames are left out (the machine switching
    from another lane's turn to this one's).  A measurement that did not
    succeed is returned alone.

    Raises
    ------
    ValueError
        ``skip`` leaves no frame of a turn.
    """
    if not 0 <= skip < turn_frames:
        raise ValueError(f"skip must be in 0..{turn_frames - 1}, got {skip}")
    if m.status != OK:
        return [m]
    out = []
    for start in range(0, len(m.samples_us), turn_frames):
        us = m.samples_us[start + skip : start + turn_frames]
        if not us:
            continue
        out.append(
            replace(
                m,
                p50_us=percentile(us, 50),
                p99_us=percentile(us, 99),
                mean_us=sum(us) / len(us),
                min_us=min(us),
                max_us=max(us),
                fps=None,
                samples_us=list(us),
            )
        )
    return out
