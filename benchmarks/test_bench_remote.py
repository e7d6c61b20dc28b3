"""The ``remote`` lane: frames through the remote channel beside raw UCXX and a TCP socket.

One run of :mod:`cupy_ipcpool._bench.remote` per memory kind; the table (frames/s,
GB/s, ratio to raw UCXX on the same transport) is printed and recorded.  The
target (channel >= 0.9x raw UCXX) is reported, not asserted: it depends on the
transport (``UCX_TLS``) and the machine.
"""

from __future__ import annotations

import os

import pytest
from conftest import record_value

from cupy_ipcpool._bench import remote
from cupy_ipcpool.remote import available

pytestmark = pytest.mark.skipif(
    available() is not None, reason="the remote extra (UCXX) is not installed"
)


@pytest.mark.parametrize("memory", ["host", "device"])
def test_remote_lane(memory: str) -> None:
    if memory == "device":
        try:
            from cupy_ipcpool import _driver

            _driver.require_vmm_device(0)
        except Exception as exc:
            pytest.skip(f"no GPU: {exc}")
    mib = os.environ.get("REMOTE_SIZES", "1,64,256").split(",")
    sizes = tuple(int(s) * remote.MiB for s in mib)
    results = remote.run(sizes, memory=memory, repeats=int(os.environ.get("REMOTE_REPEATS", "3")))
    table = remote.report(results)
    print(f"\nremote lane, memory={memory}, UCX_TLS={os.environ.get('UCX_TLS', '(default)')}")
    print(table)
    raw = {r.nbytes: r.gbps for r in results if r.lane == "ucxx"}
    for r in results:
        mib = r.nbytes // remote.MiB
        # seconds per frame, so that the summary lists every lane beside the others
        record_value(f"remote_{memory}_{r.lane}_{mib}MiB", r.seconds / r.frames)
        if r.lane == "channel":
            ratio = r.gbps / raw[r.nbytes]
            print(f"channel/raw at {mib} MiB: {ratio:.2f}x (target >= 0.9x)")
