"""Host receive rings are committed when made: no frame pays for faulting in fresh pages.

At 256 MiB a first lap of frames into untouched memfd slots cost more than
the UCX transfer itself (docs/performance.md, "The remote tier"); these tests
read the kernel's resident-set count of each slot mapping (``/proc/self/smaps``)
before anything was written or received.
"""

from __future__ import annotations

import os
import tempfile

from cupy_ipcpool.remote import HostChannelPublisher, HostChannelSubscriber, HostSlots

MiB = 1 << 20
SLOT = 8 * MiB


def _slot_mappings_kib() -> list[tuple[str, int]]:
    """(mapping name, resident KiB) of every mapping of a remote host slot in this process."""
    out: list[tuple[str, int]] = []
    name: str | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
                path = fields[5] if len(fields) > 5 else ""
                name = path if path.startswith("/memfd:ipcpool-remote") else None
            elif name is not None and fields[0] == "Rss:":
                out.append((name, int(fields[1])))
    return out


def test_host_slots_are_resident_before_the_first_frame() -> None:
    slots = HostSlots(2, SLOT)
    try:
        mapped = _slot_mappings_kib()
        assert sorted(n for n, _ in mapped) == ["/memfd:ipcpool-remote0", "/memfd:ipcpool-remote1"]
        assert [kib for _, kib in mapped] == [SLOT // 1024] * 2
    finally:
        slots.close()
    assert _slot_mappings_kib() == []


def test_a_host_channel_subscriber_maps_the_ring_resident() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "host.sock")
        with HostChannelPublisher(path, 2, SLOT) as pub, HostChannelSubscriber(path) as sub:
            pub.poll(0.0)
            assert sub.num_slots == 2
            mapped = _slot_mappings_kib()
            # the publisher's two slots and the subscriber's two maps of them
            assert len(mapped) == 4
            assert [kib for _, kib in mapped] == [SLOT // 1024] * 4
