"""Report of the comparative benchmark: markdown table, targets, JSON, plot.

Pure Python on plain data (:class:`~cupy_ipcpool._bench.harness.Measurement`
and dicts); no GPU needed, so all of it is tested on CI.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ._targets import (
    BASELINE,
    BENCH,
    BENCH_PAIRED,
    TARGET_NBYTES,
    Target,
    TargetResult,
    targets_of,
)
from ._targets import targets_text as _targets_text
from .harness import FAILED, OK, SKIPPED, Measurement, MiB, percentile

#: The targets of this suite (guards and goals, :mod:`._targets`): the p50 of two lanes at
#: :data:`TARGET_NBYTES`, and the median per-turn ratio of two lanes' interleaved turns.
TARGETS: tuple[Target, ...] = targets_of(BENCH)
PAIRED_TARGETS: tuple[Target, ...] = targets_of(BENCH_PAIRED)
_PAIRED_TARGET_OF = {(t.numerator, t.denominator): t for t in PAIRED_TARGETS}


# ------------------------------------------------------------------ format
def fmt_size(nbytes: int) -> str:
    """``1 MiB``, ``64 MiB``, ``1 GiB``, ``1.5 MiB``."""
    if nbytes >= 1 << 30 and nbytes % (1 << 30) == 0:
        return f"{nbytes >> 30} GiB"
    mib = nbytes / MiB
    return f"{mib:g} MiB"


def fmt_num(x: float | None, *, digits: int = 1) -> str:
    """A number for a table cell: thousands separated, ``-`` for None."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:,.{digits}f}"


def fmt_ratio(r: float | None) -> str:
    """``12.3x`` (``-`` for None)."""
    if r is None:
        return "-"
    return f"{r:.2f}x" if r < 10 else f"{r:,.0f}x"


def p50_of(measurements: Iterable[Measurement], lane: str, nbytes: int) -> float | None:
    """p50 (µs) of ``lane`` at ``nbytes`` when it was measured successfully, else None."""
    for m in measurements:
        if m.lane == lane and m.nbytes == nbytes and m.status == OK:
            return m.p50_us
    return None


def _status_text(m: Measurement) -> str:
    if m.status == SKIPPED:
        return f"skipped: {m.reason}"
    return f"FAILED: {m.reason}"


def progress_line(m: Measurement) -> str:
    """One line per measurement for the progress display."""
    head = f"[bench] {m.lane:<16} {fmt_size(m.nbytes):>8}: "
    if m.status != OK:
        return head + _status_text(m)
    return (
        head
        + f"p50 {fmt_num(m.p50_us)} us  p99 {fmt_num(m.p99_us)} us  "
        + f"{fmt_num(m.fps)} frames/s  ({m.frames_verified} frames verified)"
    )


