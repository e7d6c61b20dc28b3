"""Benchmark harness: medians from pytest-benchmark, ratios against a baseline of the same run.

Each benchmark records its median with the ``record`` fixture (or a value with
``record_value``).  At the end of the session every median is printed, then
the targets of :mod:`cupy_ipcpool._bench._targets` that the run measured:
the guards (what the project promises, each met on the H200: ``met`` or
``BROKEN``), then the goals (aims not reached yet, with this run's distance),
then the ratios kept for information.  Nothing here fails a run: speed is
reported, not asserted.  The same goes as JSON to ``$BENCH_SUMMARY`` when set.
Recorded values are seconds unless :func:`unit_of` says otherwise (rates such
as frames/s, fractions such as CPU time per wall second).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from cupy_ipcpool import _driver
from cupy_ipcpool._bench import _targets
from cupy_ipcpool._bench._targets import FRACTION, PER_SECOND, SECONDS

_medians: dict[str, float] = {}

#: Ratios a benchmark module adds as ``(label, numerator, denominator, op, bound)``: one
#: whose label is in the table of targets is that entry; any other is printed as a goal
#: (a target is a guard only once the table says so, after it held on the H200).
RATIOS: list[tuple[str, str, str, str, float]] = []

#: Units of recorded names that are no target's value, by prefix or substring.
_RATE_PREFIXES = ("throughput_fps", "pipelined_fps")
_FRACTION_MARKS = ("cpu_fraction", "slow_after_drain")


def _gpu_reason() -> str | None:
    try:
        _driver.require_vmm_device(0)
    except Exception as exc:
        return f"benchmarks need a VMM-capable GPU: {exc}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _gpu_reason()
    if reason:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def record(benchmark: Any):
    """Call ``record(name)`` after running ``benchmark`` to keep its median (seconds)."""

    def _record(name: str, scale: float = 1.0) -> None:
        stats = getattr(benchmark, "stats", None)
        if stats is not None:
            record_value(name, stats.stats.median * scale)

    return _record


def record_value(name: str, value: float) -> None:
    """Record a value measured outside pytest-benchmark (e.g. p50 of a latency series).

    ``value`` is in seconds, or in the unit :func:`unit_of` gives ``name``
    (frames/s, a fraction).  The summary file (``$BENCH_SUMMARY``) is
    rewritten at once, so a run cut short by a timeout still leaves what it
    measured.
    """
    _medians[name] = value
    _write_summary()


def _write_summary() -> None:
    path = os.environ.get("BENCH_SUMMARY")
    if path:
        with open(path, "w") as f:
            json.dump(_summary()[1], f, indent=2)


def unit_of(name: str) -> str:
    """The unit of the recorded ``name``: :data:`SECONDS` unless a rate or a fraction."""
    for t in _targets.TARGETS:
        if t.denominator is None and t.numerator == name:
            return t.unit
    if name.startswith(_RATE_PREFIXES):
        return PER_SECOND
    if any(mark in name for mark in _FRACTION_MARKS):
        return FRACTION
    return SECONDS


def fmt_value(value: float, unit: str) -> str:
    """``12.34 us``, ``20000 /s`` or ``0.0042`` (right-aligned, for the list of medians)."""
    if unit == SECONDS:
        return f"{value * 1e6:12.2f} us"
    if unit == PER_SECOND:
        return f"{value:12.0f} /s"
    return f"{value:12.4f}"


def _summary() -> tuple[str, dict[str, Any]]:
    """The targets this run measured as text, and everything recorded as JSON-ready data."""
    return _targets.recorded_summary(_medians, extra=RATIOS)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _medians:
        return
    terminalreporter.section("cupy_ipcpool benchmark medians")
    for name, v in sorted(_medians.items()):
        terminalreporter.write_line(f"{name:<40} {fmt_value(v, unit_of(name))}")
    # last, so that the run ends with it; the title is the one scripts/gpu-test looks for
    terminalreporter.section("cupy_ipcpool benchmark medians and ratios: guards, then goals")
    text, _ = _summary()
    for line in text.splitlines():
        terminalreporter.write_line(line)
    _write_summary()
