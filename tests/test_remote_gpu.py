"""GPU tier of the remote layer: a real IpcPool + Publisher served over UCX, received on a GPU.

Run on the GPU machine with the remote extra installed.  Most tests force UCX
onto TCP (plus ``cuda_copy`` for device buffers) so that they exercise the
network path even between two processes of one machine; those named for the
default transports leave ``UCX_TLS`` unset, so that UCX picks ``cuda_ipc`` and
the frames are staged (remote/_staging.py)::

    python -m pytest tests/test_remote_gpu.py

Every frame's bytes are verified on the receiving GPU (a fill kernel's
pattern, compared by a reduction on the device).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import struct
import time

import pytest

from tests.gpu_helpers import child_message, fill, report_exception

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

SPAWN = mp.get_context("spawn")
SEQ = struct.Struct("<Q")
SECRET = "gpu-tier-secret-0123456789abcdef"
ELEMS = (4 << 20) // 4  # 4 MiB frames of uint32

ucx_reason = None
try:
    from cupy_ipcpool.remote import _ucx

    ucx_reason = _ucx.available()
except Exception as exc:  # pragma: no cover
    ucx_reason = str(exc)
needs_ucx = pytest.mark.skipif(ucx_reason is not None, reason=f"remote extra: {ucx_reason}")


#: ``tls`` of UCX's own choice (``UCX_TLS`` unset): ``cuda_ipc`` between processes of one machine
DEFAULT = "default"


def _env(tls: str) -> None:
    if tls == DEFAULT:
        os.environ.pop("UCX_TLS", None)
    else:
        os.environ.setdefault("UCX_TLS", tls)


def _expected_ok(array, seq: int) -> bool:
    """True when ``array`` (uint32, on the GPU) holds fill(seed=seq); checked on the device."""
    import cupy as cp

    want = cp.uint32(seq) * cp.uint32(2654435761) + cp.arange(array.size, dtype=cp.uint32)
    return bool((array == want).all())


def producer(address: str, frames: int, device: int, tls: str, q, go=None) -> None:
    """Publish ``frames`` frames from an IpcPool on ``device`` and serve them over UCX.

    Publishing starts when a remote subscriber joined (and ``go`` is set, if given).
    """
    try:
        _env(tls)
        import cupy as cp

        import cupy_ipcpool as cip
        from cupy_ipcpool.remote import serve

        cp.cuda.Device(device).use()
        with (
            cip.IpcPool(6, ELEMS * 4, device=device) as pool,
            cip.Publisher(pool, address) as pub,
        ):
            server = serve(address, listen="127.0.0.1:0", secret=SECRET, device=device)
            q.put(("addr", server.address))
            deadline = time.monotonic() + 60
            while not server.subscribers and time.monotonic() < deadline:
                pub.poll(0.01)
            q.put(("local", [s.local for s in server.subscribers]))
            while go is not None and not go.wait(0.01):
                pub.poll(0.0)
            for seq in range(frames):
                with pub.frame(timeout=60) as f:
                    a = f.array((ELEMS,), "uint32")
                    fill(a, seq)
                    f.publish(a, metadata=SEQ.pack(seq))
                pub.poll(0.0)
            q.put(("published", frames))
            deadline = time.monotonic() + 120
            while server.subscribers and time.monotonic() < deadline:  # until they leave
                pub.poll(0.05)
            server.close()
        q.put(("done",))
    except BaseException:
        report_exception(q)


def consumer(address: str, frames: int, device: int, tls: str, mode: str, q) -> None:
    """Receive ``frames`` frames on ``device``; verify every byte on that GPU."""
    try:
        _env(tls)
        import cupy as cp

        from cupy_ipcpool.remote import subscribe

        cp.cuda.Device(device).use()
        bad = []
        seqs = []
        with subscribe(address, secret=SECRET, device=device, mode=mode, slots=3) as sub:
            for _ in range(frames):
                with sub.recv(timeout=60) as f:
                    (seq,) = SEQ.unpack(f.metadata)
                    assert f.seq == seq
                    assert f.array.device.id == device
                    if not _expected_ok(f.array, seq):
                        bad.append(seq)
                    seqs.append(seq)
            staged = sub.staged
        q.put(("ok", seqs, bad, staged))
    except BaseException:
        report_exception(q)


def consumer_reading_late(address: str, frames: int, device: int, tls: str, mode: str, q) -> None:
    """Receive ``frames`` frames into a ring of one slot; read each on a stream only after
    a 20 ms spin there, releasing it on that stream at once: each copy must still hold
    its own frame (the next frame may land in the slot only once the copy has run)."""
    try:
        _env(tls)
        import cupy as cp

        from cupy_ipcpool.remote import subscribe
        from tests.gpu_helpers import spin_kernel

        cp.cuda.Device(device).use()
        spin = spin_kernel("spin_fill")
        scratch = cp.zeros(32, dtype=cp.uint32)
        cycles = cp.int64(20 * 2_000_000)  # about 20 ms at 2 GHz
        stream = cp.cuda.Stream(non_blocking=True)
        copies = []
        seqs = []
        with subscribe(address, secret=SECRET, device=device, mode=mode, slots=1) as sub:
            for _ in range(frames):
                f = sub.recv(timeout=60)
                (seq,) = SEQ.unpack(f.metadata)
                with stream:
                    spin((1,), (32,), (scratch, cp.uint64(32), cp.uint32(0), cycles))
                    copies.append(f.array.copy())
                f.release(stream=stream)
                seqs.append(seq)
            stream.synchronize()
            bad = [seq for seq, c in zip(seqs, copies, strict=True) if not _expected_ok(c, seq)]
            staged = sub.staged
        q.put(("ok", seqs, bad, staged))
    except BaseException:
        report_exception(q)


def _run_pair(
    tmp_path,
    *,
    frames: int,
    pdev: int,
    cdev: int,
    tls: str,
    mode: str = "block",
    receive=consumer,
):
    address = str(tmp_path / "remote.sock")
    pq, cq = SPAWN.Queue(), SPAWN.Queue()
    prod = SPAWN.Process(target=producer, args=(address, frames, pdev, tls, pq))
    prod.start()
    try:
        kind, remote = child_message(pq, 180)
        assert kind == "addr"
        cons = SPAWN.Process(target=receive, args=(remote, frames, cdev, tls, mode, cq))
        cons.start()
        try:
            kind, local = child_message(pq, 180)
            assert kind == "local"
            _ok, seqs, bad, staged = child_message(cq, 180)
        finally:
            cons.join(60)
        return seqs, bad, local, staged
    finally:
        prod.join(60)
        if prod.is_alive():
            prod.kill()


@needs_ucx
def test_tcp_between_two_processes_every_byte(tmp_path) -> None:
    seqs, bad, local, staged = _run_pair(tmp_path, frames=40, pdev=0, cdev=0, tls="tcp,cuda_copy")
    assert seqs == list(range(40))
    assert bad == []
    # transports without cuda_ipc take the slots as they are: nothing is staged
    assert local == [False] and staged is False


@needs_ucx
def test_default_transports_stage_every_byte_through_cuda_ipc(tmp_path) -> None:
    """UCX's own transports between two processes of one machine pick cuda_ipc, which
    cannot export an IpcPool's slots: both sides stage each frame (remote/_staging.py),
    and every byte arrives."""
    seqs, bad, local, staged = _run_pair(tmp_path, frames=40, pdev=0, cdev=0, tls=DEFAULT)
    assert seqs == list(range(40))
    assert bad == []
    assert local == [True] and staged is True


@needs_ucx
@pytest.mark.parametrize("tls", [DEFAULT, "tcp,cuda_copy"])
def test_a_slot_released_on_a_stream_is_not_refilled_before_that_stream_read_it(
    tmp_path, tls
) -> None:
    """A frame released on a stream with work still queued on it keeps its slot until
    that work has run, whichever path the frames take (staged or not)."""
    seqs, bad, _local, _staged = _run_pair(
        tmp_path, frames=8, pdev=0, cdev=0, tls=tls, receive=consumer_reading_late
    )
    assert seqs == list(range(8))
    assert bad == [], f"frames read after the next one overwrote them: {bad}"


@needs_ucx
@pytest.mark.multigpu
def test_two_gpus_cuda_ipc_allowed(tmp_path) -> None:
    import cupy as cp

    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    seqs, bad, local, staged = _run_pair(
        tmp_path, frames=40, pdev=0, cdev=1, tls="tcp,cuda_copy,cuda_ipc"
    )
    assert seqs == list(range(40)) and bad == []
    assert local == [True] and staged is True


def local_reader(address: str, frames: int, device: int, q) -> None:
    """A local subscriber of the relay: verify every frame it gets on the GPU."""
    try:
        import cupy as cp

        import cupy_ipcpool as cip

        cp.cuda.Device(device).use()
        seqs, bad = [], []
        with cip.subscribe(address, device=device) as sub:
            q.put(("joined",))
            for _ in range(frames):
                with sub.recv(timeout=60) as f:
                    (seq,) = SEQ.unpack(f.metadata)
                    cp.cuda.get_current_stream().synchronize()
                    if not _expected_ok(f.array, seq):
                        bad.append(seq)
                    seqs.append(seq)
        q.put(("ok", seqs, bad))
    except BaseException:
        report_exception(q)


@needs_ucx
@pytest.mark.parametrize("tls", ["tcp,cuda_copy", DEFAULT])
def test_relay_feeds_two_local_subscribers(tmp_path, monkeypatch, tls) -> None:
    if tls == DEFAULT:
        monkeypatch.delenv("UCX_TLS", raising=False)
    else:
        monkeypatch.setenv("UCX_TLS", tls)
    from cupy_ipcpool.remote import Relay

    frames = 20
    address = str(tmp_path / "remote.sock")
    local = str(tmp_path / "relay.sock")
    pq, go = SPAWN.Queue(), SPAWN.Event()
    prod = SPAWN.Process(target=producer, args=(address, frames, 0, tls, pq, go))
    prod.start()
    readers = []
    try:
        _kind, remote = child_message(pq, 180)
        relay = Relay(remote, local, secret=SECRET, memory="device", device=0, slots=4)
        try:
            for _ in range(2):
                q = SPAWN.Queue()
                p = SPAWN.Process(target=local_reader, args=(local, frames, 0, q))
                p.start()
                readers.append((p, q))
            for _p, q in readers:
                assert child_message(q, 180)[0] == "joined"
            deadline = time.monotonic() + 60
            while len(relay.subscribers) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(relay.subscribers) == 2
            assert child_message(pq, 180) == ("local", [tls == DEFAULT])
            go.set()  # both local readers are in: publish
            for _p, q in readers:
                _ok, seqs, bad = child_message(q, 180)
                assert bad == []
                assert seqs == list(range(frames))  # every frame, in order, to both
            assert relay.relayed == frames
            assert relay.staged is (tls == DEFAULT)
        finally:
            relay.close()
    finally:
        for p, _q in readers:
            p.join(30)
        prod.join(60)
        if prod.is_alive():
            prod.kill()
