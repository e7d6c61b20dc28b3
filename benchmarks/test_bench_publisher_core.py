"""The publisher's own host time per frame, without the GPU: PublisherCore over a socket.

CPU only: no GPU is touched.  ``benchmarks/conftest.py`` skips every benchmark on
a machine without a VMM-capable GPU; to run these anywhere, leave it out::

    python -m pytest benchmarks/test_bench_publisher_core.py -p no:cacheprovider --noconftest

One round is one frame to one ``"block"`` subscriber, whose end of the real
``SOCK_SEQPACKET`` connection is bare socket calls: the publisher acquires a
slot (reading the RELEASEs that came), publishes the frame, the subscriber's
end receives it and sends its RELEASE.  The baseline does the same with bare
socket calls on a socket pair (the same FRAME encoding and subscriber's end),
so the difference of
medians in the ``publisher-core`` group is the library's own host time per
frame on the publisher side: the RELEASE read and admitted, the lease book,
the FRAME's send.  (The GPU publisher adds the slot token and the flag
operations, measured on the device by ``test_bench_channel.py``.)
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from cupy_ipcpool.channel import _protocol as proto
from cupy_ipcpool.channel._publisher_core import PublisherCore

SLOTS = 4
PAYLOAD = bytes(64)  # about a one-array frame's payload


def _subscriber_end(sub: socket.socket) -> None:
    """The subscriber's end of a round, the same in both: the FRAME in, its RELEASE out."""
    frame = proto.decode(sub.recv(1 << 16))
    assert isinstance(frame, proto.Frame)
    sub.send(proto.encode_release(frame.seq, frame.slot))


@pytest.fixture
def joined(tmp_path: Any) -> Iterator[tuple[PublisherCore, socket.socket]]:
    address = os.path.join(tmp_path, "pub.sock")
    core = PublisherCore(address, SLOTS, welcome=lambda _info: (b"", []))
    sub = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sub.connect(address)
        sub.send(proto.encode_hello(proto.MODE_BLOCK, SLOTS, os.getpid()))
        while not core.subscribers:
            core.poll(0.01)
        assert isinstance(proto.decode(sub.recv(1 << 16)), proto.Welcome)
        yield core, sub
    finally:
        sub.close()
        core.close()


@pytest.mark.benchmark(group="publisher-core")
def test_baseline_bare_socket_round(benchmark: Any) -> None:
    """A FRAME sent, the subscriber's end as below, the RELEASE read: no library."""
    pub, sub = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    state = {"seq": 0}

    def round_() -> None:
        seq = state["seq"]
        state["seq"] += 1
        pub.send(proto.encode_frame(seq, seq % SLOTS, PAYLOAD))
        _subscriber_end(sub)
        pub.recv(64)

    with pub, sub:
        benchmark(round_)


@pytest.mark.benchmark(group="publisher-core")
def test_publisher_core_round(benchmark: Any, joined: tuple[PublisherCore, socket.socket]) -> None:
    """The same round through PublisherCore: ``acquire`` and ``publish``."""
    core, sub = joined

    def round_() -> None:
        slot, _readers = core.acquire(1.0)
        core.publish(slot, PAYLOAD)
        _subscriber_end(sub)  # its RELEASE is read by the next acquire

    benchmark(round_)
