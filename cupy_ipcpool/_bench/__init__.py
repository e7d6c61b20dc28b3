"""``python -m cupy_ipcpool bench``: handoff latency against the alternatives.

Runs every lane (:mod:`.lanes`) between two spawned processes on one GPU for
each frame size, then writes ``benchmarks.md``, ``benchmarks.json`` and
``latency_vs_size.png`` to the output directory.  ``add_arguments`` registers
the options on an ``argparse`` (sub)parser and sets ``run=main``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from typing import Any

from . import gpuclock, report
from ._targets import broken
from .harness import (
    FAILED,
    OK,
    Measurement,
    MiB,
    measurements_from,
    percentile,
    run_lane,
    run_pair,
    run_turns,
    turn_measurements,
)
from .interface import BenchConfig, Lane, Schedule
from .lanes import CHECK_SAMPLES, LANE_NAMES, AttachScanLane, CupyIpcPoolLane, get_lanes

__all__ = [
    "LANE_NAMES",
    "BenchOptions",
    "BenchResults",
    "add_arguments",
    "check_args",
    "check_outdir",
    "collect_environment",
    "default_notes",
    "gpu_missing_reason",
    "main",
    "options_from_args",
    "parse_lanes",
    "parse_sizes",
    "run_attach_scan",
    "run_benchmark",
    "run_fanout",
    "run_gpu_clock",
    "run_paired",
    "write_outputs",
]

MODES: dict[str, dict[str, Any]] = {
    "short": {"sizes_mib": (1, 64), "schedule": Schedule(warmup=5, iters=50, tput=50, checks=2)},
    "full": {
        "sizes_mib": (1, 4, 16, 64, 256, 1024),
        "schedule": Schedule(warmup=20, iters=300, tput=300, checks=3),
    },
}
ATTACH_SLOTS = (8, 64, 256, 1024)
ATTACH_SLOT_NBYTES = 2 * MiB
ATTACH_ITERS = 20
FANOUT = (1, 2, 4, 8)
FANOUT_NBYTES = 64 * MiB
#: The interleaved turns (:func:`run_paired`): the channel, the socket + GPU floor and the
#: ordered floor (the 1.3x guard is against it), at 1 MiB, 64 MiB (the guard's size) and 1 GiB.
#: The first two are needed; the others join when selected.
PAIRED_LANES = (report.BASELINE, "socket_gpu_floor", "ordered_floor")
#: The pairs the interleaved turns compare (numerator, denominator).
PAIRED_PAIRS = (
    (report.BASELINE, "socket_gpu_floor"),
    (report.BASELINE, "ordered_floor"),
    ("ordered_floor", "socket_gpu_floor"),
)
PAIRED_SIZES_MIB = (1, 64, 1024)
#: Latency frames per turn, and the first frames of each turn left out (the switch).
PAIRED_TURN_FRAMES = 50
PAIRED_TURN_SKIP = 5
#: Warm-up and check frames per size; the latency frames are turns x PAIRED_TURN_FRAMES.
PAIRED_SCHEDULE = Schedule(warmup=20, iters=PAIRED_TURN_FRAMES, tput=0, checks=2)
#: Turns of each lane per size, by mode (``--paired-turns`` overrides).
PAIRED_TURNS = {"short": 0, "full": 40}

NOTES = (
    "Every lane runs the same fill kernel in the producer and the same check in the "
    "consumer. On timed frames the check is a kernel enqueued on the consumer's stream: it "
    f"compares {CHECK_SAMPLES} evenly spaced elements (the first and the last among them) "
    "with the frame's value and adds mismatches to a device-side counter, read back once "
    "at the end of each timed phase; warm-up and check frames compare every element and "
    "wait for the answer. A lane whose data is wrong is FAILED, not timed.",
    "No lane waits for the GPU per frame unless its own correctness needs it (each lane's "
    "synchronisation is listed below). Without MPS the kernels of two processes are "
    "time-sliced, so a host wait on work that depends on the other process's kernel pays "
    "GPU context switches: that measures the GPU scheduler, not the handoff. Round trips "
    "are timed on the producer's host; the GPU work of a latency phase is waited for after "
    "it (untimed), and a throughput phase ends only once every consumer's checks completed.",
    "cupy_ipcpool's throughput keeps up to num_slots frames in flight; the other lanes hand "
    "over one frame at a time, as their round trip requires.",
    "socket_floor sends a message the size of a cupy_ipcpool FRAME over the same socket kind "
    "(SOCK_SEQPACKET) and one the size of a RELEASE back; socket_gpu_floor does that round "
    "trip with the same kernels, the producer filling its own array and the consumer "
    "checking its own zero-filled one (no data shared: the IPC-free floor of two processes "
    "each launching one kernel per frame plus one socket round trip); ordered_floor adds "
    "to it the channel's GPU ordering and nothing else (the four flag operations on a "
    "shared sync page: what a channel without per-frame bookkeeping would measure, so "
    "cupy_ipcpool's distance to it is the library's own cost); inprocess_floor "
    "enqueues the same fill and check in one process (its round trip is the host cost of "
    "that GPU work).",
)


def default_notes(lanes: Sequence[Lane] | None = None) -> list[str]:
    """:data:`NOTES` and the per-frame synchronisation of ``lanes`` (default: all)."""
    pairs = [(lane.name, lane.sync_note) for lane in get_lanes(None)]
    if lanes is not None:
        names = {lane.name for lane in lanes}
        pairs = [p for p in pairs if p[0] in names]
    return list(NOTES) + report.sync_notes(pairs)


# --------------------------------------------------------------------- CLI
def parse_sizes(text: str) -> tuple[int, ...]:
    """``"1,64,1024"`` -> frame sizes in MiB (positive ints; order kept, duplicates dropped).

    A size may carry its unit: ``"1MiB,64MiB,1GiB"`` is the same list.

    Raises
    ------
    argparse.ArgumentTypeError
        Not a comma-separated list of positive integers (an empty item too).
    """
    out: list[int] = []
    for part in _items(text, "frame size"):
        scale = 1
        low = part.lower()
        if low.endswith("gib"):
            part, scale = part[:-3].strip(), 1024
        elif low.endswith("mib"):
            part = part[:-3].strip()
        try:
            v = int(part) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"frame size {part!r} is not an integer (MiB)"
            ) from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"frame size must be positive, got {v}")
        if v not in out:
            out.append(v)
    if not out:
        raise argparse.ArgumentTypeError("no frame size given")
    return tuple(out)


def _items(text: str, what: str) -> list[str]:
    """The items of a comma-separated list, stripped; an empty one is an error.

    Raises
    ------
    argparse.ArgumentTypeError
        No item, or an empty one (``a,,b``, a comma at either end), named with ``what``.
    """
    items = [p.strip() for p in text.split(",")]
    if items == [""]:
        raise argparse.ArgumentTypeError(f"no {what} given")
    if "" in items:
        raise argparse.ArgumentTypeError(
            f"{text!r} has an empty {what} (two commas in a row, or one at either end)"
        )
    return items


def parse_lanes(text: str) -> tuple[str, ...]:
    """``"cupy_ipcpool,host_staging"`` -> lane names (checked against :data:`LANE_NAMES`).

    Raises
    ------
    argparse.ArgumentTypeError
        An unknown lane, an empty item or an empty list.
    """
    names = tuple(dict.fromkeys(_items(text, "lane")))
    unknown = [n for n in names if n not in LANE_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown lane(s) {', '.join(unknown)}; choose from {', '.join(LANE_NAMES)}"
        )
    return names


def _int_at_least(text: str, low: int, bound: str) -> int:
    """``text`` as an int of at least ``low`` (``bound`` says so in the error)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"must be {bound}, got {v}")
    return v


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1, "positive")


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, ">= 0")


