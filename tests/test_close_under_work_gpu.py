"""GPU tier: no close unmaps memory that queued GPU work still uses.

``cuMemUnmap`` does not wait for kernels as ``cudaFree`` does.  Each case, in a
fresh child process (a fault would poison the context for good): a kernel that
touches the memory only after ~200 ms is queued, every reference to the arrays
is dropped, the owner is closed at once, and then a synchronize must succeed
and the kernel's write must have landed.  Every owner of mapped memory is
tried: the pool (``pool.array()``, ``token.array()``, an allocation under
``token.allocating()``, the seed façade), a peer after ``attach()``, a
subscriber, and an ``import_seed_buffers`` import; on the current stream and
on a side stream.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest

import cupy_ipcpool as cip
from tests.gpu_helpers import (
    DELAY_NS,
    LATE_SRC,
    publish_41s_to_first_subscriber,
    report_exception,
    run_child_for_result,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

MiB = 1 << 20
CTX = mp.get_context("spawn")


def _late(array: Any, stream: Any) -> Any:
    """Queue the late kernel on ``stream``; return the plain buffer it writes."""
    import cupy as cp

    kernel = cp.RawKernel(LATE_SRC, "late")
    with stream:
        out = cp.zeros(1, cp.uint32)
        kernel((1,), (1,), (array, out, cp.uint64(DELAY_NS)), stream=stream)
    return out


def _stream(where: str) -> Any:
    import cupy as cp

    return cp.cuda.Stream(non_blocking=True) if where == "side" else cp.cuda.get_current_stream()


def _finish(out: Any, t_queued: float, t_closed: float) -> tuple[str, ...]:
    import cupy as cp

    cp.cuda.Device(0).synchronize()  # raises CUDA_ERROR_ILLEGAL_ADDRESS if memory went first
    value = int(out.get()[0])
    return ("ok", str(value), f"{t_closed - t_queued:.3f}")


def _pool_case(how: str, where: str, queue: Any) -> None:
    try:
        import cupy as cp

        cp.cuda.Device(0).use()
        stream = _stream(where)
        pool = cip.IpcPool(2, 4 * MiB)
        token = None
        if how == "pool.array":
            a = pool.array((1024,), cp.uint32, slot=0)
        elif how == "token.array":
            token = pool.acquire()
            a = token.array((1024,), cp.uint32)
        elif how == "allocating":
            token = pool.acquire()
            with token.allocating():
                a = cp.empty((1024,), cp.uint32)
        elif how == "seed facade":
            pool.close()
            pool = cip.IPCBufferManager(2, 4 * MiB)
            a = pool.array((1024,), cp.uint32, slot=0)
        else:
            raise AssertionError(how)
        with stream:
            a.fill(41)
        t0 = time.monotonic()
        out = _late(a, stream)
        del a
        if token is not None:
            token.release()
            del token
        pool.close()
        queue.put(_finish(out, t0, time.monotonic()))
    except BaseException:
        report_exception(queue)


def _peer_case(desc: Any, handle: Any, where: str, queue: Any) -> None:
    try:
        stream = _stream(where)
        peer = cip.attach(desc)
        a = peer.array(handle)
        t0 = time.monotonic()
        out = _late(a, stream)
        del a
        peer.close()
        queue.put(_finish(out, t0, time.monotonic()))
    except BaseException:
        report_exception(queue)


def _seed_case(pairs: list[tuple[int, int]], step: int, alloc: int, queue: Any) -> None:
    try:
        import cupy as cp

        stream = _stream("current")
        bufs = cip.import_seed_buffers(pairs, step, device=0, rounding="exact", alloc_nbytes=alloc)
        a = bufs.array(0, cp.uint32, (1024,))
        t0 = time.monotonic()
        out = _late(a, stream)
        del a
        bufs.close()
        queue.put(_finish(out, t0, time.monotonic()))
    except BaseException:
        report_exception(queue)


def _subscriber_case(address: str, where: str, queue: Any) -> None:
    try:
        stream = _stream(where)
        sub = cip.subscribe(address, timeout=30)
        frame = sub.recv(timeout=30, stream=stream)  # stream waits for the frame's flag
        a = frame.array
        t0 = time.monotonic()
        out = _late(a, stream)
        frame.release(stream=stream)
        del a, frame
        sub.close()
        queue.put(_finish(out, t0, time.monotonic()))
    except BaseException:
        report_exception(queue)


def _run(target: Any, *args: Any) -> tuple[str, ...]:
    result, exitcode = run_child_for_result(target, *args)
    assert result[0] == "ok", result
    assert exitcode == 0, f"child exit code {exitcode}"
    return result


def _check(result: tuple[str, ...], read: int) -> None:
    _, value, closed_after = result
    assert int(value) == read, f"the late kernel read {value}, not {read}"
    # close waited for the kernel rather than unmapping under it
    assert float(closed_after) >= DELAY_NS / 1e9 * 0.9, closed_after


@pytest.mark.parametrize("where", ["current", "side"])
@pytest.mark.parametrize("how", ["pool.array", "token.array", "allocating", "seed facade"])
def test_pool_close_waits_for_queued_work(how: str, where: str) -> None:
    _check(_run(_pool_case, how, where), 42)


def _filled_pool() -> tuple[Any, Any]:
    import cupy as cp

    pool = cip.IpcPool(2, 4 * MiB)
    a = pool.array((1024,), cp.uint32, slot=0)
    a.fill(41)
    cp.cuda.Device(0).synchronize()
    return pool, pool.handle(a)


@pytest.mark.parametrize("where", ["current", "side"])
def test_peer_close_waits_for_queued_work(where: str) -> None:
    pool, handle = _filled_pool()
    with pool:
        _check(_run(_peer_case, pool.descriptor(), handle, where), 42)


def test_seed_import_close_waits_for_queued_work() -> None:
    pool, _ = _filled_pool()
    with pool:
        pairs = [tuple(pool.ipc_handle(s)) for s in range(pool.num_slots)]
        _check(_run(_seed_case, pairs, pool.slot_nbytes, pool.alloc_nbytes), 42)


@pytest.mark.parametrize("where", ["current", "side"])
def test_subscriber_close_waits_for_queued_work(where: str, tmp_path: Any) -> None:

    address = str(tmp_path / "pub.sock")
    with cip.IpcPool(4, 4 * MiB) as pool, cip.Publisher(pool, address) as pub:
        queue = CTX.Queue()
        proc = CTX.Process(target=_subscriber_case, args=(address, where, queue))
        proc.start()
        try:
            publish_41s_to_first_subscriber(pub, "the subscriber")
            result = None
            while result is None:
                pub.poll(0.01)
                try:
                    result = queue.get(timeout=0.05)
                except Exception:
                    assert proc.is_alive() or not queue.empty(), f"child exit {proc.exitcode}"
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert result[0] == "ok", result
    _check(result, 42)