def markdown_table(measurements: Sequence[Measurement], *, baseline: str = BASELINE) -> str:
    """Lane x frame size: p50 µs, p99 µs, frames/s and the ratio to the baseline's p50.

    A lane skipped at every size gets one row; failed and skipped cells say
    why instead of showing numbers.
    """
    lines = [
        f"| lane | frame | p50 µs | p99 µs | frames/s | p50 / {baseline} p50 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lanes: list[str] = []
    for m in measurements:
        if m.lane not in lanes:
            lanes.append(m.lane)
    for lane in lanes:
        rows = [m for m in measurements if m.lane == lane]
        if rows and all(m.status == SKIPPED for m in rows) and len({m.reason for m in rows}) == 1:
            lines.append(f"| {lane} | all | {_status_text(rows[0])} | | | |")
            continue
        for m in sorted(rows, key=lambda r: r.nbytes):
            if m.status != OK:
                lines.append(f"| {lane} | {fmt_size(m.nbytes)} | {_status_text(m)} | | | |")
                continue
            base = p50_of(measurements, baseline, m.nbytes)
            ratio = m.p50_us / base if base and m.p50_us is not None else None
            tput = fmt_num(m.fps) + ("" if m.pipelined else " ¹")
            lines.append(
                f"| {lane} | {fmt_size(m.nbytes)} | {fmt_num(m.p50_us)} | {fmt_num(m.p99_us)} "
                f"| {tput} | {fmt_ratio(ratio)} |"
            )
    lines.append("")
    lines.append("¹ one frame in flight at a time (the lane's round trip allows no more).")
    return "\n".join(lines)


def evaluate_targets(
    measurements: Sequence[Measurement],
    *,
    nbytes: int = TARGET_NBYTES,
    paired: Sequence[dict[str, Any]] = (),
) -> list[TargetResult]:
    """Check every :data:`TARGETS` entry at ``nbytes`` (``n/a`` with the reason when unmeasured).

    ``paired``: rows of :func:`paired_rows`; a row at ``nbytes`` whose two
    lanes are those of a :data:`PAIRED_TARGETS` entry is checked against it on
    its median per-turn ratio (rows of other pairs make no target, and a run
    without interleaved turns has no such result).
    """
    out = []
    for t in TARGETS:
        assert t.denominator is not None  # every target of this suite is a ratio of two lanes
        num = p50_of(measurements, t.numerator, nbytes)
        den = p50_of(measurements, t.denominator, nbytes)
        if num is None or den is None or den <= 0:
            missing = [
                name
                for name, v in ((t.numerator, num), (t.denominator, den))
                if v is None or v <= 0
            ]
            why = "; ".join(_why_missing(measurements, name, nbytes) for name in missing)
            out.append(TargetResult(t, None, why))
            continue
        out.append(TargetResult(t, num / den))
    for row in paired:
        if row["nbytes"] != nbytes:
            continue
        pt = _PAIRED_TARGET_OF.get((row["numerator"], row["denominator"]))
        if pt is None:
            continue
        if row["status"] != OK:
            out.append(TargetResult(pt, None, f"{row['status']}: {row['reason']}"))
            continue
        note = (
            f"{row['turns']} turns, per-turn ratios {row['ratio_min']:.2f}-{row['ratio_max']:.2f}x"
        )
        out.append(TargetResult(pt, row["ratio_median"], note))
    return out


def paired_rows(
    per_turn: dict[str, dict[int, list[Measurement]]],
    numerator: str,
    denominator: str,
    sizes: Sequence[int],
) -> list[dict[str, Any]]:
    """Summarise interleaved turns of two lanes, one row per size.

    ``per_turn[lane][nbytes]`` holds that lane's measurement of each turn, in
    turn order.  A row gives each lane's p50 over the samples of all turns
    pooled, the ratio ``numerator / denominator`` of each turn (turn *i* of
    one lane against turn *i* of the other, measured next to each other), and
    their median, min and max.  A size where either lane did not succeed gets
    that status and reason instead: no ratio is made from part of the turns.
    """
    rows = []
    for nbytes in sizes:
        a = per_turn.get(numerator, {}).get(nbytes, [])
        b = per_turn.get(denominator, {}).get(nbytes, [])
        row: dict[str, Any] = {
            "nbytes": nbytes,
            "numerator": numerator,
            "denominator": denominator,
            "turns": min(len(a), len(b)),
        }
        bad = next((m for m in (*a, *b) if m.status != OK), None)
        if bad is not None or not a or len(a) != len(b):
            row["status"] = bad.status if bad is not None else FAILED
            row["reason"] = (
                f"{bad.lane}: {bad.reason}"
                if bad is not None
                else f"{len(a)} turns of {numerator} against {len(b)} of {denominator}"
            )
            rows.append(row)
            continue
        ratios = [x.p50_us / y.p50_us for x, y in zip(a, b, strict=True)]  # type: ignore[operator]
        row.update(
            status=OK,
            reason="",
            numerator_p50_us=percentile([v for m in a for v in m.samples_us], 50),
            denominator_p50_us=percentile([v for m in b for v in m.samples_us], 50),
            turn_p50_us=[[x.p50_us, y.p50_us] for x, y in zip(a, b, strict=True)],
            ratios=ratios,
            ratio_median=percentile(ratios, 50),
            ratio_min=min(ratios),
            ratio_max=max(ratios),
        )
        rows.append(row)
    return rows


def paired_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The interleaved turns as one table per pair of lanes (empty when none ran).

    Each table has a ``### numerator against denominator`` heading; pairs come
    in the order of their first row.
    """
    pairs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        pairs.setdefault((row["numerator"], row["denominator"]), []).append(row)
    return "\n\n".join(
        f"### {num} against {den}\n\n" + _pair_table(num, den, pair_rows)
        for (num, den), pair_rows in pairs.items()
    )


def _pair_table(num: str, den: str, rows: Sequence[dict[str, Any]]) -> str:
    parts = [
        f"| frame | turns | {num} p50 µs | {den} p50 µs | ratio, median of turns | "
        "per-turn ratios |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        size = fmt_size(row["nbytes"])
        if row["status"] != OK:
            parts.append(f"| {size} | {row['turns']} | {row['status']}: {row['reason']} | | | |")
            continue
        each = ", ".join(f"{r:.2f}" for r in row["ratios"])
        parts.append(
            f"| {size} | {row['turns']} | {fmt_num(row['numerator_p50_us'])} | "
            f"{fmt_num(row['denominator_p50_us'])} | {fmt_ratio(row['ratio_median'])} | {each} |"
        )
    return "\n".join(parts)


def _why_missing(measurements: Sequence[Measurement], lane: str, nbytes: int) -> str:
    for m in measurements:
        if m.lane == lane and m.nbytes == nbytes:
            return f"{lane} {m.status}: {m.reason}" if m.status != OK else f"{lane}: p50 is 0"
    return f"{lane} not measured at {fmt_size(nbytes)}"


def targets_text(results: Sequence[TargetResult], *, nbytes: int = TARGET_NBYTES) -> str:
    """The targets as markdown: the legend, the guards (met / BROKEN), then the goals."""
    return _targets_text(results, title=f"Targets at {fmt_size(nbytes)} (p50 ratios):")


def _scale_table(
    title: str,
    header: str,
    key: str,
    rows: Sequence[dict[str, Any]],
    line: Callable[[dict[str, Any]], str],
) -> list[str]:
    """One scale table: ``title``, the ``header`` row, then a row per entry of ``rows``.

    ``line(row)`` is a measured row's line; a row whose status is not OK shows
    ``row[key]``, then its status and reason in the third column.
    """
    ncols = header.count("|") - 1
    parts = [title, "", header, "|" + "---:|" * ncols]
    for row in rows:
        if row.get("status", OK) != OK:
            blanks = " |" * (ncols - 3)
            parts.append(f"| {row[key]} | | {row['status']}: {row.get('reason', '')} |{blanks}")
        else:
            parts.append(line(row))
    parts.append("")
    return parts


#: The scale tables: (key in the scale figures, title, header row, key of a row, a row's line).
_SCALE_TABLES: tuple[tuple[str, str, str, str, Callable[[dict[str, Any]], str]], ...] = (
    (
        "attach",
        "### Attach cost against slot count (`cip.attach(desc)` + `close()`)",
        "| slots | slot size | p50 µs | p99 µs | p50 per slot µs |",
        "slots",
        lambda row: (
            f"| {row['slots']} | {fmt_size(row['slot_nbytes'])} | {fmt_num(row['p50_us'])} "
            f"| {fmt_num(row['p99_us'])} | {fmt_num(row['p50_us'] / row['slots'], digits=2)} |"
        ),
    ),
    (
        "fanout",
        "### Fan-out (cupy_ipcpool; the producer waits for every subscriber's release)",
        "| subscribers | frame | p50 µs | p99 µs |",
        "subscribers",
        lambda row: (
            f"| {row['subscribers']} | {fmt_size(row['nbytes'])} | {fmt_num(row['p50_us'])} "
            f"| {fmt_num(row['p99_us'])} |"
        ),
    ),
)


def scale_markdown(scale: dict[str, Any]) -> str:
    """Tables of the scale figures (attach cost vs slots, fan-out); empty when none ran."""
    parts = []
    for name, title, header, key, line in _SCALE_TABLES:
        rows = scale.get(name) or []
        if rows:
            parts += _scale_table(title, header, key, rows, line)
    return "\n".join(parts)


def sync_notes(lanes: Iterable[tuple[str, str]]) -> list[str]:
    """One note per ``(lane, sync_note)`` with a note: the per-frame synchronisation it keeps."""
    return [f"{name}, per-frame synchronisation: {note}" for name, note in lanes if note]


def environment_markdown(env: dict[str, Any]) -> str:
    """The environment as a short bullet list."""
    return "\n".join(f"- {k}: {v}" for k, v in env.items())


def render_markdown(
    measurements: Sequence[Measurement],
    targets: Sequence[TargetResult],
    *,
    environment: dict[str, Any] | None = None,
    scale: dict[str, Any] | None = None,
    mode: str = "",
    notes: Sequence[str] = (),
    paired: Sequence[dict[str, Any]] = (),
) -> str:
    """The whole ``benchmarks.md`` (``paired``: rows of :func:`paired_rows`)."""
    parts = ["# cupy_ipcpool: handoff between two processes against the alternatives", ""]
    if mode:
        parts += [
            f"Mode: {mode}. Round trip: producer writes the frame on the GPU -> hands it "
            "over -> consumer gets a usable array and enqueues its check -> consumer "
            "signals done -> producer sees it; timed on the producer. No lane waits for "
            "the GPU per frame unless its correctness needs it (see the notes).",
            "",
        ]
    parts += [markdown_table(measurements), "", targets_text(targets), ""]
    table = paired_markdown(paired)
    if table:
        lanes = list(dict.fromkeys(n for r in paired for n in (r["numerator"], r["denominator"])))
        parts += [
            f"## Interleaved turns: {', '.join(lanes)}",
            "",
            "These lanes again, all running at once and taking turns: at each size every "
            "lane's producer runs a turn of latency frames (its first frames left out: the "
            "switch from the previous turn), then hands the machine to the next lane, the "
            "order rotating from round to round. The machine's speed drifts from second to "
            "second (docs/performance.md, 'A noisy host'), so one run of each lane, measured "
            "apart, compares two machine states as much as two lanes; the median of the "
            "per-turn ratios (turn *i* of one lane against turn *i* of the other, "
            "milliseconds apart) does not.",
            "",
            table,
            "",
        ]
    if scale:
        text = scale_markdown(scale)
        if text:
            parts += ["## Scale", "", text]
    if notes:
        parts += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    if environment:
        parts += ["## Environment", "", environment_markdown(environment), ""]
    return "\n".join(parts)


# -------------------------------------------------------------------- files
def results_dict(
    measurements: Sequence[Measurement],
    targets: Sequence[TargetResult],
    *,
    environment: dict[str, Any],
    config: dict[str, Any],
    scale: dict[str, Any] | None = None,
    notes: Sequence[str] = (),
    paired: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """Everything measured, as JSON-ready data."""
    return {
        "environment": environment,
        "config": config,
        "measurements": [m.to_dict() for m in measurements],
        "targets": [t.to_dict() for t in targets],
        "paired": list(paired),
        "scale": scale or {},
        "notes": list(notes),
    }


def write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON (NaN/inf written as null)."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    with open(path, "w") as f:
        json.dump(clean(data), f, indent=2)
        f.write("\n")


def write_markdown(path: str | os.PathLike[str], text: str) -> None:
    """Write the markdown report."""
    with open(path, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")


def plot_latency(measurements: Sequence[Measurement], path: str | os.PathLike[str]) -> str | None:
    """Plot p50 latency against frame size (log-log), one line per lane.

    Returns
    -------
    str or None
        None when the plot was written, else why not (matplotlib missing, nothing to plot).
    """
    series: dict[str, list[tuple[float, float]]] = {}
    for m in measurements:
        if m.status == OK and m.p50_us is not None and m.p50_us > 0:
            series.setdefault(m.lane, []).append((m.size_mib, m.p50_us))
    if not series:
        return "no successful measurement to plot"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; skipping latency_vs_size.png"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    try:
        for lane, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=lane)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("frame size (MiB)")
        ax.set_ylabel("round trip p50 (µs)")
        ax.set_title("Handoff latency between two processes, one GPU")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.fspath(path), dpi=120)
    finally:
        plt.close(fig)
    return None
