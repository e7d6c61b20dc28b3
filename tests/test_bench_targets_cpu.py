"""The benchmark targets: guards met by the committed H200 results, goals not yet, none idle.

Reads the committed results in ``docs/bench`` (no GPU, nothing timed): every
guard of :mod:`cupy_ipcpool._bench._targets` must be met in each committed
result that measures it, so a guard that stops holding is moved to the goals
on purpose; every goal must be unmet in one of them (one met everywhere is a
guard); and every target must name measurements that a lane or a benchmark
records.  Then how each kind is judged and printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

import cupy_ipcpool._bench as bench
from cupy_ipcpool._bench import _targets, report
from cupy_ipcpool._bench._targets import (
    BENCH,
    BENCH_PAIRED,
    FRACTION,
    GOAL,
    GUARD,
    PER_SECOND,
    PYTEST,
    RATIO,
    SECONDS,
    Target,
    TargetResult,
)
from cupy_ipcpool._bench.harness import OK, Measurement, MiB
from cupy_ipcpool._bench.lanes import LANE_NAMES

BENCH_DIR = Path(__file__).resolve().parent.parent / "docs" / "bench"
_FIELDS = {f.name for f in dataclasses.fields(Measurement)}


def _load(name: str) -> dict[str, Any]:
    return json.loads((BENCH_DIR / name).read_text())


def _recorded_runs() -> dict[str, dict[str, float]]:
    """Each committed run of the pytest suite: ``file -> {name: value}``."""
    runs = {
        path.name: data["medians_s"]
        for path in sorted(BENCH_DIR.glob("*.json"))
        if "medians_s" in (data := json.loads(path.read_text()))
    }
    # the remote run: seconds per frame of each lane, as test_bench_remote.py records them
    remote: dict[str, float] = {}
    for memory, sizes in _load("remote.json")["memory"].items():
        for size, lanes in sizes.items():
            for lane, value in lanes.items():
                if "_over_" not in lane:  # the file's own ratios
                    remote[f"remote_{memory}_{lane}_{size}"] = value
    runs["remote.json"] = remote
    return runs


def _bench_runs() -> dict[str, tuple[list[Measurement], list[dict[str, Any]]]]:
    """Each committed run of ``bench``: ``file -> (measurements, interleaved rows)``."""
    runs = {}
    for name in ("alternatives-h200.json", "interleaved-h200.json"):
        data = _load(name)
        ms = [
            Measurement(**{k: v for k, v in m.items() if k in _FIELDS})
            for m in data["measurements"]
        ]
        # the older file counts its interleaved rounds as "passes"
        rows = [{**r, "turns": r.get("turns", r.get("passes"))} for r in data["paired"]]
        runs[name] = (ms, rows)
    # the same lanes at 64 MiB in the pytest suite's run (test_bench_alternatives.py)
    summary = _load("pytest-benchmarks-h200-summary.json")["medians_s"]
    ms = [
        Measurement(lane, 64 * MiB, OK, p50_us=summary[f"alt_{lane}_64MiB"] * 1e6)
        for lane in LANE_NAMES
        if f"alt_{lane}_64MiB" in summary
    ]
    runs["pytest-benchmarks-h200-summary.json (alt_ lanes)"] = (ms, [])
    return runs


def _committed_results() -> dict[Target, list[tuple[str, TargetResult]]]:
    """Every target's results in the committed runs that measured it: ``target -> [(run, r)]``."""
    out: dict[Target, list[tuple[str, TargetResult]]] = {t: [] for t in _targets.TARGETS}
    for run, (ms, rows) in _bench_runs().items():
        for r in report.evaluate_targets(ms, paired=rows):
            out[r.target].append((run, r))
    for run, values in _recorded_runs().items():
        for r in _targets.evaluate_recorded(values):
            out[r.target].append((run, r))
    return {t: [(run, r) for run, r in rs if r.value is not None] for t, rs in out.items()}


@pytest.fixture(scope="module")
def committed() -> dict[Target, list[tuple[str, TargetResult]]]:
    return _committed_results()


# ------------------------------------------------------ against docs/bench
def _runs_text(results: list[tuple[str, TargetResult]]) -> str:
    return "; ".join(f"{run}: {r.value:.4g}" for run, r in results)


