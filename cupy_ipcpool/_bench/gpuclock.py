"""Where a frame's time goes, on the GPU's own clock: ``python -m cupy_ipcpool bench --gpu-clock``.

For the channel's lanes (block mode, and frames handed out ahead), the ordered
floor and the in-process floor this measures, per frame size, over the latency
phase's frames (warm-up excluded):

(a) **one way on the GPU**: the producer's fill kernel done → the consumer's
    check kernel starting, both read from ``%globaltimer`` (ns; one clock for
    every context on the GPU).  The fill and the check are the lanes' own
    kernels (:class:`~.lanes.GpuWork`) launched in their clocked variants
    (``cipbench_fill_clock`` / ``cipbench_check_clock``: the same bodies plus a
    timestamp inside the same kernel, no extra launch).  The fill's stamp is
    taken by each block after it has issued its last write, the latest block's
    kept (``atomicMax``); the check's before its first read.  Each side keeps
    its stamps in a device array indexed by frame (:class:`~.lanes.GpuClock`),
    copied to the host once after the size's frames, and sent back with the
    side's results (the harness's result pipe).  The in-process floor's fill
    and check share one stream: its figure is the fill's end → the check's
    start on that stream;
(b) **the round trip**, timed on the producer's host as every lane times it
    (:func:`~.interface.producer_loop`);
(c) **host CPU time per frame** of each side: ``time.process_time_ns`` (the
    whole process) and ``time.thread_time_ns`` (the thread that runs the
    frames) from the start of the first timed frame to the end of the last,
    divided by the frames.

Nothing here needs a GPU to import; the lanes are wrapped (:class:`ClockedLane`)
rather than changed, and everything but the kernels runs on a CPU in the tests
with a host stand-in for :class:`~.lanes.GpuWork`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from multiprocessing.connection import Connection
from typing import Any

from . import report
from .harness import FAILED, OK, SKIPPED, PairResult, measurements_from, percentile, run_pair
from .interface import (
    BenchConfig,
    ConsumerSide,
    Lane,
    ProducerSide,
    Schedule,
    consumer_loop,
    producer_loop,
    with_copy,
)

MiB = 1 << 20

#: The lanes the measurement covers, in report order.
GPU_CLOCK_LANES = (
    "cupy_ipcpool",
    "cupy_ipcpool_ahead",
    "cupy_ipcpool_ahead_spin",
    "ordered_floor",
    "inprocess_floor",
)
GPU_CLOCK_SIZES_MIB = (1, 64)
#: Timed frames per lane and size (``--iters``), warm-up frames before them.
GPU_CLOCK_ITERS = 2000
GPU_CLOCK_WARMUP = 100
GPU_CLOCK_CHECKS = 2
#: Ring depth: cupy_ipcpool's default (the figures of docs/performance.md).
GPU_CLOCK_SLOTS = 4
#: Quantiles reported for every series.
QUANTILES = (50, 90, 99)

NOTES = (
    "GPU one way: %globaltimer (ns, one clock for every context on the GPU) read inside the "
    "lanes' own kernels: by the producer's fill at its end (each block after issuing its last "
    "write, the latest block kept) and by the consumer's check at its start (before its first "
    "read); no extra kernel, no host synchronisation per frame (the stamps stay in a device "
    "array per side and are copied back once per size). The in-process floor's fill and check "
    "share one stream: its figure is the fill's end -> the check's start.",
    "Round trip: the producer's host, as the lanes time it (write -> hand over -> the consumer "
    "enqueues its check -> done -> the producer sees it).",
    "Host CPU per frame: process CPU time (all the process's threads) from the start of the "
    "first timed frame to the end of the last, divided by the frames; the main thread's alone "
    "is in the JSON (thread_us).",
    "Statistics over the latency phase's frames, warm-up excluded; the channel in block mode, "
    "a ring of num_slots slots.",
)


def schedule_for(iters: int = GPU_CLOCK_ITERS, warmup: int = GPU_CLOCK_WARMUP) -> Schedule:
    """The schedule of one lane and size: warm-up, ``iters`` timed frames, no throughput phase."""
    if iters <= 0:
        raise ValueError(f"iters must be positive, got {iters}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    return Schedule(warmup=warmup, iters=iters, tput=0, checks=GPU_CLOCK_CHECKS)


def check_lanes(names: Sequence[str] | None) -> tuple[str, ...]:
    """The lanes to measure (default :data:`GPU_CLOCK_LANES`), or ValueError naming the others."""
    if names is None:
        return GPU_CLOCK_LANES
    other = [n for n in names if n not in GPU_CLOCK_LANES]
    if other:
        raise ValueError(
            f"--gpu-clock measures {', '.join(GPU_CLOCK_LANES)}; not {', '.join(other)}"
        )
    return tuple(n for n in GPU_CLOCK_LANES if n in names)


# ------------------------------------------------------------- in the sides
class HostCpu:
    """CPU time of one side over the frames ``first..last`` (0-based frame indices)."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self._t0: tuple[int, int, int] | None = None
        self.result: dict[str, int] | None = None

    @staticmethod
    def _now() -> tuple[int, int, int]:
        return time.process_time_ns(), time.thread_time_ns(), time.perf_counter_ns()

    def begin(self, frame: int) -> None:
        """At the start of frame ``frame``."""
        if frame == self.first:
            self._t0 = self._now()

    def end(self, frame: int) -> None:
        """At the end of frame ``frame``."""
        if frame == self.last and self._t0 is not None:
            t1 = self._now()
            self.result = {
                "process_ns": t1[0] - self._t0[0],
                "thread_ns": t1[1] - self._t0[1],
                "wall_ns": t1[2] - self._t0[2],
                "frames": self.last - self.first + 1,
            }


