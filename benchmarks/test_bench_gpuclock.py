"""Where a frame's time goes, on the GPU's clock (``python -m cupy_ipcpool bench --gpu-clock``).

For the channel (block mode), the ordered floor and the in-process floor at
1 MiB and 64 MiB: p50/p90 of the producer's fill done -> the consumer's check
starting (``%globaltimer`` read inside the lanes' own kernels,
:mod:`cupy_ipcpool._bench.gpuclock`), of the round trip (the producer's host,
as the lanes time it), and each side's CPU time per frame.  One test per
lane, both sizes in one process pair, :data:`ITERS` timed frames each.

Stored in ``benchmark.extra_info`` (``gpu_one_way_p50_us_1MiB``,
``round_trip_p90_us_64MiB``, ``producer_cpu_us_1MiB``, ...; ``gpu_sharing``:
``MPS`` or ``time-sliced``) and recorded for the summary (``$BENCH_SUMMARY``)
as ``gpuclock_{lane}_{one_way,round_trip}_{p50,p90}_{1,64}MiB`` and
``gpuclock_{lane}_{producer,consumer}_cpu_per_frame_{1,64}MiB`` (seconds).
Asserted: every frame verified, every timed frame stamped on both sides, and
no check starting before its frame's fill ended (the GPU ordering held);
no timing assertions.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import record_value

from cupy_ipcpool._bench import gpuclock
from cupy_ipcpool._bench.harness import OK, SKIPPED, MiB
from cupy_ipcpool._bench.lanes import get_lanes

SIZES_MIB = (1, 64)
ITERS = 2000


@pytest.mark.benchmark(group="gpu-clock")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("lane", gpuclock.GPU_CLOCK_LANES)
def test_gpu_clock(benchmark: Any, lane: str, capsys: Any) -> None:
    def run() -> dict[str, Any]:
        return gpuclock.run_gpu_clock(get_lanes([lane]), [m * MiB for m in SIZES_MIB], iters=ITERS)

    res = benchmark.pedantic(run, rounds=1, iterations=1)
    with capsys.disabled():
        print()
        print(gpuclock.markdown([res]), end="")

    cells = res["cells"]
    assert [c["size_mib"] for c in cells] == list(SIZES_MIB)
    if all(c["status"] == SKIPPED for c in cells):
        pytest.skip(cells[0]["reason"])
    benchmark.extra_info["gpu_sharing"] = res["gpu_sharing"]
    benchmark.extra_info["frames"] = ITERS
    for c in cells:
        assert c["status"] == OK, f"{lane} {c['size_mib']:g} MiB: {c['reason']}"
        mib = f"{int(c['size_mib'])}MiB"
        for series in ("gpu_one_way", "round_trip"):
            for q in ("p50", "p90"):
                value = c[f"{series}_us"][q]
                benchmark.extra_info[f"{series}_{q}_us_{mib}"] = value
                name = series.replace("gpu_", "")
                record_value(f"gpuclock_{lane}_{name}_{q}_{mib}", value * 1e-6)
        sides = {"producer": c["producer_cpu"]}
        if c["consumer_cpu"]:
            sides["consumer"] = c["consumer_cpu"][0]
        for side, cpu in sides.items():
            assert cpu is not None, f"{lane} {mib}: no {side} CPU time"
            benchmark.extra_info[f"{side}_cpu_us_{mib}"] = cpu["process_us"]
            benchmark.extra_info[f"{side}_thread_cpu_us_{mib}"] = cpu["thread_us"]
            record_value(f"gpuclock_{lane}_{side}_cpu_per_frame_{mib}", cpu["process_us"] * 1e-6)
        assert c["gpu_one_way_us"]["n"] == ITERS and c["gpu_one_way_missing"] == 0, c
        assert c["gpu_one_way_negative"] == 0, (
            f"{lane} {mib}: {c['gpu_one_way_negative']} check(s) started before their frame's "
            "fill ended on the GPU's clock"
        )