def test_every_target_is_measured_by_a_committed_result(committed):
    unmeasured = [t.label for t, results in committed.items() if not results]
    assert unmeasured == [], "no committed H200 result measures these targets"


def test_every_guard_is_met_by_the_committed_h200_results(committed):
    broken = [
        f"{t.label} ({t.bound_text}): {_runs_text(results)}"
        for t, results in committed.items()
        if t.kind == GUARD and any(r.status != _targets.MET for _, r in results)
    ]
    assert broken == [], (
        "a guard must hold in every committed H200 result that measures it; "
        "move one that does not to the goals in cupy_ipcpool/_bench/_targets.py"
    )


def test_every_goal_is_unmet_in_a_committed_result(committed):
    met_everywhere = [
        f"{t.label} ({t.bound_text}): {_runs_text(results)}"
        for t, results in committed.items()
        if t.kind == GOAL and all(r.status == _targets.REACHED for _, r in results)
    ]
    assert met_everywhere == [], "a goal met in every committed H200 result is a guard"


def test_targets_name_only_what_a_lane_or_a_benchmark_records():
    recorded = set().union(*(values for values in _recorded_runs().values()))
    lanes = {m["lane"] for m in _load("alternatives-h200.json")["measurements"]}
    assert lanes <= set(LANE_NAMES)
    pairs = set(bench.PAIRED_PAIRS)
    for t in _targets.TARGETS:
        names = {t.numerator} | ({t.denominator} if t.denominator else set())
        if t.suite == PYTEST:
            assert names <= recorded, f"{t.label}: {sorted(names - recorded)} is never recorded"
        else:
            assert names <= lanes, f"{t.label}: {sorted(names - lanes)} is no lane"
        if t.suite == BENCH_PAIRED:
            assert (t.numerator, t.denominator) in pairs, f"{t.label}: no interleaved pair"
    for label, num, den in _targets.INFO_RATIOS:
        assert {num, den} <= recorded, label


def test_the_committed_summary_prints_no_broken_guard_and_every_goal_away():
    values = {**_recorded_runs()["pytest-benchmarks-h200-summary.json"]}
    values.update(_recorded_runs()["remote.json"])
    text, data = _targets.recorded_summary(values)
    assert "- BROKEN" not in text and "guard(s) BROKEN" not in text and "MISSED" not in text
    goals = text[text.index("\nGoals:\n") : text.index("\nFor information")]
    lines = [line for line in goals.splitlines() if line.startswith("- ")]
    assert lines and all(line.endswith("away") for line in lines)
    # the labels the docs quote from the committed summary are still there
    for label in (
        "write bandwidth slot/plain 64 MiB",
        "round trip p99/p50 1024 MiB",
        "round trip p99/p50 1024 MiB, settled (info)",
        "legacy IPC per frame / ours",
    ):
        assert "ratio" in data["ratios"][label]


# --------------------------------------------------------------- the table
def test_labels_are_unique_and_every_entry_is_valid():
    labels = [t.label for t in _targets.TARGETS]
    assert len(labels) == len(set(labels))
    assert {t.kind for t in _targets.TARGETS} == {GUARD, GOAL}
    info = [label for label, _, _ in _targets.INFO_RATIOS]
    assert not set(info) & set(labels)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "promise"}, "kind"),
        ({"suite": "elsewhere"}, "suite"),
        ({"op": "<"}, "comparison"),
        ({"unit": "ms"}, "unit"),
        ({"denominator": None}, "a ratio needs a denominator"),
        ({"unit": SECONDS}, "a ratio needs a denominator"),
        ({"bound": 0.0}, "positive"),
        ({"bound": math.nan}, "positive"),
        ({"suite": BENCH, "denominator": None, "unit": SECONDS}, "ratio of two lanes"),
    ],
)
def test_target_rejects_a_bad_entry(kwargs, match):
    base = {
        "kind": GUARD,
        "suite": PYTEST,
        "label": "x",
        "numerator": "a",
        "denominator": "b",
        "op": "<=",
        "bound": 2.0,
    }
    with pytest.raises(ValueError, match=match):
        Target(**{**base, **kwargs})


