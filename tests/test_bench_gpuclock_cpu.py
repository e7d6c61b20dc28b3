"""The gpu-clock measurement's GPU-free parts: options, aggregation, JSON, table, processes.

``python -m cupy_ipcpool bench --gpu-clock`` wraps the lanes' own sides
(:class:`gpuclock.ClockedLane`); here the same wrapping runs for real in
spawned processes over real sockets, with a host stand-in for
:class:`~cupy_ipcpool._bench.lanes.GpuWork` whose "GPU timestamps" are
``time.monotonic_ns`` (one clock for every process, as ``%globaltimer`` is
for every context), taken where the kernels take theirs: after the fill's
writes, before the check's reads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import cupy_ipcpool._bench as bench
from cupy_ipcpool._bench import gpuclock, harness, lanes, report
from cupy_ipcpool._bench.harness import FAILED, OK, SKIPPED, MiB, PairResult
from cupy_ipcpool._bench.interface import BenchConfig, Lane, ProducerSide
from cupy_ipcpool._bench.lanes import _floors

ITERS, WARMUP = 30, 3


# --------------------------------------------------------------- host stand-ins
class _HostClock:
    """:class:`lanes.GpuClock`'s interface on lists: ``frame``, ``index()``, ``to_host()``."""

    def __init__(self, frames: int) -> None:
        self.frames = frames
        self.frame = -1
        self.fill_end = [0] * (frames + 1)
        self.check_start = [0] * (frames + 1)

    def index(self):
        return self.frame if 0 <= self.frame < self.frames else None

    def to_host(self):
        return {
            "fill_end_ns": list(self.fill_end[: self.frames]),
            "check_start_ns": list(self.check_start[: self.frames]),
        }


class _HostWork:
    """:class:`lanes.GpuWork` on numpy arrays, stamping as its clocked kernels do."""

    class _Stream:
        def synchronize(self):
            pass

    shift = 0  # a check that stamps the wrong frame (negative control)

    def __init__(self):
        self.stream = self._Stream()
        self.errors = 0
        self.clock = None
        self._counter = lanes.MismatchCounter()

    def start_clock(self, frames):
        self.clock = _HostClock(frames)
        return self.clock

    def fill(self, a, value):
        a[:] = value
        i = None if self.clock is None else self.clock.index()
        if i is not None:  # after the frame's last write
            self.clock.fill_end[i] = max(self.clock.fill_end[i], time.monotonic_ns())

    def enqueue_check(self, a, value):
        i = None if self.clock is None else self.clock.index()
        if i is not None:  # before the first read
            self.clock.check_start[min(i + self.shift, self.clock.frames)] = time.monotonic_ns()
        self.errors += int(np.count_nonzero(a[lanes.sample_indices(a.size)] != value))

    def full_check(self, a, value):
        return bool(np.all(a == value))

    def flush(self):
        return self._counter.take(self.errors)


class _HostProducer(_floors._SocketGpuFloorProducer):
    def open_gpu(self, cfg, nelem):
        return _HostWork(), np.empty(nelem, dtype=np.int32)


class _HostConsumer(_floors._SocketGpuFloorConsumer):
    shift = 0

    def open_gpu(self, cfg, nelem):
        work = _HostWork()
        work.shift = self.shift
        return work, np.zeros(nelem, dtype=np.int32)


class HostFloorLane(lanes.SocketGpuFloorLane):
    """socket_gpu_floor on the host: two processes, stamps on one host clock."""

    name = "host_clock_floor"

    def available(self):
        return None

    def open_producer(self, links, cfg, nbytes):
        return _HostProducer(links, cfg, nbytes)

    def open_consumer(self, link, cfg, nbytes):
        return _HostConsumer(link, cfg, nbytes)


class _ShiftedConsumer(_HostConsumer):
    shift = 1