def _start_clock(side: Any, frames: int) -> Any:
    """Start the GPU clock of ``side``'s work (every lane measured here has ``side.work``)."""
    work = getattr(side, "work", None)
    if work is None or not hasattr(work, "start_clock"):
        raise RuntimeError(f"{type(side).__name__} has no GpuWork to take GPU timestamps with")
    return work.start_clock(frames)


class _Clocked:
    """What both clocked sides share: the frame counter, the clock, the CPU times."""

    def __init__(self, inner: Any, cfg: BenchConfig) -> None:
        sched = cfg.schedule
        self.inner = inner
        self.frame = -1
        self.host = HostCpu(sched.warmup, sched.warmup + sched.iters - 1)
        self.record: dict[str, Any] | None = None
        try:
            self.clock = _start_clock(inner, sched.total)
        except BaseException:
            inner.close()
            raise

    def begin(self) -> None:
        self.frame += 1
        self.host.begin(self.frame)
        self.clock.frame = self.frame

    def end(self) -> None:
        self.host.end(self.frame)

    def collect(self) -> dict[str, Any]:
        try:
            stamps = self.clock.to_host()
        except Exception as exc:  # reported by the aggregation, not raised over the lane's error
            return {"error": f"{type(exc).__name__}: {exc}", "host": self.host.result}
        return {"stamps": stamps, "host": self.host.result, "frames": self.frame + 1}


class ClockedProducer(ProducerSide):
    """A lane's producer side whose frames are counted, GPU-stamped and CPU-timed."""

    def __init__(self, inner: ProducerSide, cfg: BenchConfig) -> None:
        super().__init__()
        self.inner = inner
        self.failures = inner.failures  # one list: the loop reads it after close
        self.clocked = _Clocked(inner, cfg)

    def send(self, value: int) -> None:
        self.clocked.begin()
        self.inner.send(value)

    def wait_done(self, value: int, *, full: bool) -> None:
        self.inner.wait_done(value, full=full)
        self.clocked.end()

    def flush_checks(self) -> int:
        return self.inner.flush_checks()

    def drain(self) -> None:
        self.inner.drain()

    def close(self) -> None:
        try:
            self.inner.close()  # waits for the side's stream
        finally:
            self.clocked.record = self.clocked.collect()


