"""Handoff between two processes against the alternatives (the short mode of ``bench``).

Records each lane's 64 MiB p50 round trip as ``alt_<lane>_64MiB`` and asserts
only that every available lane verified every frame (timed frames through the
device-side counter read at the end of each phase): no timing assertions here
(the targets are printed by ``python -m cupy_ipcpool bench``).
"""

from __future__ import annotations

import pytest
from conftest import record_value

from cupy_ipcpool._bench import BenchOptions, report, run_benchmark, write_outputs
from cupy_ipcpool._bench.harness import FAILED, OK, SKIPPED, MiB


@pytest.mark.benchmark(group="alternatives")
@pytest.mark.timeout(900)
def test_alternatives_short(tmp_path, capsys):
    results = run_benchmark(BenchOptions(mode="short", outdir=str(tmp_path)))
    write_outputs(results, str(tmp_path))
    with capsys.disabled():
        print()
        print(report.markdown_table(results.measurements))
        print(report.targets_text(results.targets))
        for note in results.notes:
            print(f"- {note}")

    for m in results.measurements:
        if m.status == OK and m.nbytes == 64 * MiB and m.p50_us is not None:
            record_value(f"alt_{m.lane}_64MiB", m.p50_us * 1e-6)

    failed = [
        f"{m.lane} {report.fmt_size(m.nbytes)}: {m.reason}"
        for m in results.measurements
        if m.status == FAILED
    ]
    assert not failed, "lanes failed (verification or error):\n" + "\n".join(failed)
    measured = {m.lane for m in results.measurements if m.status == OK}
    assert "cupy_ipcpool" in measured, [
        (m.lane, m.status, m.reason) for m in results.measurements if m.lane == "cupy_ipcpool"
    ]
    total = BenchOptions(mode="short").schedule().total
    for m in results.measurements:
        assert m.status in (OK, SKIPPED)
        if m.status == OK:
            assert m.frames_verified == total, (m.lane, m.nbytes, m.frames_verified)
