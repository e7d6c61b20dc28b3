"""The C subscriber's round trip beside the Python subscriber's, in the same run.

Round trip as in ``test_bench_channel.py``: the producer publishes a frame
(the raw fill kernel on its stream, then the frame flag), the subscriber
receives it, makes its stream wait on the frame flag, releases it on that
stream (read-flag write, RELEASE), and the producer's host sees the lease
back.  Both subscribers do exactly that and nothing else per frame: the C one
is ``c/tests/gpu_consumer.c bench`` (``cip_sub_recv``, ``cip_frame_wait``,
``cip_sub_release``), the Python one ``sub.recv(stream=s)`` and
``frame.release(stream=s)``.  Passes alternate (Python, C, Python, C) so that
drift of the machine falls on both alike; each records the median and p99 of
all its passes.

Keys: ``roundtrip_c_p50_{1,64}MiB`` / ``roundtrip_c_p99_*`` and
``roundtrip_pysub_p50_{1,64}MiB`` / ``roundtrip_pysub_p99_*``; the ratio C /
Python is added to the summary (``RATIOS``), target <= 1.0 ("no slower").
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import select
import struct
import subprocess
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import RATIOS, record_value
from test_bench_channel import MiB, _Producer, _round_trips, _summary

import cupy_ipcpool as cip
from tests.test_c_library import C_DIR, build_c_program

SPAWN = mp.get_context("spawn")
PASSES = 2
ROUNDS = 1000

for _mib in (1, 64):
    RATIOS.append(
        (
            f"round trip p50 C subscriber / Python subscriber {_mib} MiB",
            f"roundtrip_c_p50_{_mib}MiB",
            f"roundtrip_pysub_p50_{_mib}MiB",
            "<=",
            1.0,
        )
    )


@pytest.fixture(scope="module")
def c_consumer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_c_program(
        tmp_path_factory.mktemp("cbench"), "gpu_consumer", [C_DIR / "tests" / "gpu_consumer.c"]
    )


def _py_consumer(address: str, ready: Any, results: Any) -> None:
    """The Python subscriber doing what the C one does: wait on the flag, release."""
    try:
        import cupy as cp

        stream = cp.cuda.Stream(non_blocking=True)
        frames = bad = last = 0
        with cip.subscribe(address) as sub:
            ready.put("ready")
            while True:
                try:
                    f = sub.recv(timeout=60, stream=stream)
                except cip.EndOfStream as exc:
                    if exc.clean:
                        break
                    raise
                (value,) = struct.unpack("<q", f.metadata[:8])
                bad += abs(value) != last + 1
                last = abs(value)
                f.release(stream=stream)
                frames += 1
        results.put({"frames": frames, "bad_frames": bad})
    except BaseException:
        ready.put("failed")
        results.put({"error": traceback.format_exc()})


def _start_python(address: str) -> Callable[[], dict]:
    ready, results = SPAWN.Queue(), SPAWN.Queue()
    proc = SPAWN.Process(target=_py_consumer, args=(address, ready, results))
    proc.start()
    if ready.get(timeout=120) != "ready":
        raise AssertionError(results.get(timeout=30)["error"])

    def finish() -> dict:
        report = results.get(timeout=60)
        proc.join(30)
        return report

    return finish


def _start_c(exe: Path, address: str) -> Callable[[], dict]:
    proc = subprocess.Popen(
        [str(exe), "bench", address], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline().strip() if ready else ""
    if line != "ready":
        proc.kill()
        raise AssertionError(f"the C subscriber did not start: {line}")

    def finish() -> dict:
        out, err = proc.communicate(timeout=60)
        lines = [x for x in out.splitlines() if x.startswith("{")]
        return json.loads(lines[-1]) if lines else {"error": out + err}

    return finish


@contextlib.contextmanager
def _channel(address: str, mib: int, start: Callable[[str], Callable[[], dict]]) -> Iterator[Any]:
    nbytes = mib * MiB
    with cip.IpcPool(4, nbytes) as pool, cip.Publisher(pool, address) as pub:
        finish = start(address)
        while not pub.subscribers:
            pub.poll(0.05)
        prod = _Producer(pub, nbytes)
        yield prod
        prod.work.stream.synchronize()
    report = finish()
    assert "error" not in report, report["error"]
    assert report["frames"] == prod.value, report
    assert report["bad_frames"] == 0, report


@pytest.mark.parametrize("mib", [1, 64])
def test_round_trip_c_beside_python(tmp_path: Path, c_consumer: Path, mib: int) -> None:
    times: dict[str, list[int]] = {"pysub": [], "c": []}
    starts = {"pysub": _start_python, "c": lambda a: _start_c(c_consumer, a)}
    for p in range(PASSES):
        for lane in ("pysub", "c"):
            with _channel(str(tmp_path / f"{lane}{p}.sock"), mib, starts[lane]) as prod:
                times[lane] += _round_trips(prod, ROUNDS)
    for lane, series in times.items():
        p50, p99 = _summary(series)
        record_value(f"roundtrip_{lane}_p50_{mib}MiB", p50)
        record_value(f"roundtrip_{lane}_p99_{mib}MiB", p99)
    c50, py50 = _summary(times["c"])[0], _summary(times["pysub"])[0]
    print(
        f"{mib} MiB round trip p50: C {c50 * 1e6:.1f} us, Python {py50 * 1e6:.1f} us, "
        f"ratio {c50 / py50:.2f}"
    )
