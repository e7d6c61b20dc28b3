"""GPU tier: attach and subscribe from another PID and mount namespace, two uids.

The consumer runs under ``unshare --pid --fork --mount-proc`` (pid 1 of its
own PID namespace, its own mount namespace; the socket directory is shared),
as this test's uid or dropped to uid 65534 (no capabilities).  It attaches a
real :class:`IpcPool` from its descriptor, passed as bytes (``transport``
left at ``"auto"``), and subscribes to a real :class:`Publisher`; every byte
it reads is checked against what the producer wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _namespaces import (
    CHECKOUT,
    CONSUMER_HEAD,
    DROP_UID,
    NOBODY,
    UNSHARE,
    shared_socket_dir,
    unshare_skip_reason,
)

import cupy_ipcpool as cip
from tests.gpu_helpers import fill

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

CHILD_TIMEOUT_S = 90
SLOTS = 3
SLOT_NBYTES = 1 << 20
FRAMES = 40

#: The consumer.  Imports first (the interpreter may live in root's 0700 home), then
#: drops to the uid asked for; every CUDA call and every fd fetch runs as that uid.
CHILD = (
    CONSUMER_HEAD
    + r"""    import numpy as np
    import cupy as cp
    import cupy_ipcpool as cip
    from cupy_ipcpool import _driver
    from tests.gpu_helpers import expected  # what fill() wrote
"""
    + DROP_UID
    + r"""    try:
        _driver.require_vmm_device(0)
    except Exception as exc:
        out["no_gpu"] = f"{type(exc).__name__}: {exc}"
        raise SystemExit
    desc = cip.PoolDescriptor.from_bytes(bytes.fromhex(args["desc"]))
    bad = []
    with cip.attach(desc) as peer:
        n = peer.slot_nbytes // 4
        for slot in range(peer.num_slots):
            a = peer.array(cip.ArrayHandle.contiguous(slot, 0, (n,), np.uint32))
            if not np.array_equal(cp.asnumpy(a), expected(n, 1000 + slot)):
                bad.append(slot)
            del a
    out["attach_bad_slots"] = bad
    seqs, wrong = [], []
    with cip.subscribe(args["address"], allowed_uids={args["publisher_uid"]}, timeout=30) as sub:
        for _ in range(args["frames"]):
            with sub.recv(timeout=30) as frame:
                seq = int.from_bytes(frame.metadata, "little")
                got = cp.asnumpy(frame.array)
                if not np.array_equal(got, expected(got.size, seq)):
                    wrong.append(seq)
                seqs.append(seq)
    cp.cuda.Device(0).synchronize()
    out["seqs"], out["wrong_frames"] = seqs, wrong
except SystemExit:
    pass
except BaseException as exc:
    import traceback
    out["crash"] = traceback.format_exc()
print(json.dumps(out), flush=True)
"""
)


@pytest.fixture
def shared_dir() -> Iterator[str]:
    """The socket directory both namespaces see, traversable by uid 65534."""
    with shared_socket_dir("ipcpool-ns-gpu-") as path:
        yield path


def _report(out: str, err: str) -> dict[str, Any]:
    """The consumer's report; skips where its uid cannot use the GPU here."""
    lines = out.strip().splitlines()
    assert lines, f"the consumer printed no report: {err}"
    report: dict[str, Any] = json.loads(lines[-1])
    if "no_gpu" in report:
        pytest.skip(f"uid {report.get('uid')} cannot use the GPU here: {report['no_gpu']}")
    assert "crash" not in report, report["crash"]
    return report


def _wait_subscribers(pub: Any, n: int, proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(pub.subscribers) < n:
        pub.poll(0.05)
        if proc.poll() is not None:
            out, err = proc.communicate()
            _report(out, err)  # skips, or names the crash
            pytest.fail(f"the consumer ended before subscribing: {out} {err}")
        assert time.monotonic() < deadline, "the consumer did not subscribe in time"


@pytest.mark.parametrize("uid", [None, NOBODY], ids=["same-uid", "uid-65534"])
def test_attach_and_subscribe_from_another_pid_and_mount_namespace(
    shared_dir: str, uid: int | None
) -> None:
    import cupy as cp

    reason = unshare_skip_reason(CHILD_TIMEOUT_S, needs_root=True)
    if reason is not None:
        pytest.skip(reason)
    allowed = {os.geteuid(), NOBODY}  # the publisher allows exactly these
    pool_path = os.path.join(shared_dir, "pool.sock")
    address = os.path.join(shared_dir, "chan.sock")
    with (
        cip.IpcPool(SLOTS, SLOT_NBYTES, socket_path=pool_path, allowed_uids=allowed) as pool,
        cip.IpcPool(4, 1 << 16) as ring,
        cip.Publisher(ring, address, allowed_uids=allowed) as pub,
    ):
        for slot in range(SLOTS):
            fill(pool.array(dtype=np.uint32, slot=slot), 1000 + slot)
        cp.cuda.Device(0).synchronize()
        desc = pool.descriptor()  # "auto": pidfd offered, and the socket at pool_path
        assert desc.socket_path == pool_path and desc.exporter_pid != 1
        args = {
            "desc": desc.to_bytes().hex(),
            "uid": uid,
            "address": address,
            "publisher_uid": os.geteuid(),
            "frames": FRAMES,
        }
        env = {**os.environ, "PYTHONPATH": CHECKOUT}
        proc = subprocess.Popen(
            [*UNSHARE, sys.executable, "-c", CHILD, json.dumps(args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd="/",
        )
        try:
            _wait_subscribers(pub, 1, proc, CHILD_TIMEOUT_S)
            for seq in range(FRAMES):
                with pub.frame(timeout=30) as f:
                    a = f.array((1 << 14,), cp.uint32)
                    fill(a, seq)
                    f.publish(a, metadata=seq.to_bytes(8, "little"))
                del a
            out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, err
    report = _report(out, err)
    assert report["pid"] == 1 and report["pid_namespace"] != os.stat("/proc/self/ns/pid").st_ino
    if uid is not None:
        assert report["uid"] == uid and int(report["cap_eff"], 16) == 0
    assert report["attach_bad_slots"] == []
    assert report["seqs"] == list(range(FRAMES))
    assert report["wrong_frames"] == []