# ------------------------------------------------------- judging, printing
def _t(kind: str, op: str, bound: float, unit: str = RATIO, label: str = "x") -> Target:
    return Target(kind, PYTEST, label, "a", "b" if unit == RATIO else None, op, bound, unit)


@pytest.mark.parametrize(
    ("op", "bound", "value", "met", "distance"),
    [
        ("<=", 2.0, 1.0, True, 0.5),
        ("<=", 2.0, 2.0, True, 1.0),
        ("<=", 2.0, 3.0, False, 1.5),
        (">=", 2.0, 4.0, True, 0.5),
        (">=", 2.0, 1.0, False, 2.0),
        (">=", 2.0, 0.0, False, math.inf),
    ],
)
def test_met_and_distance(op, bound, value, met, distance):
    t = _t(GUARD, op, bound)
    assert t.met_by(value) is met
    assert t.distance(value) == pytest.approx(distance)


def test_a_guard_is_met_or_broken_a_goal_reached_or_away():
    guard, goal = _t(GUARD, "<=", 2.0), _t(GOAL, "<=", 2.0)
    assert TargetResult(guard, 1.0).status == "met"
    assert TargetResult(guard, 3.0).status == "BROKEN"
    assert TargetResult(goal, 1.0).status == "reached"
    assert TargetResult(goal, 3.0).status == "away"
    assert TargetResult(guard, None, "why").status == "n/a"
    assert TargetResult(goal, None).distance is None


@pytest.mark.parametrize(
    ("kind", "op", "bound", "unit", "value", "line"),
    [
        (GUARD, "<=", 3.0, RATIO, 2.18, "met: x: 2.18x (<= 3x)"),
        (GUARD, "<=", 3.0, RATIO, 4.0, "BROKEN: x: 4.00x (<= 3x; 1.33x past it)"),
        (GUARD, ">=", 10.0, RATIO, 27.77, "met: x: 27.8x (>= 10x)"),
        (GUARD, "<=", 10e-6, SECONDS, 2.298e-6, "met: x: 2.30 us (<= 10 us)"),
        (GUARD, "<=", 0.01, FRACTION, 0.00093, "met: x: 0.0930% (<= 1%)"),
        (GOAL, "<=", 50e-6, SECONDS, 111.45e-6, "x: 111 us now, goal <= 50 us: 2.23x away"),
        (
            GOAL,
            ">=",
            40000.0,
            PER_SECOND,
            12300.26,
            "x: 12,300/s now, goal >= 40,000/s: 3.25x away",
        ),
        (GOAL, ">=", 20.0, RATIO, 10.1, "x: 10.1x now, goal >= 20x: 1.98x away"),
        (GOAL, ">=", 0.9, RATIO, 1e-3, "x: 0.00100x now, goal >= 0.9x: 900x away"),
        (GOAL, "<=", 1.5, RATIO, 1.2, "reached in this run: x: 1.20x (goal <= 1.5x)"),
    ],
)
def test_result_lines(kind, op, bound, unit, value, line):
    assert TargetResult(_t(kind, op, bound, unit), value).line() == line


def test_an_unmeasured_target_says_why():
    r = TargetResult(_t(GOAL, "<=", 2.0), None, "b skipped: no GPU")
    assert r.line() == "n/a: x (<= 2x): not measured (b skipped: no GPU)"


def test_text_has_the_legend_then_guards_then_goals():
    results = [
        TargetResult(_t(GOAL, "<=", 2.0, label="g1"), 3.0),
        TargetResult(_t(GUARD, "<=", 2.0, label="p1"), 1.0),
        TargetResult(_t(GUARD, "<=", 2.0, label="p2"), 2.5),
    ]
    text = _targets.targets_text(results, title="T:")
    lines = text.splitlines()
    assert lines[:3] == ["T:", "", _targets.LEGEND]
    assert "\n" not in _targets.LEGEND
    guards, goals = lines.index("Guards:"), lines.index("Goals:")
    assert guards < goals
    assert lines[guards + 1 : guards + 3] == [
        "- met: p1: 1.00x (<= 2x)",
        "- BROKEN: p2: 2.50x (<= 2x; 1.25x past it)",
    ]
    assert lines[goals + 1] == "- g1: 3.00x now, goal <= 2x: 1.50x away"
    assert "MISSED" not in text
    # a kind with nothing to show has no heading
    only_guards = _targets.targets_text(results[1:2], title="T:")
    assert "Guards:" in only_guards and "Goals:" not in only_guards
    assert _targets.broken(results) == [results[2]]


