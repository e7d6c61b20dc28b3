"""Benchmark harness: medians from pytest-benchmark, ratios against a baseline of the same run.

Each benchmark records its median with the ``record`` fixture; the ratios in
``RATIOS`` are printed at the end of the session (and written as JSON to
``$BENCH_SUMMARY`` when set), with the issue's target beside each.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from cupy_ipcpool import _driver

_medians: dict[str, float] = {}

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
    ("round trip p50 64 MiB / socket floor", "roundtrip_p50_64MiB", "socket_floor_p50", "<=", 3.0),
    ("round trip p50 256 MiB / 1 MiB", "roundtrip_p50_256MiB", "roundtrip_p50_1MiB", "<=", 1.5),
    ("fan-out p50 8 subs / 1 sub", "fanout_p50_8", "fanout_p50_1", "<=", 2.0),
]
# remote lane (issue 12): channel rate / raw UCXX rate on the same transport, per size
RATIOS += [
    (
        f"remote {memory} channel/raw UCXX {mib} MiB",
        f"remote_{memory}_ucxx_{mib}MiB",
        f"remote_{memory}_channel_{mib}MiB",
        ">=",
        0.9,
    )
    for memory in ("device", "host")
    for mib in (1, 64, 256)
]
# (label, name, target seconds)
ABSOLUTE: list[tuple[str, str, float]] = [
    ("handle -> cupy.ndarray in consumer", "frame_handle_to_array", 10e-6),
    ("acquire + release of a token", "acquire_release_token", 10e-6),
    ("round trip p50 1 MiB", "roundtrip_p50_1MiB", 50e-6),
    ("round trip p50 64 MiB", "roundtrip_p50_64MiB", 50e-6),
    ("round trip p50 256 MiB", "roundtrip_p50_256MiB", 50e-6),
]
# (label, name, minimum): values that are rates, not seconds
MINIMUMS: list[tuple[str, str, float]] = [
    ("throughput 1 MiB frames/s", "throughput_fps_1MiB", 20000.0),
    ("throughput 64 MiB frames/s", "throughput_fps_64MiB", 20000.0),
    ("throughput 256 MiB frames/s", "throughput_fps_256MiB", 20000.0),
]


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


def record_value(name: str, seconds: float) -> None:
    """Record a median measured outside pytest-benchmark (e.g. p50 of a latency series).

    The summary file (``$BENCH_SUMMARY``) is rewritten at once, so a run cut
    short by a timeout still leaves what it measured.
    """
    _medians[name] = seconds
    _write_summary()


def _write_summary() -> None:
    path = os.environ.get("BENCH_SUMMARY")
    if path:
        with open(path, "w") as f:
            json.dump(_summary()[1], f, indent=2)


def _summary() -> tuple[list[str], dict[str, Any]]:
    lines, out = [], {"medians_s": dict(_medians), "ratios": {}, "absolute": {}}
    for label, num, den, op, target in RATIOS:
        if num in _medians and den in _medians and _medians[den] > 0:
            r = _medians[num] / _medians[den]
            ok = r >= target if op == ">=" else r <= target
            out["ratios"][label] = {"ratio": r, "target": f"{op} {target}", "met": ok}
            lines.append(f"{label:<40} {r:8.3f}  (target {op} {target}) {'OK' if ok else 'MISSED'}")
    for label, name, target in ABSOLUTE:
        if name in _medians:
            v = _medians[name]
            ok = v <= target
            out["absolute"][label] = {"median_s": v, "target_s": target, "met": ok}
            lines.append(
                f"{label:<40} {v * 1e6:8.2f} us (target <= {target * 1e6:g} us) "
                f"{'OK' if ok else 'MISSED'}"
            )
    for label, name, minimum in MINIMUMS:
        if name in _medians:
            v = _medians[name]
            ok = v >= minimum
            out["absolute"][label] = {"value": v, "minimum": minimum, "met": ok}
            lines.append(
                f"{label:<40} {v:10.0f}    (target >= {minimum:g}) {'OK' if ok else 'MISSED'}"
            )
    return lines, out


def pytest_terminal_summary(terminalreporter: Any) -> None:
    lines, _ = _summary()
    if not _medians:
        return
    terminalreporter.section("cupy_ipcpool benchmark medians and ratios")
    rates = {name for _, name, _ in MINIMUMS}
    for name, v in sorted(_medians.items()):
        if name in rates or name.startswith("throughput_fps"):
            terminalreporter.write_line(f"{name:<40} {v:12.0f} /s")
        else:
            terminalreporter.write_line(f"{name:<40} {v * 1e6:12.2f} us")
    for line in lines:
        terminalreporter.write_line(line)
    _write_summary()