class ClockedConsumer(ConsumerSide):
    """A lane's consumer side whose frames are counted, GPU-stamped and CPU-timed."""

    def __init__(self, inner: ConsumerSide, cfg: BenchConfig) -> None:
        self.inner = inner
        self.clocked = _Clocked(inner, cfg)

    def step(self, *, full: bool) -> tuple[int, bool]:
        self.clocked.begin()
        out = self.inner.step(full=full)
        self.clocked.end()
        return out

    def flush_checks(self) -> int:
        return self.inner.flush_checks()

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self.clocked.record = self.clocked.collect()


class ClockedLane(Lane):
    """``inner`` with GPU timestamps and CPU times; each size's result gains ``"gpu_clock"``.

    The sides are the lane's own, wrapped (:class:`ClockedProducer`,
    :class:`ClockedConsumer`); the loops are the harness's, so the schedule,
    the verification and the round trip are exactly the lane's.
    """

    def __init__(self, inner: Lane) -> None:
        self.inner = inner
        self.name = inner.name
        self.title = inner.title
        self.processes = inner.processes
        self.pipelined = inner.pipelined
        self.sync_note = inner.sync_note
        self._sides: dict[str, _Clocked] = {}

    def available(self) -> str | None:
        return self.inner.available()

    def prepare(self, ctx: Any) -> Lane:
        return with_copy(self, inner=self.inner.prepare(ctx), _sides={})

    def open_producer(
        self, links: Sequence[Connection], cfg: BenchConfig, nbytes: int
    ) -> ProducerSide:
        side = ClockedProducer(self.inner.open_producer(links, cfg, nbytes), cfg)
        self._sides[str(nbytes)] = side.clocked
        return side

    def open_consumer(self, link: Connection, cfg: BenchConfig, nbytes: int) -> ConsumerSide:
        side = ClockedConsumer(self.inner.open_consumer(link, cfg, nbytes), cfg)
        self._sides[str(nbytes)] = side.clocked
        return side

    def _attach(self, out: dict[str, Any]) -> dict[str, Any]:
        for key, clocked in self._sides.items():
            if key in out:
                out[key]["gpu_clock"] = clocked.record or {"error": "the side was never closed"}
        return out

    def producer(self, links: Sequence[Connection], cfg: BenchConfig) -> dict[str, Any]:
        self._sides = {}
        return self._attach(producer_loop(self, links, cfg))

    def consumer(self, link: Connection, cfg: BenchConfig) -> dict[str, Any]:
        self._sides = {}
        return self._attach(consumer_loop(self, link, cfg))


# -------------------------------------------------------------- aggregation
def stats(samples: Sequence[float]) -> dict[str, Any]:
    """``n``, ``p50``/``p90``/``p99``, ``mean``, ``min``, ``max`` of ``samples`` (None if empty)."""
    if not samples:
        return {
            "n": 0,
            **{f"p{q}": None for q in QUANTILES},
            "mean": None,
            "min": None,
            "max": None,
        }
    return {
        "n": len(samples),
        **{f"p{q}": percentile(samples, q) for q in QUANTILES},
        "mean": sum(samples) / len(samples),
        "min": min(samples),
        "max": max(samples),
    }


def one_way_us(
    fill_end_ns: Sequence[int], check_start_ns: Sequence[int], frames: range
) -> tuple[list[float], int, int]:
    """Per frame of ``frames``: check start - fill end in µs; and the missing, negative counts.

    A frame whose either stamp is 0 (never written) is missing, not a sample;
    a negative difference (the check started before the fill ended: the
    ordering is broken, or the clock is not one clock) is kept and counted.
    """
    out: list[float] = []
    missing = negative = 0
    for i in frames:
        end = fill_end_ns[i] if i < len(fill_end_ns) else 0
        start = check_start_ns[i] if i < len(check_start_ns) else 0
        if not end or not start:
            missing += 1
            continue
        d = (start - end) / 1e3
        negative += d < 0
        out.append(d)
    return out, missing, negative


