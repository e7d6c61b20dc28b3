"""GPU tier of issue 10: an honest subscriber joins a real-slot Publisher under attack.

The CPU tier (``test_hardening.py``) runs every attack against the session core
with memfd slots; this runs the join-under-attack check against
:class:`cupy_ipcpool.Publisher` with real VMM slots and the sync page, whose
rows are the resource the attacks used to leak.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import struct
import tempfile
import time

import numpy as np
import pytest

import cupy_ipcpool as cip
from cupy_ipcpool.channel import _protocol as proto
from tests._stop import sigstop
from tests.gpu_helpers import child_message, report_exception

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

SPAWN = mp.get_context("spawn")
SEQ = struct.Struct("<Q")
NOBODY = 65534


def _drop_to(uid):
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _idle(address, n):
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        with contextlib.suppress(OSError):
            s.connect(address)
        out.append(s)
    return out


def _hello_and_hang_up(address, n):
    hello = proto.encode_hello(proto.MODE_BLOCK, 4, os.getpid())
    for i in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(address)
            s.send(hello)
            if i % 2:
                s.shutdown(socket.SHUT_RD)
        except OSError:
            pass
        finally:
            s.close()


def _nobody_idle(address, n, q):
    """As uid 65534 (when we are root): hold ``n`` idle connections until told to stop."""
    try:
        if os.geteuid() == 0:
            _drop_to(NOBODY)
        socks = _idle(address, n)
        q.put(("ready", len(socks)))
        time.sleep(60)
    except BaseException:
        report_exception(q)


def _honest_consumer(address, frames, q):
    try:
        import cupy as cp

        (cp.arange(4, dtype=cp.uint32) * 2).get()  # load the kernel module before joining
        t0 = time.monotonic()
        with cip.subscribe(address, timeout=10) as sub:
            joined = time.monotonic() - t0
            q.put(("joined", joined))
            bad = 0
            for _ in range(frames):
                frame = sub.recv(timeout=30)
                (seq,) = SEQ.unpack(frame.metadata)
                if not (cp.asnumpy(frame.array) == np.uint32(seq & 0xFFFFFFFF)).all():
                    bad += 1
                frame.release()
        q.put(("done", joined, bad))
    except BaseException:
        report_exception(q)


def test_honest_join_under_attack_with_real_slots():
    import cupy as cp

    public = tempfile.mkdtemp(prefix="ipcpool-hardening-gpu-", dir="/tmp")
    os.chmod(public, 0o1777)
    address = os.path.join(public, "chan.sock")
    procs = []
    idle = []
    try:
        with (
            cip.IpcPool(4, 1 << 20) as pool,
            cip.Publisher(pool, address, allowed_uids={os.geteuid(), NOBODY}) as pub,
        ):
            q_nobody = SPAWN.Queue()
            p = SPAWN.Process(target=_nobody_idle, args=(address, 50, q_nobody), daemon=True)
            p.start()
            procs.append(p)
            assert child_message(q_nobody)[0] == "ready"
            _hello_and_hang_up(address, 200)  # more than the 64 rows of the sync page
            for _ in range(20):  # subscribers that give up during the handshake
                with contextlib.suppress(OSError):
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    s.connect(address)
                    s.send(proto.encode_hello(proto.MODE_LATEST, 1, os.getpid()))
                    s.close()
            idle = _idle(address, 50)
            for _ in range(20):
                pub.poll(0.01)  # adopt and drop what hung up

            q = SPAWN.Queue()
            consumer = SPAWN.Process(target=_honest_consumer, args=(address, 5, q))
            consumer.start()
            procs.append(consumer)
            seq = 0
            result = None
            deadline = time.monotonic() + 120
            while result is None:
                assert time.monotonic() < deadline, "the honest consumer did not finish"
                if pub.subscribers:
                    with pub.frame(timeout=30) as f:
                        a = f.array((1 << 16,), cp.uint32)
                        a.fill(seq & 0xFFFFFFFF)
                        f.publish(a, metadata=SEQ.pack(seq))
                    del a
                    seq += 1
                pub.poll(0.01)
                with contextlib.suppress(Exception):
                    msg = q.get_nowait()
                    if msg[0] == "error":
                        pytest.fail(f"consumer raised {msg[1]}: {msg[2]}\n{msg[3]}")
                    if msg[0] == "done":
                        result = msg
            _, joined, bad = result
            assert joined < 1.0, f"the honest join took {joined:.3f} s under attack"
            assert bad == 0
            consumer.join(30)
    finally:
        for s in idle:
            s.close()
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        _remove_dir(public)


def _remove_dir(path):
    """Remove ``path`` and the files in it, as far as it can (errors are ignored)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        os.rmdir(path)


