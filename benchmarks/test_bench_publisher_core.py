"""The publisher's own host time per frame, without the GPU: PublisherCore over a socket.

CPU only: no GPU is touched.  ``benchmarks/conftest.py`` skips every benchmark on
a machine without a VMM-capable GPU; to run these anywhere, leave it out::

    python -m pytest benchmarks/test_bench_publisher_core.py -p no:cacheprovider --noconftest

One round is one frame to each of 1 or 8 ``"block"`` subscribers (``[1sub]``,
``[8sub]``), whose ends of the real ``SOCK_SEQPACKET`` connections are bare
socket calls: the publisher acquires a slot (reading the RELEASEs that came),
publishes the frame, each subscriber's end receives it and sends its RELEASE.
The baseline does the same with bare socket calls on socket pairs (the same
FRAME encoding and subscribers' ends), so the difference of medians of the same
fan-out in the ``publisher-core`` group is the library's own host time per
frame on the publisher side: the RELEASEs read and admitted, the lease book,
the FRAMEs' sends.  (The GPU publisher adds the slot token and the flag
operations, measured on the device by ``test_bench_channel.py``.)
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from cupy_ipcpool.channel import _protocol as proto
from cupy_ipcpool.channel._handshake import Welcome
from cupy_ipcpool.channel._publisher_core import PublisherCore

SLOTS = 4
PAYLOAD = bytes(64)  # about a one-array frame's payload


def _subscriber_end(sub: socket.socket) -> None:
    """The subscriber's end of a round, the same in both: the FRAME in, its RELEASE out."""
    frame = proto.decode(sub.recv(1 << 16))
    assert isinstance(frame, proto.Frame)
    sub.send(proto.encode_release(frame.seq, frame.slot))


#: Subscribers of a round: one, and a fan-out (the wire sends one FRAME to each).
FANS = [1, 8]


@pytest.fixture(params=FANS, ids=lambda n: f"{n}sub")
def joined(request: Any, tmp_path: Any) -> Iterator[tuple[PublisherCore, list[socket.socket]]]:
    address = os.path.join(tmp_path, "pub.sock")
    core = PublisherCore(address, SLOTS, welcome=Welcome())
    subs: list[socket.socket] = []
    try:
        for _ in range(request.param):
            sub = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            subs.append(sub)
            sub.connect(address)
            sub.send(proto.encode_hello(proto.MODE_BLOCK, SLOTS, os.getpid()))
            assert isinstance(proto.decode(sub.recv(1 << 16)), proto.Welcome)
        while len(core.subscribers) < len(subs):
            core.poll(0.01)
        yield core, subs
    finally:
        for sub in subs:
            sub.close()
        core.close()


@pytest.mark.benchmark(group="publisher-core")
@pytest.mark.parametrize("fan", FANS, ids=lambda n: f"{n}sub")
def test_baseline_bare_socket_round(benchmark: Any, fan: int) -> None:
    """A FRAME sent to each subscriber, each one's end as below, the RELEASEs read: no
    library."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(fan)]
    state = {"seq": 0}

    def round_() -> None:
        seq = state["seq"]
        state["seq"] += 1
        msg = proto.encode_frame(seq, seq % SLOTS, PAYLOAD)
        for pub, _sub in pairs:
            pub.send(msg)
        for _pub, sub in pairs:
            _subscriber_end(sub)
        for pub, _sub in pairs:
            pub.recv(64)

    try:
        benchmark(round_)
    finally:
        for pub, sub in pairs:
            pub.close()
            sub.close()


@pytest.mark.benchmark(group="publisher-core")
def test_publisher_core_round(
    benchmark: Any, joined: tuple[PublisherCore, list[socket.socket]]
) -> None:
    """The same round through PublisherCore: ``acquire`` and ``publish``."""
    core, subs = joined

    def round_() -> None:
        slot, _readers = core.acquire(1.0)
        core.publish(slot, PAYLOAD)
        for sub in subs:
            _subscriber_end(sub)  # its RELEASE is read by the next acquire

    benchmark(round_)