def check_outdir(args: argparse.Namespace) -> None:
    """Fail now, not after the run, when ``--outdir`` cannot be a writable directory.

    Writability is tried for real: a file is created (and removed) in
    ``--outdir``, or in the deepest directory above it that exists, since
    ``os.access`` answers yes to root where the file system still refuses
    (``/proc``, a read-only or root-squashed mount).  The directory itself is
    made only once the run starts.

    Raises
    ------
    argparse.ArgumentError
        ``--outdir`` (or a path above it) is a file, or no file can be
        created in the directory it would be made in.
    """
    path = os.path.abspath(args.outdir)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = args.outdir if existing == path else f"{existing} (above {args.outdir})"
        raise argparse.ArgumentError(None, f"argument --outdir: {what} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".cupy_ipcpool-bench-"):
            pass
    except OSError as exc:
        raise argparse.ArgumentError(
            None,
            f"argument --outdir: cannot write to {existing} (for {args.outdir}): {exc.strerror}",
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``bench`` options on ``parser``; set ``run=main``, ``check``, ``gpu``.

    Parameters
    ----------
    parser:
        The ``bench`` subparser (or any parser).
    """
    parser.add_argument(
        "--mode",
        choices=sorted(MODES),
        default=None,  # not given: full (None tells --gpu-clock that it was not given)
        help="short: 1 and 64 MiB, few frames (< ~1 min); full: 1 MiB..1 GiB "
        "and the scale figures (default: full; not with --gpu-clock)",
    )
    parser.add_argument(
        "--outdir",
        default="./bench-out",
        help="where benchmarks.md/.json and the plot go (default: %(default)s)",
    )
    parser.add_argument(
        "--lanes",
        type=parse_lanes,
        default=None,
        help=f"comma-separated lanes (default: all): {','.join(LANE_NAMES)}",
    )
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=None,
        help="comma-separated frame sizes in MiB (default: by mode)",
    )
    parser.add_argument(
        "--iters",
        type=_positive_int,
        default=None,
        help="timed frames per lane and size, for latency and for throughput (default: by mode)",
    )
    parser.add_argument(
        "--device", type=_non_negative_int, default=0, help="CUDA device (default: 0)"
    )
    parser.add_argument(
        "--paired-turns",
        type=_non_negative_int,
        default=None,
        help=f"turns of {PAIRED_TURN_FRAMES} frames per lane and size in which "
        f"{', '.join(PAIRED_LANES)} (those selected) run interleaved at "
        f"{', '.join(f'{m} MiB' for m in PAIRED_SIZES_MIB)}, for the 1.3x target "
        f"(default: {PAIRED_TURNS['full']} in full mode, 0 in short mode; 0: none)",
    )
    parser.add_argument(
        "--no-scale",
        action="store_true",
        help="skip the scale figures (attach cost, fan-out) in full mode",
    )
    parser.add_argument(
        "--gpu-clock",
        action="store_true",
        help="instead of the comparison: where a frame's time goes, on the GPU's clock "
        f"(%%globaltimer), for {', '.join(gpuclock.GPU_CLOCK_LANES)} (the default lanes; "
        "no others): p50/p90 of the producer's fill end -> the consumer's check start, of "
        "the round trip, and each side's CPU time per frame; sizes default to "
        f"{','.join(str(m) for m in gpuclock.GPU_CLOCK_SIZES_MIB)} MiB, --iters to "
        f"{gpuclock.GPU_CLOCK_ITERS} timed frames; writes gpuclock.md/.json to --outdir "
        "(not with --mode, --no-scale or --paired-turns)",
    )
    # check, then gpu (the device that must exist), are the command line's, before main
    parser.set_defaults(run=main, check=check_args, gpu=lambda args: args.device)


#: The options ``--gpu-clock`` does not take (its argparse ``dest``, its flag, why not).
NOT_WITH_GPU_CLOCK = (
    ("mode", "--mode", "its sizes and frame counts are its own: --sizes and --iters set them"),
    ("no_scale", "--no-scale", "it measures no scale figures"),
    ("paired_turns", "--paired-turns", "it runs no interleaved turns"),
)


def check_args(args: argparse.Namespace) -> None:
    """:func:`check_outdir`, and the options ``--gpu-clock`` does not take.

    Raises
    ------
    argparse.ArgumentError
        As :func:`check_outdir`; a lane ``--gpu-clock`` does not measure; an
        option of :data:`NOT_WITH_GPU_CLOCK` with ``--gpu-clock``.
    """
    check_outdir(args)
    if not getattr(args, "gpu_clock", False):
        return
    try:
        gpuclock.check_lanes(args.lanes)
    except ValueError as exc:
        raise argparse.ArgumentError(None, f"argument --lanes: {exc}") from None
    for dest, flag, why in NOT_WITH_GPU_CLOCK:
        if getattr(args, dest, None) not in (None, False):
            raise argparse.ArgumentError(None, f"argument {flag}: not with --gpu-clock ({why})")


@dataclass(frozen=True)
class BenchOptions:
    """What to run; :func:`options_from_args` builds it from the command line."""

    mode: str = "full"
    outdir: str = "./bench-out"
    lanes: tuple[str, ...] | None = None
    sizes_mib: tuple[int, ...] | None = None
    iters: int | None = None
    device: int = 0
    scale: bool | None = None  # default: in full mode only
    paired_turns: int | None = None  # default: by mode (PAIRED_TURNS)
    gpu_clock: bool = False  # the gpu-clock measurement instead of the comparison

    def schedule(self) -> Schedule:
        """Frames per phase for this mode, with ``iters`` applied."""
        sched: Schedule = MODES[self.mode]["schedule"]
        if self.iters is not None:
            sched = replace(sched, iters=self.iters, tput=self.iters)
        return sched

    def sizes(self) -> tuple[int, ...]:
        """Frame sizes in bytes."""
        mib = self.sizes_mib or MODES[self.mode]["sizes_mib"]
        return tuple(int(m) * MiB for m in mib)

    def turns(self) -> int:
        """Interleaved turns of each paired lane per size (0: none)."""
        return PAIRED_TURNS[self.mode] if self.paired_turns is None else self.paired_turns

    def run_scale(self) -> bool:
        """Whether the scale figures run."""
        return self.mode == "full" if self.scale is None else self.scale


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """Turn parsed arguments into :class:`BenchOptions`."""
    return BenchOptions(
        mode=args.mode or "full",
        outdir=args.outdir,
        lanes=args.lanes,
        sizes_mib=args.sizes,
        iters=args.iters,
        device=args.device,
        scale=False if getattr(args, "no_scale", False) else None,
        paired_turns=getattr(args, "paired_turns", None),
        gpu_clock=bool(getattr(args, "gpu_clock", False)),
    )


# --------------------------------------------------------------- environment
def gpu_missing_reason(device: int = 0) -> str | None:
    """Why there is no GPU to measure on (None when ``device`` exists)."""
    try:
        from .. import _driver

        n = _driver.device_count()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    if n <= device:
        return f"no CUDA device {device} ({n} visible)"
    return None


def _dist_version(*dists: str) -> str:
    for d in dists:
        try:
            return f"{metadata.version(d)} ({d})"
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def collect_environment(device: int = 0) -> dict[str, Any]:
    """GPU, driver, CUDA and package versions, and the date (each 'unknown: why' on error)."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cupy_ipcpool": _dist_version("cupy_ipcpool", "cupy-ipcpool"),
        "cupy": _dist_version("cupy-cuda13x", "cupy-cuda12x", "cupy"),
        "cuda-bindings": _dist_version("cuda-bindings"),
        "cuda-core": _dist_version("cuda-core", "cuda_core"),
        "torch": _dist_version("torch"),
        "numpy": _dist_version("numpy"),
    }
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(device)
        name = props["name"]
        env["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
        drv = cupy.cuda.runtime.driverGetVersion()
        rt = cupy.cuda.runtime.runtimeGetVersion()
        env["cuda_driver_api"] = f"{drv // 1000}.{drv % 1000 // 10}"
        env["cuda_runtime"] = f"{rt // 1000}.{rt % 1000 // 10}"
    except Exception as exc:
        env.setdefault("gpu", f"unknown: {type(exc).__name__}: {exc}")
    env["driver_version"] = _nvidia_driver_version()
    return env


def _nvidia_driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            first = f.readline()
    except OSError as exc:
        return f"unknown: {exc.strerror}"
    for token in first.split():
        if token.count(".") >= 1 and token.replace(".", "").isdigit():
            return token
    return first.strip()


# ------------------------------------------------------------------- running
@dataclass
class BenchResults:
    """Everything one run produced."""

    measurements: list[Measurement]
    targets: list[report.TargetResult]
    environment: dict[str, Any]
    config: dict[str, Any]
    scale: dict[str, Any]
    notes: list[str] = field(default_factory=default_notes)
    paired: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> list[Measurement]:
        """Measurements whose lane failed (verification or error)."""
        return [m for m in self.measurements if m.status == FAILED]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data."""
        return report.results_dict(
            self.measurements,
            self.targets,
            environment=self.environment,
            config=self.config,
            scale=self.scale,
            notes=self.notes,
            paired=self.paired,
        )

    def markdown(self) -> str:
        """The markdown report."""
        return report.render_markdown(
            self.measurements,
            self.targets,
            environment=self.environment,
            scale=self.scale,
            mode=str(self.config.get("mode", "")),
            notes=self.notes,
            paired=self.paired,
        )


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_attach_scan(
    device: int = 0,
    *,
    slot_counts: Sequence[int] = ATTACH_SLOTS,
    iters: int = ATTACH_ITERS,
    slot_nbytes: int = ATTACH_SLOT_NBYTES,
) -> list[dict[str, Any]]:
    """Attach + close cost in a second process for pools of ``slot_counts`` slots."""
    lane = AttachScanLane()
    reason = lane.available()
    if reason is not None:
        return [{"slots": k, "status": "skipped", "reason": reason} for k in slot_counts]
    cfg = BenchConfig(
        sizes=(),
        device=device,
        extra={
            "slot_counts": tuple(slot_counts),
            "slot_nbytes": slot_nbytes,
            "attach_iters": iters,
        },
    )
    res = run_pair(lane, cfg, timeout=600.0)
    rows = []
    for k in slot_counts:
        times = res.consumers[0].get(str(k)) if res.status == OK and res.consumers else None
        if not times:
            rows.append(
                {
                    "slots": k,
                    "status": res.status if res.status != OK else FAILED,
                    "reason": res.reason or "no timings",
                }
            )
            continue
        us = [t / 1e3 for t in times]
        rows.append(
            {
                "slots": k,
                "slot_nbytes": slot_nbytes,
                "status": OK,
                "p50_us": percentile(us, 50),
                "p99_us": percentile(us, 99),
                "samples_us": [round(v, 3) for v in us],
            }
        )
    return rows


def run_fanout(
    device: int = 0,
    *,
    counts: Sequence[int] = FANOUT,
    nbytes: int = FANOUT_NBYTES,
    schedule: Schedule | None = None,
) -> list[dict[str, Any]]:
    """p50 round trip of cupy_ipcpool with 1..N subscribers (the producer waits for all)."""
    sched = schedule or Schedule(warmup=10, iters=200, tput=0, checks=2)
    rows = []
    for k in counts:
        cfg = BenchConfig(sizes=(nbytes,), schedule=sched, n_consumers=k, device=device)
        m = run_lane(CupyIpcPoolLane(), cfg)[0]
        row: dict[str, Any] = {
            "subscribers": k,
            "nbytes": nbytes,
            "status": m.status,
            "reason": m.reason,
        }
        if m.status == OK:
            row.update(p50_us=m.p50_us, p99_us=m.p99_us, samples_us=m.samples_us)
        rows.append(row)
    return rows


def run_paired(
    device: int = 0,
    *,
    sizes_mib: Sequence[int] = PAIRED_SIZES_MIB,
    turns: int = PAIRED_TURNS["full"],
    lanes: Sequence[str] = PAIRED_LANES,
    pairs: Sequence[tuple[str, str]] = PAIRED_PAIRS,
    turn_frames: int = PAIRED_TURN_FRAMES,
    skip: int = PAIRED_TURN_SKIP,
    progress: Callable[[str], None] = _stderr,
) -> list[dict[str, Any]]:
    """Lanes measured in interleaved turns; one row per pair and size (:func:`report.paired_rows`).

    Every lane's processes run at once, and their producers take turns
    (:func:`~.harness.run_turns`): at each size, ``turns`` turns of
    ``turn_frames`` latency frames per lane, the lanes in rotation.  Each
    turn's first ``skip`` frames are left out; the rest is that lane's
    measurement of the turn, and the ratio of a round compares turns taken
    next to each other (milliseconds apart), so that a drift of the
    machine's speed weighs on every lane alike.  Rows are made for the
    ``pairs`` whose two lanes are both in ``lanes``, in that order.
    """
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    if len(set(lanes)) < 2:
        raise ValueError(f"interleaved turns need two lanes or more, got {list(lanes)}")
    chosen = [get_lanes([name])[0] for name in lanes]
    sizes = tuple(int(m) * MiB for m in sizes_mib)
    sched = replace(PAIRED_SCHEDULE, iters=turns * turn_frames)
    cfg = BenchConfig(sizes=sizes, schedule=sched, device=device, turn_frames=turn_frames)
    per_turn: dict[str, dict[int, list[Measurement]]] = {lane.name: {} for lane in chosen}
    progress(
        f"[bench] {turns} turns of {turn_frames} frames per lane and size: "
        + ", ".join(lane.name for lane in chosen)
    )
    results = run_turns([(lane, cfg) for lane in chosen])
    for lane, res in zip(chosen, results, strict=True):
        for m in measurements_from(lane, cfg, res):
            per_turn[lane.name][m.nbytes] = turn_measurements(m, turn_frames, skip)
            progress(report.progress_line(m).replace("[bench] ", "[bench] interleaved ", 1))
    rows = []
    for num, den in pairs:
        if num in per_turn and den in per_turn:
            rows += report.paired_rows(per_turn, num, den, sizes)
    return rows


def _scale_outcome(row: dict[str, Any]) -> str:
    """A scale figure's row for the progress lines: its p50, or its status and reason."""
    if row["status"] == OK:
        return f"p50 {report.fmt_num(row['p50_us'])} us"
    return f"{row['status']}: {row.get('reason', '')}"


def run_benchmark(opts: BenchOptions, *, progress: Callable[[str], None] = _stderr) -> BenchResults:
    """Run the lanes (and, in full mode, the scale figures) and evaluate the targets.

    Parameters
    ----------
    opts:
        Mode, lanes, sizes, iterations, device.
    progress:
        Called with one line per measurement.

    Returns
    -------
    BenchResults
        Nothing is written; see :func:`write_outputs`.
    """
    sched = opts.schedule()
    sizes = opts.sizes()
    cfg = BenchConfig(sizes=sizes, schedule=sched, device=opts.device)
    measurements: list[Measurement] = []
    lanes = get_lanes(opts.lanes)
    if opts.mode == "full" and lanes:
        # The first sizes of the first lane measured were the slowest of the run
        # (run 7 and call 5 on the H200: 1 MiB 1.4x the 64 MiB figure, only in the
        # lane that ran first): a machine coming out of idle.  A short, discarded
        # pass of that lane at its first size lets every lane start warm.
        progress(f"[bench] warming up with {lanes[0].name} (not reported) ...")
        warm = replace(cfg, sizes=sizes[:1], schedule=MODES["short"]["schedule"])
        run_lane(lanes[0], warm)
    for lane in lanes:
        progress(f"[bench] {lane.name}: {lane.title} ...")
        for m in run_lane(lane, cfg):
            measurements.append(m)
            progress(report.progress_line(m))
    paired: list[dict[str, Any]] = []
    names = {lane.name for lane in lanes}
    paired_lanes = [name for name in PAIRED_LANES if name in names]
    if opts.turns() > 0 and all(name in names for name in PAIRED_LANES[:2]):
        progress(f"[bench] interleaved turns: {', '.join(paired_lanes)} ...")
        paired = run_paired(opts.device, turns=opts.turns(), lanes=paired_lanes, progress=progress)
    scale: dict[str, Any] = {}
    if opts.run_scale():
        progress("[bench] scale: attach cost against slot count ...")
        scale["attach"] = run_attach_scan(opts.device)
        for row in scale["attach"]:
            progress(f"[bench] attach {row['slots']:>5} slots: {_scale_outcome(row)}")
        progress("[bench] scale: fan-out ...")
        scale["fanout"] = run_fanout(opts.device)
        for row in scale["fanout"]:
            progress(f"[bench] fan-out {row['subscribers']} subscriber(s): {_scale_outcome(row)}")
    config = {
        "mode": opts.mode,
        "sizes_mib": [s / MiB for s in sizes],
        "lanes": [lane.name for lane in get_lanes(opts.lanes)],
        "schedule": asdict(sched),
        "num_slots": cfg.num_slots,
        "device": opts.device,
        "paired": {
            "turns": opts.turns(),
            "turn_frames": PAIRED_TURN_FRAMES,
            "turn_skip": PAIRED_TURN_SKIP,
            "lanes": paired_lanes,
            "sizes_mib": list(PAIRED_SIZES_MIB),
            "schedule": asdict(replace(PAIRED_SCHEDULE, iters=opts.turns() * PAIRED_TURN_FRAMES)),
        }
        if paired
        else None,
    }
    return BenchResults(
        measurements=measurements,
        targets=report.evaluate_targets(measurements, paired=paired),
        environment=collect_environment(opts.device),
        config=config,
        scale=scale,
        notes=default_notes(get_lanes(opts.lanes)),
        paired=paired,
    )


def write_outputs(results: BenchResults, outdir: str) -> list[str]:
    """Write ``benchmarks.md``, ``benchmarks.json`` and the plot; return messages for the user."""
    os.makedirs(outdir, exist_ok=True)
    md_path = os.path.join(outdir, "benchmarks.md")
    report.write_markdown(md_path, results.markdown())
    report.write_json(os.path.join(outdir, "benchmarks.json"), results.to_dict())
    msgs = [f"wrote {md_path} and {os.path.join(outdir, 'benchmarks.json')}"]
    png = os.path.join(outdir, "latency_vs_size.png")
    why = report.plot_latency(results.measurements, png)
    msgs.append(why if why else f"wrote {png}")
    return msgs


def run_gpu_clock(
    opts: BenchOptions, *, progress: Callable[[str], None] = _stderr
) -> dict[str, Any]:
    """The ``--gpu-clock`` measurement (:mod:`.gpuclock`) for ``opts``; writes as it goes.

    Lanes: ``opts.lanes`` (default :data:`gpuclock.GPU_CLOCK_LANES`), sizes:
    ``opts.sizes_mib`` (default :data:`gpuclock.GPU_CLOCK_SIZES_MIB`), timed
    frames: ``opts.iters`` (default :data:`gpuclock.GPU_CLOCK_ITERS`).  After
    each lane the results so far are written to ``opts.outdir`` (a run cut
    short leaves what it measured).
    """
    names = gpuclock.check_lanes(opts.lanes)
    sizes = tuple(int(m) * MiB for m in (opts.sizes_mib or gpuclock.GPU_CLOCK_SIZES_MIB))
    lanes = get_lanes(names)
    progress(
        f"[bench] gpu-clock: {', '.join(names)} at "
        + ", ".join(report.fmt_size(n) for n in sizes)
        + f" ({gpuclock.gpu_sharing(opts.device)}) ..."
    )
    results = gpuclock.run_gpu_clock(
        lanes,
        sizes,
        iters=opts.iters or gpuclock.GPU_CLOCK_ITERS,
        device=opts.device,
        progress=progress,
        partial=lambda res: gpuclock.write_outputs(res, opts.outdir),
    )
    # after the lanes, as run_benchmark does: CuPy's device query stays out of their way
    results["environment"] = collect_environment(opts.device)
    return results


def _main_gpu_clock(opts: BenchOptions) -> int:
    results = run_gpu_clock(opts)
    paths = gpuclock.write_outputs(results, opts.outdir)
    print(gpuclock.markdown([results]), end="")
    _stderr(f"[bench] wrote {' and '.join(paths)}")
    failed = gpuclock.failed_cells(results)
    if failed:
        _stderr(f"[bench] {len(failed)} gpu-clock measurement(s) FAILED")
        return 1
    return 0


def main(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed arguments; the exit code is 1 if a lane failed or no GPU."""
    opts = options_from_args(args)
    reason = gpu_missing_reason(opts.device)
    if reason is not None:
        _stderr(f"no GPU: {reason}")
        return 1
    if opts.gpu_clock:
        return _main_gpu_clock(opts)
    results = run_benchmark(opts)
    text = results.markdown()
    print(text)
    for msg in write_outputs(results, opts.outdir):
        _stderr(f"[bench] {msg}")
    # a broken guard is flagged, not an error: one run on a noisy machine is no verdict
    for r in broken(results.targets):
        _stderr(f"[bench] guard BROKEN: {r.target.label}")
    if results.failed:
        _stderr(f"[bench] {len(results.failed)} measurement(s) FAILED")
        return 1
    return 0
