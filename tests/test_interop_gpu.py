"""GPU tier: any array in, CuPy out (torch tensors and streams); pool.next() beside a publisher."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

import cupy_ipcpool as cip
from tests.gpu_helpers import child_message, report_exception, wait_subscribers

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(150)]

SPAWN = mp.get_context("spawn")
MiB = 1 << 20


@pytest.fixture
def cp():
    import cupy

    return cupy


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="torch is not installed here")


@pytest.fixture
def address(tmp_path):
    return str(tmp_path / "chan.sock")


# ------------------------------------------------------------------ in process


def test_token_acquire_release_and_streams(cp, torch):
    with cip.IpcPool(2, MiB) as pool:
        with pool.acquire(stream=torch.cuda.current_stream()) as token:
            assert token.stream_ptr == torch.cuda.current_stream().cuda_stream
            assert token.slot == pool.current == 1 and token.generation == 1
            assert pool.is_busy(1)
            stream = token.stream  # a CuPy stream over the same handle
            assert stream.ptr == token.stream_ptr
        assert token.released and not pool.is_busy(1)
        raw = cp.cuda.Stream(non_blocking=True)
        with pool.acquire(stream=raw.ptr) as token:  # a raw cudaStream_t
            assert token.stream_ptr == raw.ptr and token.slot == 0
        with pytest.raises(cip.UsageTypeError):
            pool.acquire(stream="nope")


def test_torch_tensor_in_a_slot_is_shareable(cp, torch):
    with cip.IpcPool(1, MiB) as pool, pool.acquire() as token:
        a = token.array((64, 32), cp.float32)
        t = torch.as_tensor(a, device="cuda")  # zero copy through __cuda_array_interface__
        assert t.data_ptr() == a.data.ptr == pool.ptr(token.slot)
        t.copy_(torch.arange(64 * 32, dtype=torch.float32, device="cuda").reshape(64, 32))
        h = token.handle(t[8:16, ::2])  # a torch view
        assert h.slot == token.slot and h.strides == (32 * 4, 8)
        back = pool.array_from_handle(h)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(back), t[8:16, ::2].cpu().numpy())
        with pytest.raises(cip.NotShareableError):
            pool.handle(torch.zeros(4, device="cuda"))  # torch's own memory


def test_negative_strides_are_refused_or_copied_for_dlpack(cp, torch):
    with cip.IpcPool(1, MiB) as pool:
        a = pool.array((16,), np.float32)
        a[...] = cp.arange(16, dtype=cp.float32)
        rev = a[::-1]
        with pytest.raises(cip.NotShareableError, match="negative strides"):
            cip.dlpack_safe(rev)
        safe = cip.dlpack_safe(rev, copy=True)
        t = torch.from_dlpack(safe)
        assert t.cpu().tolist() == list(range(15, -1, -1))
        assert cip.dlpack_safe(a) is a  # no copy when not needed
        t0 = torch.from_dlpack(cip.dlpack_safe(a))
        assert t0.data_ptr() == pool.ptr(0)


# ------------------------------------------------------------- across processes


def _torch_consumer(address, q):
    try:
        import torch

        with cip.subscribe(address) as sub:
            q.put(("ready",))
            frame = sub.recv(timeout=60)
            t = torch.from_dlpack(cip.dlpack_safe(frame.array))
            same = t.data_ptr() == frame.array.data.ptr
            values = t.cpu().numpy()
            frame.release()
            q.put(("result", type(frame.array).__name__, same, values))
    except BaseException:
        report_exception(q)


def test_torch_tensor_published_and_received(address, cp, torch):
    with cip.IpcPool(2, MiB) as pool, cip.Publisher(pool, address) as pub:
        q = SPAWN.Queue()
        proc = SPAWN.Process(target=_torch_consumer, args=(address, q))
        proc.start()
        assert child_message(q)[0] == "ready"
        wait_subscribers(pub, 1)
        stream = torch.cuda.current_stream()
        with pub.frame(stream=stream) as f:
            t = torch.as_tensor(f.array((1000,), cp.float32), device="cuda")
            t.copy_(torch.arange(1000, dtype=torch.float32, device="cuda") * 0.5)
            f.publish(t)  # a torch tensor, flag set on torch's stream
        _, kind, zero_copy, values = child_message(q)
        proc.join(30)
    assert kind == "ndarray" and zero_copy
    np.testing.assert_array_equal(values, np.arange(1000, dtype=np.float32) * 0.5)


def _holding_two(address, hold, q):
    try:
        with cip.subscribe(address) as sub:
            q.put(("ready",))
            frames = [sub.recv(timeout=60), sub.recv(timeout=60)]
            q.put(("holding", [f.slot for f in frames]))
            time.sleep(hold)
            for f in frames:
                f.release()
            q.put(("released",))
            time.sleep(3600)
    except BaseException:
        report_exception(q)


def test_pool_next_works_with_a_publisher_open(address, cp):
    with cip.IpcPool(2, 1 << 16) as pool, cip.Publisher(pool, address) as pub:
        q = SPAWN.Queue()
        proc = SPAWN.Process(target=_holding_two, args=(address, 1.0, q))
        proc.start()
        try:
            assert child_message(q)[0] == "ready"
            wait_subscribers(pub, 1)
            for _ in range(2):
                with pub.frame() as f:
                    f.publish(f.array((16,), cp.float32))
            assert child_message(q)[0] == "holding"
            assert pool.remote_leases(0) == pool.remote_leases(1) == 1
            with pytest.raises(cip.SlotBusyError, match="peer lease"):
                pool.next(timeout=0)
            t0 = time.monotonic()
            slot = pool.next(timeout=30)  # returns once the subscriber lets go
            waited = time.monotonic() - t0
            assert 0.5 < waited < 10, waited
            assert pool.remote_leases(slot) == 0 and pool.current == slot
            assert child_message(q)[0] == "released"
        finally:
            proc.kill()
            proc.join(30)