def _victim(address, rounds, spin_us, q):
    """Each round: subscribe, say so, call recv (waiting) until it raises; report each call:
    ("frame", seq, whether the array held frame seq's value) or ("raised", type name)."""
    try:
        import cupy as cp

        (cp.arange(4, dtype=cp.uint32) * 2).get()
        for _ in range(rounds):
            with cip.subscribe(address, timeout=10, spin_us=spin_us) as sub:
                q.put(("waiting", sub.producer_pid))
                calls = []
                for _call in range(3):
                    try:
                        frame = sub.recv(timeout=60)
                    except cip.EndOfStream as exc:
                        calls.append(("raised", type(exc).__name__))
                        break
                    (seq,) = SEQ.unpack(frame.metadata)
                    host = cp.asnumpy(frame.array)
                    calls.append(("frame", seq, bool((host == np.uint32(seq)).all())))
                q.put(("calls", calls))
        q.put(("done",))
    except BaseException:
        report_exception(q)


@pytest.mark.parametrize("spin_us", [0, 200], ids=["sleeping", "spinning"])
def test_stopped_subscriber_never_gets_a_frame_whose_slot_was_reused(spin_us):
    """SIGSTOP a subscriber that waits in recv, send it a frame (queued in its socket), let
    ``lease_timeout`` evict it, rewrite every slot with new data, SIGCONT: its recv raises
    EvictedError and hands out no frame."""
    import cupy as cp

    rounds = 3
    tmp = tempfile.mkdtemp(prefix="ipcpool-evict-gpu-", dir="/tmp")
    address = os.path.join(tmp, "chan.sock")
    q = SPAWN.Queue()
    victim = SPAWN.Process(target=_victim, args=(address, rounds, spin_us, q), daemon=True)
    try:
        with (
            cip.IpcPool(4, 1 << 20) as pool,
            cip.Publisher(pool, address, lease_timeout=0.3) as pub,
        ):
            victim.start()
            seq = 0

            def publish():
                nonlocal seq
                with pub.frame(timeout=30) as f:
                    a = f.array((1 << 16,), cp.uint32)
                    a.fill(seq)
                    f.publish(a, metadata=SEQ.pack(seq))
                del a
                cp.cuda.get_current_stream().synchronize()
                seq += 1

            for n in range(rounds):
                assert child_message(q)[0] == "waiting"
                deadline = time.monotonic() + 30
                while not pub.subscribers:
                    assert time.monotonic() < deadline, "the victim was not adopted"
                    pub.poll(0.01)
                time.sleep(0.05)  # it waits in recv by now
                sigstop(victim.pid)
                try:
                    deadline = time.monotonic() + 10
                    # queued in its socket while it is stopped (a frame it had taken before
                    # the stop would be its own, held past the lease timeout: EvictedError's
                    # "the frames it holds may be overwritten")
                    publish()
                    while pub.evictions == n:
                        assert time.monotonic() < deadline, "the victim was not evicted"
                        pub.poll(0.05)
                    for _ in range(2 * pool.num_slots):  # every slot, new data
                        publish()
                finally:
                    os.kill(victim.pid, signal.SIGCONT)
                calls = child_message(q)[1]
                assert calls[-1] == ("raised", "EvictedError"), calls
                frames = [c for c in calls if c[0] == "frame"]
                assert not frames, f"a frame queued before the eviction was handed out: {calls}"
            assert child_message(q)[0] == "done"
            assert pub.evictions == rounds
            victim.join(30)
    finally:
        if victim.is_alive():
            os.kill(victim.pid, signal.SIGCONT)
            victim.kill()
        victim.join(10)
        _remove_dir(tmp)
