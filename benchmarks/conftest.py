"""Benchmark harness: medians from pytest-benchmark, ratios against a baseline of the same run.

Each benchmark records its median with the ``record`` fixture (or a value with
``record_value``); the ratios in ``RATIOS`` and the values in ``ABSOLUTE`` are
printed at the end of the session (and written as JSON to ``$BENCH_SUMMARY``
when set), with the issue's target beside each.  Both take ``">="`` or ``"<="``.
Recorded values are seconds unless :func:`unit_of` says otherwise (rates such
as frames/s, fractions such as CPU time per wall second).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from cupy_ipcpool import _driver

_medians: dict[str, float] = {}


def per_size(
    label: str, numerator: str, denominator: str, op: str, target: float, sizes: tuple[int, ...]
) -> list[tuple[str, str, str, str, float]]:
    """One :data:`RATIOS` row per size: ``{mib}`` in the three names stands for the size."""
    return [
        (label.format(mib=mib), numerator.format(mib=mib), denominator.format(mib=mib), op, target)
        for mib in sizes
    ]


# (label, numerator, denominator, comparison, target): ratio = numerator / denominator
RATIOS: list[tuple[str, str, str, str, float]] = [
    ("write bandwidth slot/plain 64 MiB", "write_plain_64MiB", "write_slot_64MiB", ">=", 0.98),
    ("write bandwidth slot/plain 1 GiB", "write_plain_1GiB", "write_slot_1GiB", ">=", 0.98),
    ("construction per slot pool/raw", "construct_pool", "construct_raw", "<=", 1.10),
    ("attach per slot ours/raw", "attach_pool", "attach_raw", "<=", 1.2),
    ("legacy IPC per frame / ours", "frame_legacy_ipc", "frame_ours", ">=", 20.0),
    ("small ops hook/default", "small_ops_hook", "small_ops_default", "<=", 1.5),
    ("alloc+free hook/default (info)", "alloc_free_hook", "alloc_free_default", "<=", 99.0),
    ("matmul 8192^2 default/hook", "matmul_default", "matmul_hook", ">=", 0.98),
    ("elementwise 1 GiB default/hook", "ew1g_default", "ew1g_hook", ">=", 0.98),
    ("fan-out p50 4 subs / 1 sub", "fanout_p50_4", "fanout_p50_1", "<=", 2.0),
    ("fan-out p50 8 subs / 1 sub", "fanout_p50_8", "fanout_p50_1", "<=", 2.0),
    (
        "fan-out p50 8 subs / 1 sub, interleaved turns",
        "fanout_interleaved_p50_8",
        "fanout_interleaved_p50_1",
        "<=",
        1.5,
    ),
    (
        "bare-socket fan-out p50 8 / 1, interleaved turns (info)",
        "fanout_interleaved_socket_p50_8",
        "fanout_interleaved_socket_p50_1",
        "<=",
        99.0,
    ),
    ("round trip p50 64 MiB / socket floor", "roundtrip_p50_64MiB", "socket_floor_p50", "<=", 3.0),
    ("round trip p50 1 GiB / 1 MiB", "roundtrip_p50_1024MiB", "roundtrip_p50_1MiB", "<=", 1.5),
]
# round trip tail (issue 11): p99 / p50 at each size
RATIOS += per_size(
    "round trip p99/p50 {mib} MiB",
    "roundtrip_p99_{mib}MiB",
    "roundtrip_p50_{mib}MiB",
    "<=",
    2.0,
    (1, 64, 1024),
)
# the same tail without the frames just after the benchmark's untimed drains
# (benchmarks/test_bench_channel.py, ``_tail_by_drain``): information beside the
# target's figure above, which stays the whole series' p99
RATIOS += per_size(
    "round trip p99/p50 {mib} MiB, settled (info)",
    "roundtrip_p99_{mib}MiB_settled",
    "roundtrip_p50_{mib}MiB",
    "<=",
    2.0,
    (1, 64, 1024),
)
# frames handed out ahead of their messages (mode="ahead") against block mode, 8 slots,
# the same run: the target is 2x; on time-sliced processes the GPU's turns between the
# two contexts bound both (docs/performance.md, "The GPU's side")
RATIOS += per_size(
    "throughput ahead/block 8 slots {mib} MiB",
    "throughput_fps_{mib}MiB_ahead",
    "throughput_fps_{mib}MiB",
    ">=",
    2.0,
    (1, 64),
)
# frames handed out ahead with the producer's host busy-polling its leases (which end at
# the read flags): the round trip against the in-process floor's, the same run.  The
# target (1.5x) is for MPS; time-sliced, the GPU's turns between the two contexts are in
# every cross-process lane and the ratio is information (docs/performance.md, "The GPU's
# side")
RATIOS += per_size(
    "gpu-clock round trip ahead+spin / in-process floor {mib} MiB",
    "gpuclock_cupy_ipcpool_ahead_spin_round_trip_p50_{mib}MiB",
    "gpuclock_inprocess_floor_round_trip_p50_{mib}MiB",
    "<=",
    1.5,
    (1, 64),
)
# remote lane (issue 12): channel rate / raw UCXX rate on the same transport, per size
for memory in ("device", "host"):
    RATIOS += per_size(
        f"remote {memory} channel/raw UCXX {{mib}} MiB",
        f"remote_{memory}_ucxx_{{mib}}MiB",
        f"remote_{memory}_channel_{{mib}}MiB",
        ">=",
        0.9,
        (1, 64, 256),
    )
# the same against raw UCXX between IpcPool slots (the channel's VMM memory; UCX may move
# it by another transport than the cupy.ones buffers of the row above)
RATIOS += per_size(
    "remote device channel/raw UCXX on VMM slots {mib} MiB",
    "remote_device_ucxx_vmm_{mib}MiB",
    "remote_device_channel_{mib}MiB",
    ">=",
    0.9,
    (1, 64, 256),
)

#: Units of recorded values: seconds (printed in µs), a rate, or a plain fraction.
SECONDS, PER_SECOND, FRACTION = "s", "/s", "fraction"

# (label, name, comparison, target, unit): the value itself against the target
ABSOLUTE: list[tuple[str, str, str, float, str]] = [
    ("handle -> cupy.ndarray in consumer", "frame_handle_to_array", "<=", 10e-6, SECONDS),
    ("acquire + release of a token", "acquire_release_token", "<=", 10e-6, SECONDS),
    ("round trip p50 1 MiB", "roundtrip_p50_1MiB", "<=", 50e-6, SECONDS),
    ("round trip p50 64 MiB", "roundtrip_p50_64MiB", "<=", 50e-6, SECONDS),
    ("round trip p50 1 GiB", "roundtrip_p50_1024MiB", "<=", 50e-6, SECONDS),
    ("throughput 1 MiB frames/s", "throughput_fps_1MiB", ">=", 20000.0, PER_SECOND),
    ("throughput 64 MiB frames/s", "throughput_fps_64MiB", ">=", 20000.0, PER_SECOND),
    ("pipelined 1 MiB frames/s", "pipelined_fps_1MiB", ">=", 40000.0, PER_SECOND),
    ("pipelined 64 MiB frames/s", "pipelined_fps_64MiB", ">=", 40000.0, PER_SECOND),
    ("idle subscriber CPU / wall", "idle_subscriber_cpu_fraction", "<=", 0.01, FRACTION),
    (
        "idle subscriber CPU / wall, spin_us=200",
        "idle_subscriber_cpu_fraction_spin",
        "<=",
        0.01,
        FRACTION,
    ),
]

#: Units of recorded names that have no ABSOLUTE entry, by prefix or substring.
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
    for _, n, _, _, unit in ABSOLUTE:
        if n == name:
            return unit
    if name.startswith(_RATE_PREFIXES):
        return PER_SECOND
    if any(mark in name for mark in _FRACTION_MARKS):
        return FRACTION
    return SECONDS


def fmt_value(value: float, unit: str) -> str:
    """``12.34 us``, ``20000 /s`` or ``0.0042`` (right-aligned, for the summary)."""
    if unit == SECONDS:
        return f"{value * 1e6:12.2f} us"
    if unit == PER_SECOND:
        return f"{value:12.0f} /s"
    return f"{value:12.4f}"


def _met(value: float, op: str, target: float) -> bool:
    if op == ">=":
        return value >= target
    if op == "<=":
        return value <= target
    raise ValueError(f"unknown comparison {op!r}")


def _summary() -> tuple[list[str], dict[str, Any]]:
    lines, out = [], {"medians_s": dict(_medians), "ratios": {}, "absolute": {}}
    for label, num, den, op, target in RATIOS:
        if num in _medians and den in _medians and _medians[den] > 0:
            r = _medians[num] / _medians[den]
            ok = _met(r, op, target)
            out["ratios"][label] = {"ratio": r, "target": f"{op} {target}", "met": ok}
            lines.append(f"{label:<40} {r:8.3f}  (target {op} {target}) {'OK' if ok else 'MISSED'}")
    for label, name, op, target, unit in ABSOLUTE:
        if name in _medians:
            v = _medians[name]
            ok = _met(v, op, target)
            out["absolute"][label] = {
                "value": v,
                "target": f"{op} {target}",
                "unit": unit,
                "met": ok,
            }
            shown = fmt_value(target, unit).strip()
            lines.append(
                f"{label:<40} {fmt_value(v, unit)} (target {op} {shown}) {'OK' if ok else 'MISSED'}"
            )
    return lines, out


def pytest_terminal_summary(terminalreporter: Any) -> None:
    lines, _ = _summary()
    if not _medians:
        return
    terminalreporter.section("cupy_ipcpool benchmark medians and ratios")
    for name, v in sorted(_medians.items()):
        terminalreporter.write_line(f"{name:<40} {fmt_value(v, unit_of(name))}")
    for line in lines:
        terminalreporter.write_line(line)
    _write_summary()