def cpu_per_frame_us(host: dict[str, Any] | None) -> dict[str, float] | None:
    """Process and thread CPU µs per frame (and the CPU's share of the wall time)."""
    if not host or not host.get("frames"):
        return None
    n = host["frames"]
    out = {"process_us": host["process_ns"] / n / 1e3, "thread_us": host["thread_ns"] / n / 1e3}
    if host.get("wall_ns"):
        out["process_share_of_wall"] = host["process_ns"] / host["wall_ns"]
    return out


def _record_error(rec: dict[str, Any] | None, who: str) -> str | None:
    if rec is None:
        return f"the {who} sent no GPU clock"
    if "error" in rec:
        return f"the {who}'s GPU clock: {rec['error']}"
    return None


def cell(lane: str, nbytes: int, cfg: BenchConfig, res: PairResult) -> dict[str, Any]:
    """One lane at one size: the three figures, from the lane run's results.

    ``status`` is the lane's own (verification, errors, skips:
    :func:`~.harness.measurements_from`), or ``failed`` when the GPU clock
    did not come back.
    """
    sched = cfg.schedule
    row: dict[str, Any] = {"lane": lane, "nbytes": nbytes, "size_mib": nbytes / MiB}
    if res.status != OK:
        return {**row, "status": res.status, "reason": res.reason}
    key = str(nbytes)
    prod = res.producer.get(key) or {}
    (m,) = measurements_from(_Named(lane), replace(cfg, sizes=(nbytes,)), res)
    if m.status != OK:
        return {**row, "status": m.status, "reason": m.reason}
    prec = prod.get("gpu_clock")
    crecs = [c.get(key, {}).get("gpu_clock") for c in res.consumers]
    errors = [_record_error(prec, "producer")]
    errors += [_record_error(c, f"consumer {i}") for i, c in enumerate(crecs)]
    first_error = next((e for e in errors if e), None)
    if first_error:
        return {**row, "status": FAILED, "reason": first_error}
    assert prec is not None
    window = range(sched.warmup, sched.warmup + sched.iters)
    fill_end = prec["stamps"]["fill_end_ns"]
    samples: list[float] = []
    missing = negative = 0
    for crec in crecs or [prec]:  # the in-process floor: its own check
        assert crec is not None
        s, mi, ne = one_way_us(fill_end, crec["stamps"]["check_start_ns"], window)
        samples += s
        missing += mi
        negative += ne
    rtt = [v / 1e3 for v in prod["latencies_ns"]]
    return {
        **row,
        "status": OK,
        "reason": "",
        "frames": sched.iters,
        "warmup": sched.warmup,
        "consumers": len(crecs),
        "gpu_one_way_us": stats(samples),
        "gpu_one_way_missing": missing,
        "gpu_one_way_negative": negative,
        "round_trip_us": stats(rtt),
        "producer_cpu": cpu_per_frame_us(prec.get("host")),
        "consumer_cpu": [cpu_per_frame_us(c.get("host")) for c in crecs if c is not None],
        "gpu_one_way_samples_us": [round(v, 3) for v in samples],
        "round_trip_samples_us": [round(v, 3) for v in rtt],
    }


class _Named(Lane):
    """A lane as :func:`~.harness.measurements_from` needs it: a name, nothing else."""

    def __init__(self, name: str) -> None:
        self.name = name


def lane_timeout(cfg: BenchConfig) -> float:
    """Seconds one lane's process pair may take over all of ``cfg``'s sizes."""
    frames = cfg.schedule.total
    return 30.0 + sum(frames * (0.002 + n / 50e9) for n in cfg.sizes)


