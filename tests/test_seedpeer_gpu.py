"""GPU tier: Python peers of a C++ IPCBufferManager (import_seed_buffers).

A C++ program written to the seed class's documented behaviour
(tests/seed_producer/seed_producer.cpp, built here with the system compiler,
cuda.h and -lcuda into a temporary directory) prints its ``{pid, fd}`` pairs,
fills its buffers with a known pattern and checks what this process writes
back.  The reverse: this library's ``IPCBufferManager`` façade hands its pairs
to a Python child that imports them the same way.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cupy_ipcpool as cip
from cupy_ipcpool import _driver
from tests._fds import fd_count
from tests.gpu_helpers import expected, fill, report_exception

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

MiB = 1 << 20
SPAWN = mp.get_context("spawn")
BUILD = Path(__file__).resolve().parent / "seed_producer" / "build.sh"
#: Where a mapping larger than the allocation is refused: the map, or at the latest the access.
MAP_CALLS = ("cuMemMap", "cuMemSetAccess")
#: Seconds the producer may take to report its buffers, and to verify.
PRODUCER_S = 30


def seed_pattern(buffer: int, words: int) -> np.ndarray:
    """What seed_producer writes into a buffer: word k is k * 2654435761 + (buffer + 1) * 40503."""
    k = np.arange(words, dtype=np.uint64)
    return ((k * 2654435761 + (buffer + 1) * 40503) & 0xFFFFFFFF).astype(np.uint32)


@pytest.fixture(scope="module")
def producer_binary(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Build seed_producer into a temporary directory (skip where no compiler or cuda.h)."""
    out = tmp_path_factory.mktemp("seed_producer")
    r = subprocess.run(["bash", str(BUILD), str(out)], capture_output=True, text=True, timeout=180)
    if r.returncode == 77:
        pytest.skip(r.stderr.strip().removeprefix("SKIP: "))
    if r.returncode != 0:
        pytest.fail(f"building seed_producer failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return r.stdout.strip().splitlines()[-1]


class SeedProducer:
    """A running seed_producer and what it printed before READY."""

    def __init__(self, binary: str, buffers: int, step: int, device: int = 0) -> None:
        self.proc = subprocess.Popen(
            [binary, str(buffers), str(step), str(device)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.pairs: list[list[int]] = []
        self.alloc = self.granularity = 0
        watchdog = threading.Timer(PRODUCER_S, self.proc.kill)  # a silent producer ends
        watchdog.start()
        try:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                words = line.split()
                if words == ["READY"]:
                    break
                if words[0] == "BUFFER":
                    assert int(words[1]) == len(self.pairs), line
                    self.pairs.append([int(words[2]), int(words[3])])
                elif words[0] == "ALLOC":
                    self.alloc, self.granularity = int(words[1]), int(words[3])
            else:
                _, err = self.proc.communicate(timeout=PRODUCER_S)
                pytest.fail(f"seed_producer ended early ({self.proc.returncode}): {err}")
        finally:
            watchdog.cancel()
        assert len(self.pairs) == buffers and self.alloc > 0
        assert all(pid == self.proc.pid for pid, _ in self.pairs)

    def verify(self) -> tuple[int, str]:
        """Ask the producer to check the buffers; its exit status and what it printed."""
        out, err = self.proc.communicate("VERIFY\n", timeout=PRODUCER_S)
        return self.proc.returncode, (out.strip() + err.strip())

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.communicate("", timeout=PRODUCER_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()


def _warm_up(pairs: list[list[int]], step: int, **kwargs: Any) -> None:
    """Import once and close, so that the fds the driver opens for good (its context,
    the first import) are open before a test counts fds."""
    with cip.import_seed_buffers(pairs, step, device=0, **kwargs) as bufs:
        bufs.array(0)[:1].get()
    gc.collect()


@pytest.mark.parametrize("step", [5 * MiB + 12, 4 * MiB], ids=["unaligned", "aligned"])
def test_every_byte_of_seed_buffers_read_and_written_back(producer_binary: str, step: int) -> None:
    import cupy as cp

    words = step // 4
    producer = SeedProducer(producer_binary, 3, step)
    try:
        _warm_up(producer.pairs, step)
        before = fd_count()
        bufs = cip.import_seed_buffers(producer.pairs, step, device=0)
        # the seed's sizes: an aligned step got a whole extra granule, and the import maps it
        assert bufs.granularity == producer.granularity
        assert (
            bufs.alloc_nbytes == producer.alloc == step - step % bufs.granularity + bufs.granularity
        )
        assert fd_count() == before  # the fetched fds are closed: the imports hold the memory
        assert len(bufs) == 3 and bufs.pairs == tuple(tuple(p) for p in producer.pairs)
        arrays = bufs.arrays(np.uint32)
        for i, a in enumerate(arrays):
            assert a.shape == (words,) and a.device.id == 0
            np.testing.assert_array_equal(cp.asnumpy(a), seed_pattern(i, words))
        raw = bufs.array(1)  # bytes, all of buffer_step
        assert raw.nbytes == step
        np.testing.assert_array_equal(cp.asnumpy(raw), seed_pattern(1, words).view(np.uint8))
        del raw
        for a in arrays:
            cp.invert(a, out=a)
        cp.cuda.Device(0).synchronize()
        assert producer.verify() == (0, "OK")
        # the producer has exited and released its buffers: the imports keep the memory
        for i, a in enumerate(arrays):
            np.testing.assert_array_equal(cp.asnumpy(a), ~seed_pattern(i, words))
        bufs.close()
        bufs.close()
        np.testing.assert_array_equal(cp.asnumpy(arrays[2][-8:]), ~seed_pattern(2, words)[-8:])
        with pytest.raises(cip.PoolClosedError):
            bufs.array(0)
        del a, arrays
    finally:
        producer.stop()


def test_producer_notices_a_buffer_left_unwritten(producer_binary: str) -> None:
    import cupy as cp

    step = 2 * MiB
    producer = SeedProducer(producer_binary, 3, step)
    try:
        with cip.import_seed_buffers(producer.pairs, step, device=0) as bufs:
            for a in bufs.arrays(np.uint32)[:2]:
                cp.invert(a, out=a)
            cp.cuda.Device(0).synchronize()
            del a
        rc, out = producer.verify()
        assert rc == 1 and out.startswith("MISMATCH buffer 2 word 0"), out
    finally:
        producer.stop()


def test_failed_imports_leave_nothing_and_a_right_one_follows(producer_binary: str) -> None:
    import cupy as cp

    step = 4 * MiB
    producer = SeedProducer(producer_binary, 2, step)
    try:
        pid = producer.proc.pid
        _warm_up(producer.pairs, step, alloc_nbytes=producer.alloc)
        before = fd_count()
        # a mapping larger than the exporter's allocation: refused at buffer 0, nothing kept
        with pytest.raises(cip.CudaError) as ei:
            cip.import_seed_buffers(
                producer.pairs, step, device=0, alloc_nbytes=producer.alloc + producer.granularity
            )
        assert ei.value.call in MAP_CALLS and "buffer 0" in str(ei.value)
        assert "rounding='seed'" in str(ei.value)
        assert fd_count() == before
        # buffer 0 imports, buffer 1's fd is the producer's stdin: buffer 0's import is undone
        with pytest.raises(cip.CudaError) as ei:
            cip.import_seed_buffers([producer.pairs[0], [pid, 0]], step, device=0)
        assert ei.value.call == "cuMemImportFromShareableHandle" and "buffer 1" in str(ei.value)
        assert fd_count() == before
        with cip.import_seed_buffers(
            producer.pairs, step, device=0, alloc_nbytes=producer.alloc
        ) as bufs:
            for i, a in enumerate(bufs.arrays(np.uint32)):
                np.testing.assert_array_equal(cp.asnumpy(a), seed_pattern(i, step // 4))
            del a
        assert fd_count() == before
    finally:
        producer.stop()


# -- the reverse: this library's façade, imported the seed way ------------------


def _child_import(
    pairs: list[list[int]], step: int, seeds: list[int], rounding: str, queue: Any
) -> None:
    try:
        import cupy as cp

        n = step // 4
        with cip.import_seed_buffers(pairs, step, device=0, rounding=rounding) as bufs:
            for i, a in enumerate(bufs.arrays(np.uint32)):
                if not np.array_equal(cp.asnumpy(a), expected(n, seeds[i])):
                    raise AssertionError(f"buffer {i}: the child read wrong data")
                fill(a, seeds[i] + 100)
            cp.cuda.Device(0).synchronize()
            del a
        gc.collect()
        before = fd_count()  # the driver's own fds are open now
        if step % _driver.granularity(0) == 0:
            # the seed's size is one granule more than the façade's allocation
            try:
                cip.import_seed_buffers(pairs, step, device=0, rounding="seed")
            except cip.CudaError as exc:
                explained = "rounding='exact'" in str(exc)
                if exc.call not in MAP_CALLS or not explained:
                    raise
            else:
                raise AssertionError("a mapping larger than the allocation was accepted")
            if fd_count() != before:
                raise AssertionError("the failed import left fds open")
        with cip.import_seed_buffers(pairs, step, device=0, rounding=rounding) as bufs:
            if bufs.alloc_nbytes != -(-step // bufs.granularity) * bufs.granularity:
                raise AssertionError(f"mapped {bufs.alloc_nbytes} bytes for a step of {step}")
            bufs.array(0)[:1].get()
        gc.collect()
        if fd_count() != before:
            raise AssertionError("the import left fds open")
        queue.put(("ok",))
    except BaseException:
        report_exception(queue)


@pytest.mark.parametrize(
    ("step", "rounding"), [(2 * MiB + 4, "seed"), (4 * MiB, "exact")], ids=["unaligned", "aligned"]
)
def test_facade_buffers_import_the_seed_way(step: int, rounding: str) -> None:
    import cupy as cp

    with cip.IPCBufferManager(3, step, device=0) as m:
        pairs, seeds, slots = [], [], []
        for _ in range(3):  # the seed's loop: next(), write, hand out getCurIpcMemHandle()
            slot = m.next()
            fill(m.array(dtype=np.uint32), slot + 10)
            pairs.append(m.getCurIpcMemHandle())
            seeds.append(slot + 10)
            slots.append(slot)
        cp.cuda.Device(0).synchronize()
        assert sorted(slots) == [0, 1, 2]
        queue = SPAWN.Queue()
        proc = SPAWN.Process(target=_child_import, args=(pairs, step, seeds, rounding, queue))
        proc.start()
        try:
            result = queue.get(timeout=90)
        finally:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
        if result[0] == "error":
            pytest.fail(f"child raised {result[1]}: {result[2]}\n{result[3]}")
        for slot, seed in zip(slots, seeds, strict=True):
            got = cp.asnumpy(m.array(dtype=np.uint32, slot=slot))
            np.testing.assert_array_equal(got, expected(step // 4, seed + 100))


@pytest.mark.multigpu
def test_seed_buffers_on_a_second_gpu(producer_binary: str) -> None:
    import cupy as cp

    if _driver.device_count() < 2:
        pytest.skip("needs two GPUs (run on the two-GPU machine)")
    step = 2 * MiB
    producer = SeedProducer(producer_binary, 2, step, device=1)
    try:
        with cip.import_seed_buffers(producer.pairs, step, device=1) as bufs:
            assert bufs.device == 1
            arrays = bufs.arrays(np.uint32)
            for i, a in enumerate(arrays):
                assert a.device.id == 1
                with cp.cuda.Device(1):
                    np.testing.assert_array_equal(cp.asnumpy(a), seed_pattern(i, step // 4))
                    cp.invert(a, out=a)
            cp.cuda.Device(1).synchronize()
            del a, arrays
        assert producer.verify() == (0, "OK")
    finally:
        producer.stop()