def _known(kind: str) -> Target:
    return next(t for t in _targets.TARGETS if t.kind == kind and t.suite == PYTEST)


def _values_meeting(t: Target, met: bool) -> dict[str, float]:
    """Recorded values that put ``t`` on (``met``) or off its bound by 2x."""
    on = t.bound / 2 if t.op == "<=" else t.bound * 2
    off = t.bound * 2 if t.op == "<=" else t.bound / 2
    value = on if met else off
    if t.denominator is None:
        return {t.numerator: value}
    return {t.numerator: value, t.denominator: 1.0}


def test_recorded_summary_text_and_json():
    guard, goal = _known(GUARD), _known(GOAL)
    values = {
        **_values_meeting(guard, met=False),
        **_values_meeting(goal, met=False),
        "alloc_free_hook": 3.0,
        "alloc_free_default": 1.5,
        "unrelated_name": 1.0,
    }
    text, data = _targets.recorded_summary(values)
    assert text.index("Guards:") < text.index("Goals:") < text.index("For information")
    assert f"- BROKEN: {guard.label}: " in text
    assert f"- {goal.label}: " in text and "2.00x away" in text
    assert "- alloc+free hook/default (info): 2.00x" in text
    assert text.splitlines()[-1] == f"1 guard(s) BROKEN in this run: {guard.label}"
    # only what the run measured is listed
    assert text.count("\n- ") == 3
    assert data["medians_s"] == values
    section = "absolute" if guard.denominator is None else "ratios"
    entry = data[section][guard.label]
    assert (entry["kind"], entry["status"], entry["met"]) == (GUARD, "BROKEN", False)
    assert entry["distance"] == pytest.approx(2.0)
    assert data["ratios"]["alloc+free hook/default (info)"] == {
        "ratio": 2.0,
        "kind": "information",
    }


def test_recorded_summary_of_nothing_broken_has_no_broken_line():
    text, _ = _targets.recorded_summary(_values_meeting(_known(GUARD), met=True))
    assert "- BROKEN" not in text and "guard(s) BROKEN" not in text and "Goals:" not in text


def test_ratios_a_module_adds_are_goals_unless_the_table_has_them():
    known = next(t for t in _targets.TARGETS if t.suite == PYTEST and t.denominator)
    extra = [
        (known.label, known.numerator, known.denominator, "<=", 1e-9),  # the table's wins
        ("new ratio", "n", "d", "<=", 1.0),
    ]
    values = {**_values_meeting(known, met=True), "n": 0.5, "d": 1.0}
    text, data = _targets.recorded_summary(values, extra=extra)
    assert data["ratios"][known.label]["kind"] == known.kind
    assert data["ratios"][known.label]["status"] in ("met", "reached")
    assert data["ratios"]["new ratio"]["kind"] == GOAL
    assert "- reached in this run: new ratio: 0.500x (goal <= 1x)" in text


def test_bench_report_flags_a_broken_guard(capsys, monkeypatch, tmp_path):
    # the bench command says which guard broke on stderr, and a broken guard is no failure
    ms = [
        Measurement("cupy_ipcpool", 64 * MiB, OK, p50_us=40.0),
        Measurement("socket_floor", 64 * MiB, OK, p50_us=10.0),
    ]
    results = bench.BenchResults(ms, report.evaluate_targets(ms), {}, {"mode": "short"}, {})
    monkeypatch.setattr(bench, "gpu_missing_reason", lambda device: None)
    monkeypatch.setattr(bench, "run_benchmark", lambda opts: results)
    monkeypatch.setattr(report, "plot_latency", lambda ms, path: "no plot here")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--mode", "short", "--outdir", str(tmp_path)])
    assert bench.main(args) == 0
    out, err = capsys.readouterr()
    assert "- BROKEN: cupy_ipcpool / bare socket round trip: 4.00x (<= 3x; 1.33x past it)" in out
    assert "[bench] guard BROKEN: cupy_ipcpool / bare socket round trip" in err