class ShiftedStampLane(HostFloorLane):
    """The consumer stamps frame i + 1 at frame i: the aggregation must show it."""

    name = "shifted_stamp_floor"

    def open_consumer(self, link, cfg, nbytes):
        return _ShiftedConsumer(link, cfg, nbytes)


class _HostInProcess(ProducerSide):
    """The in-process floor's side on the host: fill and check on one work."""

    def __init__(self, cfg, nbytes):
        super().__init__()
        self.work = _HostWork()
        self.arr = np.empty(nbytes // 4, dtype=np.int32)

    def send(self, value):
        self.work.fill(self.arr, value)

    def wait_done(self, value, *, full):
        if not lanes.check_frame(self.work, self.arr, value, self.arr.size, full=full):
            self.failures.append(f"value {value}: data does not hold it")

    def flush_checks(self):
        return self.work.flush()


class HostInProcessLane(Lane):
    name = "host_inprocess"
    processes = 1

    def open_producer(self, links, cfg, nbytes):
        return _HostInProcess(cfg, nbytes)


class NoWorkLane(lanes.SocketFloorLane):
    """A lane without a GpuWork: the clock cannot be taken and the lane must fail, not hang."""

    name = "no_work"


# ------------------------------------------------------------------ options
def _parser():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p


def test_gpu_clock_option_defaults():
    args = _parser().parse_args(["--gpu-clock"])
    opts = bench.options_from_args(args)
    assert opts.gpu_clock and opts.lanes is None
    bench.check_args(args)  # the default lanes are the channel's two modes and two floors
    assert gpuclock.check_lanes(None) == (
        "cupy_ipcpool",
        "cupy_ipcpool_ahead",
        "cupy_ipcpool_ahead_spin",
        "ordered_floor",
        "inprocess_floor",
    )
    assert not bench.options_from_args(_parser().parse_args([])).gpu_clock


def test_sizes_take_units():
    args = _parser().parse_args(["--sizes", "1MiB,64MiB, 1GiB,64"])
    assert args.sizes == (1, 64, 1024)
    assert bench.parse_sizes("2mib") == (2,)
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_sizes("1KiB")
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_sizes("0MiB")


def test_gpu_clock_lanes_are_checked(tmp_path):
    args = _parser().parse_args(
        ["--gpu-clock", "--lanes", "cupy_ipcpool,socket_floor", "--outdir", str(tmp_path)]
    )
    with pytest.raises(argparse.ArgumentError, match="--lanes: --gpu-clock measures"):
        bench.check_args(args)
    args = _parser().parse_args(["--gpu-clock", "--paired-turns", "2", "--outdir", str(tmp_path)])
    with pytest.raises(argparse.ArgumentError, match="--paired-turns"):
        bench.check_args(args)
    # order kept as the report's, whatever the command line's
    assert gpuclock.check_lanes(["inprocess_floor", "cupy_ipcpool"]) == (
        "cupy_ipcpool",
        "inprocess_floor",
    )
    # without --gpu-clock any lane goes, as before
    bench.check_args(_parser().parse_args(["--lanes", "socket_floor", "--outdir", str(tmp_path)]))


def test_cli_refuses_a_lane_before_the_gpu(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(
        [sys.executable, "-m", "cupy_ipcpool", "bench", "--gpu-clock", "--lanes", "host_staging"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr
    assert "--lanes" in out.stderr and "host_staging" in out.stderr
    assert "Traceback" not in out.stderr


def test_schedule_for():
    s = gpuclock.schedule_for(2000, 100)
    assert (s.warmup, s.iters, s.tput) == (100, 2000, 0) and s.total == 2102
    with pytest.raises(ValueError):
        gpuclock.schedule_for(0)
    with pytest.raises(ValueError):
        gpuclock.schedule_for(10, -1)


# -------------------------------------------------------------- aggregation
def test_one_way_counts_missing_and_negative():
    end = [0, 100, 1_000, 2_000, 3_000, 4_000]
    start = [5, 0, 3_000, 1_500, 3_000, 9_000]
    samples, missing, negative = gpuclock.one_way_us(end, start, range(1, 6))
    assert missing == 1  # frame 1 has no check stamp
    assert negative == 1  # frame 3: the check before the fill's end
    assert samples == [2.0, -0.5, 0.0, 5.0]
    # frames past the arrays are missing, not an IndexError
    assert gpuclock.one_way_us([1], [2], range(3)) == ([0.001], 2, 0)


def test_stats_and_cpu():
    xs = [float(v) for v in range(1, 101)]
    s = gpuclock.stats(xs)
    assert s["n"] == 100 and s["min"] == 1.0 and s["max"] == 100.0
    assert s["p50"] == pytest.approx(float(np.percentile(xs, 50)))
    assert s["p90"] == pytest.approx(float(np.percentile(xs, 90)))
    assert s["p99"] == pytest.approx(float(np.percentile(xs, 99)))
    assert gpuclock.stats([]) == {
        "n": 0,
        "p50": None,
        "p90": None,
        "p99": None,
        "mean": None,
        "min": None,
        "max": None,
    }
    cpu = gpuclock.cpu_per_frame_us(
        {"process_ns": 4_000_000, "thread_ns": 3_000_000, "wall_ns": 8_000_000, "frames": 1000}
    )
    assert cpu == {"process_us": 4.0, "thread_us": 3.0, "process_share_of_wall": 0.5}
    assert gpuclock.cpu_per_frame_us(None) is None


def test_host_cpu_window():
    h = gpuclock.HostCpu(2, 4)
    for f in range(7):
        h.begin(f)
        sum(range(2000))
        h.end(f)
    assert h.result is not None and h.result["frames"] == 3
    assert h.result["process_ns"] >= 0 and h.result["wall_ns"] > 0
    never = gpuclock.HostCpu(5, 9)
    never.begin(5)
    never.end(8)
    assert never.result is None


def _pair_result(nbytes, sched, *, with_consumer=True, cons_clock=True):
    total = sched.total
    end = [1_000_000 + 1_000 * i for i in range(total)]
    start = [e + 150_000 + (i % 10) * 1_000 for i, e in enumerate(end)]
    host = {"process_ns": 20_000 * sched.iters, "thread_ns": 15_000 * sched.iters}
    host |= {"wall_ns": 100_000 * sched.iters, "frames": sched.iters}
    prod = {
        "latencies_ns": [100_000 + 10 * i for i in range(sched.iters)],
        "tput_frames": 0,
        "tput_ns": 1,
        "failures": [],
        "gpu_clock": {
            "stamps": {"fill_end_ns": end, "check_start_ns": [0] * total},
            "host": host,
            "frames": total,
        },
    }
    cons = {
        "verified": total,
        "full_checks": sched.warmup + sched.checks,
        "device_checked": sched.iters,
        "device_mismatches": 0,
        "failures": [],
        "n_failures": 0,
    }
    if cons_clock:
        cons["gpu_clock"] = {
            "stamps": {"fill_end_ns": [0] * total, "check_start_ns": start},
            "host": dict(host, process_ns=10_000 * sched.iters),
            "frames": total,
        }
    if not with_consumer:
        prod["gpu_clock"]["stamps"]["check_start_ns"] = start
        return PairResult(OK, producer={str(nbytes): prod}, consumers=[])
    return PairResult(OK, producer={str(nbytes): prod}, consumers=[{str(nbytes): cons}])


def test_cell_from_two_processes():
    sched = gpuclock.schedule_for(100, 5)
    cfg = BenchConfig(sizes=(MiB,), schedule=sched)
    c = gpuclock.cell("cupy_ipcpool", MiB, cfg, _pair_result(MiB, sched))
    assert c["status"] == OK, c["reason"]
    assert c["frames"] == 100 and c["consumers"] == 1
    g = c["gpu_one_way_us"]
    assert g["n"] == 100 and g["min"] == 150.0 and g["max"] == 159.0
    expect = [150.0 + (i % 10) for i in range(sched.warmup, sched.warmup + sched.iters)]
    assert g["p50"] == pytest.approx(float(np.percentile(expect, 50)))
    assert g["p90"] == pytest.approx(float(np.percentile(expect, 90)))
    assert c["gpu_one_way_missing"] == 0 and c["gpu_one_way_negative"] == 0
    assert c["round_trip_us"]["p50"] == pytest.approx(100.0 + 0.01 * 49.5)
    assert c["producer_cpu"]["process_us"] == pytest.approx(20.0)
    assert c["consumer_cpu"][0]["process_us"] == pytest.approx(10.0)
    assert len(c["gpu_one_way_samples_us"]) == 100
    json.dumps(c)  # JSON-ready as it is


def test_cell_in_process_uses_its_own_check():
    sched = gpuclock.schedule_for(50, 2)
    cfg = BenchConfig(sizes=(64 * MiB,), schedule=sched)
    res = _pair_result(64 * MiB, sched, with_consumer=False)
    c = gpuclock.cell("inprocess_floor", 64 * MiB, cfg, res)
    assert c["status"] == OK, c["reason"]
    assert c["consumers"] == 0 and c["consumer_cpu"] == []
    assert c["gpu_one_way_us"]["n"] == 50


def test_cell_failures_and_skips():
    sched = gpuclock.schedule_for(20, 2)
    cfg = BenchConfig(sizes=(MiB,), schedule=sched)
    skipped = gpuclock.cell("x", MiB, cfg, PairResult(SKIPPED, "cupy is not installed"))
    assert skipped["status"] == SKIPPED and skipped["reason"] == "cupy is not installed"
    failed = gpuclock.cell("x", MiB, cfg, PairResult(FAILED, "producer: boom"))
    assert failed["status"] == FAILED and "boom" in failed["reason"]
    no_clock = gpuclock.cell("x", MiB, cfg, _pair_result(MiB, sched, cons_clock=False))
    assert no_clock["status"] == FAILED and "consumer 0 sent no GPU clock" in no_clock["reason"]
    res = _pair_result(MiB, sched)
    res.consumers[0][str(MiB)]["gpu_clock"] = {"error": "CUDARuntimeError: x", "host": None}
    broken = gpuclock.cell("x", MiB, cfg, res)
    assert broken["status"] == FAILED and "CUDARuntimeError" in broken["reason"]
    res = _pair_result(MiB, sched)
    res.consumers[0][str(MiB)]["verified"] -= 1
    unverified = gpuclock.cell("x", MiB, cfg, res)
    assert unverified["status"] == FAILED and "verified" in unverified["reason"]


def test_table_json_and_the_table_command(tmp_path, capsys):
    sched = gpuclock.schedule_for(100, 5)
    cfg = BenchConfig(sizes=(MiB,), schedule=sched)
    runs = []
    for sharing in ("time-sliced", "MPS"):
        cells = [
            gpuclock.cell("cupy_ipcpool", MiB, cfg, _pair_result(MiB, sched)),
            gpuclock.cell("ordered_floor", MiB, cfg, PairResult(FAILED, "consumer: boom")),
        ]
        runs.append({"kind": "gpu_clock", "gpu_sharing": sharing, "cells": cells, "notes": []})
    text = gpuclock.markdown(runs)
    lines = text.splitlines()
    assert lines[0] == gpuclock.TABLE_HEAD
    assert lines[1].count("---") == lines[0].count("|") - 1
    rows = [ln for ln in lines[2:] if ln.startswith("| ")]
    assert len(rows) == 4 and all(r.count("|") == lines[0].count("|") for r in rows)
    assert rows[0].startswith("| time-sliced | cupy_ipcpool | 1 MiB | 154 / 158 | 100 / 101 |")
    assert "FAILED: consumer: boom" in rows[1] and rows[2].startswith("| MPS |")
    paths = []
    for i, r in enumerate(runs):
        js, md = gpuclock.write_outputs(r, str(tmp_path), stem=f"run{i}")
        assert os.path.isfile(md)
        assert gpuclock.load(js)["gpu_sharing"] == r["gpu_sharing"]
        paths.append(js)
    out_md = tmp_path / "table.md"
    assert gpuclock.main(["table", *paths, "--out", str(out_md)]) == 1  # a FAILED cell
    printed = capsys.readouterr().out
    assert printed == out_md.read_text() and "| MPS | cupy_ipcpool |" in printed
    (tmp_path / "other.json").write_text("{}")
    assert gpuclock.main(["table", str(tmp_path / "other.json")]) == 1
    assert "not the JSON of a gpu-clock run" in capsys.readouterr().err


# ------------------------------------------------------------ real processes
def test_clocked_lanes_in_real_processes(tmp_path):
    written = []
    res = gpuclock.run_gpu_clock(
        [HostFloorLane(), HostInProcessLane()],
        [4096, MiB],
        iters=ITERS,
        warmup=WARMUP,
        partial=lambda r: written.append(gpuclock.write_outputs(r, str(tmp_path))),
    )
    assert len(written) == 2  # after each lane
    assert res["kind"] == "gpu_clock" and res["config"]["schedule"]["iters"] == ITERS
    assert res["gpu_sharing"].startswith(("unknown", "MPS", "time-sliced"))
    cells = res["cells"]
    assert [(c["lane"], c["nbytes"]) for c in cells] == [
        ("host_clock_floor", 4096),
        ("host_clock_floor", MiB),
        ("host_inprocess", 4096),
        ("host_inprocess", MiB),
    ]
    for c in cells:
        assert c["status"] == OK, c["reason"]
        g = c["gpu_one_way_us"]
        # every timed frame stamped on both sides, each check after its own frame's fill
        assert g["n"] == ITERS and c["gpu_one_way_missing"] == 0, c
        assert c["gpu_one_way_negative"] == 0 and g["min"] >= 0
        assert c["round_trip_us"]["n"] == ITERS
        assert c["producer_cpu"]["process_us"] > 0
    assert cells[0]["consumers"] == 1 and cells[0]["consumer_cpu"][0]["process_us"] > 0
    assert cells[2]["consumers"] == 0 and cells[2]["consumer_cpu"] == []
    on_disk = json.loads((tmp_path / "gpuclock.json").read_text())
    assert [c["lane"] for c in on_disk["cells"]] == [c["lane"] for c in cells]
    assert "host_inprocess" in (tmp_path / "gpuclock.md").read_text()


def test_clocked_side_stamps_only_its_frames(tmp_path):
    # the producer's record: fill stamps on every frame (warm-up and checks too, each its own),
    # the consumer's: check stamps on the timed frames only (the others are full checks)
    sched = gpuclock.schedule_for(ITERS, WARMUP)
    cfg = BenchConfig(sizes=(4096,), schedule=sched)
    res = harness.run_pair(gpuclock.ClockedLane(HostFloorLane()), cfg, timeout=120)
    assert res.status == OK, res.reason
    prod = res.producer["4096"]["gpu_clock"]
    cons = res.consumers[0]["4096"]["gpu_clock"]
    end = prod["stamps"]["fill_end_ns"]
    start = cons["stamps"]["check_start_ns"]
    assert len(end) == len(start) == sched.total
    assert all(end) and end == sorted(end)
    timed = range(sched.warmup, sched.warmup + sched.iters)
    assert all(start[i] for i in timed)
    assert not any(start[i] for i in range(sched.total) if i not in timed)
    assert prod["host"]["frames"] == cons["host"]["frames"] == ITERS
    assert prod["frames"] == cons["frames"] == sched.total


def test_misaligned_stamps_are_reported():
    res = gpuclock.run_gpu_clock([ShiftedStampLane()], [4096], iters=ITERS, warmup=WARMUP)
    (c,) = res["cells"]
    assert c["status"] == OK
    # frame i's check stamped as frame i + 1, before frame i + 1's fill; the last timed frame's
    # slot then holds no check stamp of its own frame
    assert c["gpu_one_way_negative"] >= ITERS - 1
    assert "with the check before the fill's end" in gpuclock.markdown([res])


def test_a_lane_without_gpu_work_fails_clearly():
    res = gpuclock.run_gpu_clock([NoWorkLane()], [4096], iters=5, warmup=1)
    (c,) = res["cells"]
    assert c["status"] == FAILED and "has no GpuWork" in c["reason"], c["reason"]
    assert gpuclock.failed_cells(res) == [c]


def test_kernel_source_has_the_clocked_kernels():
    src = lanes.KERNEL_SOURCE
    assert "%%globaltimer" in src  # inline asm: %% for a special register
    assert 'extern "C" __global__ void cipbench_fill_clock(' in src
    assert 'extern "C" __global__ void cipbench_check_clock(' in src
    assert "atomicMax(end_ns + index" in src
    fill = src.split("void cipbench_fill_clock(")[1].split("extern")[0]
    assert (
        fill.index("cipbench_fill_body(") < fill.index("__syncthreads()") < fill.index("atomicMax")
    )
    check = src.split("void cipbench_check_clock(")[1]
    assert check.index("cipbench_globaltimer()") < check.index("cipbench_check_body(")


def test_report_helpers_used_by_the_table():
    assert report.fmt_size(64 * MiB) == "64 MiB"
    line = gpuclock.progress_line(
        {"lane": "x", "nbytes": MiB, "status": SKIPPED, "reason": "no cupy"}
    )
    assert line.endswith("skipped: no cupy")


# ------------------------------------------------------------------ the script
SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "gpu-clock"
)


def test_script_is_valid_bash_and_stops_mps_in_a_trap():
    assert os.access(SCRIPT, os.X_OK)
    subprocess.run(["bash", "-n", SCRIPT], check=True, timeout=30)
    with open(SCRIPT) as f:
        text = f.read()
    for needle in (
        "CUDA_MPS_PIPE_DIRECTORY=",
        "CUDA_MPS_LOG_DIRECTORY=",
        '"$MPS_CONTROL" -d',
        "echo quit | timeout 10",
        "trap stop_mps EXIT",
        "bench --gpu-clock",
    ):
        assert needle in text, needle


@pytest.mark.parametrize("mps", ["missing", "refuses"])
def test_script_fails_clearly_without_a_gpu_or_mps(tmp_path, mps):
    # no GPU here: the time-sliced run fails in one line, MPS cannot start, nothing hangs
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OUT=str(tmp_path / "out"))
    env["PYTHON"] = sys.executable
    if mps == "refuses":
        fake = tmp_path / "nvidia-cuda-mps-control"
        fake.write_text("#!/bin/sh\necho 'cannot start' >&2\nexit 1\n")
        fake.chmod(0o755)
        env["MPS_CONTROL_BIN"] = str(fake)
    else:  # the PATH stays whole: where the real one is, bash and the rest are too
        env["MPS_CONTROL_BIN"] = "cupy-ipcpool-no-such-mps-control"
    out = subprocess.run(
        ["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=150, cwd=tmp_path
    )
    assert out.returncode == 1, out.stdout + out.stderr
    want = "is not on the PATH" if mps == "missing" else "did not start"
    assert want in out.stderr, out.stderr
    assert "time-sliced: FAILED" in out.stderr
    assert "no measurement came back" in out.stdout
    assert (tmp_path / "out" / "gpu-clock.log").is_file()