# ------------------------------------------------------------------ running
def gpu_sharing(device: int = 0) -> str:
    """``"MPS"``, ``"time-sliced"`` or ``"unknown: why"`` (CU_DEVICE_ATTRIBUTE_MPS_ENABLED)."""
    try:
        from .. import _driver

        mps = _driver.device_info(device).mps
    except Exception as exc:
        return f"unknown: {type(exc).__name__}: {exc}"
    if mps is None:
        return "unknown: the driver does not say"
    return "MPS" if mps else "time-sliced"


def run_gpu_clock(
    lanes: Sequence[Lane],
    sizes: Sequence[int],
    *,
    iters: int = GPU_CLOCK_ITERS,
    warmup: int = GPU_CLOCK_WARMUP,
    device: int = 0,
    num_slots: int = GPU_CLOCK_SLOTS,
    environment: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
    partial: Callable[[dict[str, Any]], object] | None = None,
) -> dict[str, Any]:
    """Measure ``lanes`` (each in its own process pair, over every size) on the GPU's clock.

    Parameters
    ----------
    lanes:
        The lanes (wrapped in :class:`ClockedLane` here).
    sizes:
        Frame sizes in bytes.
    iters, warmup:
        Timed frames and warm-up frames per lane and size.
    partial:
        Called with the results so far after each lane (to write them as it goes).

    Returns
    -------
    dict
        JSON-ready: ``kind``, ``gpu_sharing``, ``config``, ``environment``,
        ``cells`` (one per lane and size, :func:`cell`), ``notes``.
    """
    sched = schedule_for(iters, warmup)
    cfg = BenchConfig(
        sizes=tuple(sizes), schedule=sched, n_consumers=1, num_slots=num_slots, device=device
    )
    out: dict[str, Any] = {
        "kind": "gpu_clock",
        "gpu_sharing": gpu_sharing(device),
        "config": {
            "lanes": [lane.name for lane in lanes],
            "sizes_mib": [n / MiB for n in sizes],
            "schedule": asdict(sched),
            "num_slots": num_slots,
            "device": device,
            "mode": "block",
        },
        "environment": environment or {},
        "cells": [],
        "notes": list(NOTES),
    }
    for lane in lanes:
        reason = lane.available()
        if reason is not None:
            res = PairResult(SKIPPED, reason)
        else:
            res = run_pair(ClockedLane(lane), cfg, timeout=lane_timeout(cfg))
        for nbytes in sizes:
            c = cell(lane.name, nbytes, cfg, res)
            out["cells"].append(c)
            if progress is not None:
                progress(progress_line(c))
        if partial is not None:
            partial(out)
    return out


def failed_cells(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The cells whose lane failed (skipped ones are not failures)."""
    return [c for c in results.get("cells", []) if c.get("status") == FAILED]


# ------------------------------------------------------------------- report
def _pair(s: dict[str, Any] | None) -> str:
    if not s or s.get("n", 0) == 0:
        return "-"
    return f"{report.fmt_num(s['p50'])} / {report.fmt_num(s['p90'])}"


def _cpu(c: dict[str, Any] | None) -> str:
    return "-" if not c else report.fmt_num(c["process_us"])


def _note(c: dict[str, Any]) -> str:
    parts = []
    if c.get("gpu_one_way_negative"):
        parts.append(f"{c['gpu_one_way_negative']} frame(s) with the check before the fill's end")
    if c.get("gpu_one_way_missing"):
        parts.append(f"{c['gpu_one_way_missing']} frame(s) without a stamp")
    return "; ".join(parts)


def progress_line(c: dict[str, Any]) -> str:
    """One line per cell for the progress display."""
    head = f"[bench] gpu-clock {c['lane']:<16} {report.fmt_size(c['nbytes']):>8}: "
    if c["status"] != OK:
        return head + (
            f"skipped: {c['reason']}" if c["status"] == SKIPPED else f"FAILED: {c['reason']}"
        )
    cons = c["consumer_cpu"][0] if c["consumer_cpu"] else None
    return head + (
        f"GPU one way p50/p90 {_pair(c['gpu_one_way_us'])} us  "
        f"round trip {_pair(c['round_trip_us'])} us  "
        f"CPU/frame producer {_cpu(c['producer_cpu'])} consumer {_cpu(cons)} us"
    )


TABLE_HEAD = (
    "| GPU sharing | lane | size | GPU one way p50 / p90 (µs) | round trip p50 / p90 (µs) "
    "| producer CPU (µs/frame) | consumer CPU (µs/frame) | frames | notes |"
)


def table_rows(results: dict[str, Any]) -> list[str]:
    """The table's rows of one run (:func:`run_gpu_clock`'s result)."""
    sharing = str(results.get("gpu_sharing", "?")).split(":")[0]  # "unknown: why" -> "unknown"
    rows = []
    for c in results.get("cells", []):
        size = report.fmt_size(c["nbytes"])
        if c["status"] != OK:
            text = "skipped" if c["status"] == SKIPPED else "FAILED"
            rows.append(f"| {sharing} | {c['lane']} | {size} | {text}: {c['reason']} | | | | | |")
            continue
        cons = c["consumer_cpu"][0] if c["consumer_cpu"] else None
        rows.append(
            f"| {sharing} | {c['lane']} | {size} | {_pair(c['gpu_one_way_us'])} "
            f"| {_pair(c['round_trip_us'])} | {_cpu(c['producer_cpu'])} | {_cpu(cons)} "
            f"| {c['frames']} | {_note(c)} |"
        )
    return rows


def markdown(runs: Sequence[dict[str, Any]]) -> str:
    """One table for one or more runs (e.g. time-sliced, then MPS), and the notes."""
    ncols = TABLE_HEAD.count("|") - 1
    lines = [TABLE_HEAD, "|" + " --- |" * ncols]
    for r in runs:
        lines += table_rows(r)
    notes = runs[0].get("notes", NOTES) if runs else NOTES
    lines += ["", *[f"- {n}" for n in notes]]
    if any(c["lane"] == "inprocess_floor" for r in runs for c in r.get("cells", [])):
        lines.append(
            "- inprocess_floor: one process (its consumer CPU is the producer's); its GPU "
            "one way is the fill's end -> the check's start on one stream."
        )
    return "\n".join(lines) + "\n"


def write_outputs(results: dict[str, Any], outdir: str, *, stem: str = "gpuclock") -> list[str]:
    """Write ``<stem>.json`` and ``<stem>.md`` to ``outdir``; the paths."""
    import os

    os.makedirs(outdir, exist_ok=True)
    js = os.path.join(outdir, f"{stem}.json")
    md = os.path.join(outdir, f"{stem}.md")
    report.write_json(js, results)
    report.write_markdown(md, markdown([results]))
    return [js, md]


def load(path: str) -> dict[str, Any]:
    """A run's JSON, checked to be one (ValueError otherwise)."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("kind") != "gpu_clock":
        raise ValueError(f"{path} is not the JSON of a gpu-clock run")
    return data


def main(argv: Sequence[str] | None = None) -> int:
    """``table FILE...``: one table for several runs (what ``scripts/gpu-clock`` prints).

    Called as ``python -c 'import sys; from cupy_ipcpool._bench.gpuclock import main;
    sys.exit(main())' table FILE...`` (``python -m`` on this module would import it
    twice: the package imports it).
    """
    p = argparse.ArgumentParser(
        prog="gpu-clock",
        description="Print one table of gpu-clock runs (their JSON files, in order).",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="one Markdown table of the runs' JSON files")
    t.add_argument("files", nargs="+")
    t.add_argument("--out", default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    try:
        runs = [load(f) for f in args.files]
    except (OSError, ValueError) as exc:
        print(f"gpu-clock table: {exc}", file=sys.stderr)
        return 1
    text = markdown(runs)
    if args.out:
        report.write_markdown(args.out, text)
    print(text, end="")
    return 1 if any(failed_cells(r) for r in runs) else 0
