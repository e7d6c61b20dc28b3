"""The subscriber's own host time per frame, without the GPU: SubscriberCore over a socket.

CPU only: no GPU is touched.  ``benchmarks/conftest.py`` skips every benchmark on
a machine without a VMM-capable GPU; to run these anywhere, leave it out::

    python -m pytest benchmarks/test_bench_subscriber_core.py -p no:cacheprovider --noconftest

One round is one frame through a hand-built publisher's end of a real
``SOCK_SEQPACKET`` connection: the publisher's end sends a FRAME, the
subscriber receives it and releases it, the publisher's end reads the RELEASE.
The baseline does the same with bare socket calls on a socket pair (the same
FRAME encoding, the RELEASE bytes built once), so the difference of medians in the
``subscriber-core`` group is the library's own host time per frame on the
subscriber side: the engine's receive with its hang-up check, rule 1, the
RELEASE behind those owed.  (The GPU subscriber adds the payload check and the
flag operations, measured on the device by ``test_bench_channel.py``.)
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from cupy_ipcpool.channel import _protocol as proto
from cupy_ipcpool.channel._subscriber_core import SubscriberCore

SLOTS = 4
PAYLOAD = bytes(64)  # about a one-array frame's payload


class _Publisher:
    """The publisher's end: answers one HELLO with a WELCOME, then does what the round says."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(1)
        self.conn: socket.socket | None = None
        self.thread = threading.Thread(target=self._accept)
        self.thread.start()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.recv(1 << 17)  # the HELLO
        conn.send(proto.encode_welcome(1, SLOTS, 0, credit=SLOTS))
        self.conn = conn

    def close(self) -> None:
        self.thread.join(10)
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


@pytest.fixture
def joined(tmp_path: Any) -> Iterator[tuple[SubscriberCore, socket.socket]]:
    publisher = _Publisher(os.path.join(tmp_path, "pub.sock"))
    core = SubscriberCore(os.path.join(tmp_path, "pub.sock"), credit=SLOTS)
    publisher.thread.join(10)
    assert publisher.conn is not None
    try:
        yield core, publisher.conn
    finally:
        core.close()
        publisher.close()


@pytest.mark.benchmark(group="subscriber-core")
def test_baseline_bare_socket_round(benchmark: Any) -> None:
    """A FRAME sent, received into a buffer, a RELEASE sent back and read: no library."""
    pub, sub = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    releases = [proto.encode_release(seq, seq % SLOTS) for seq in range(SLOTS)]
    buf = bytearray(proto.MAX_FRAME_SIZE + 1)
    state = {"seq": 0}

    def round_() -> None:
        seq = state["seq"]
        state["seq"] += 1
        i = seq % SLOTS
        pub.send(proto.encode_frame(seq, i, PAYLOAD))
        sub.recv_into(buf, len(buf), socket.MSG_DONTWAIT)
        sub.send(releases[i], socket.MSG_DONTWAIT)
        pub.recv(64)

    with pub, sub:
        benchmark(round_)


@pytest.mark.benchmark(group="subscriber-core")
def test_subscriber_core_round(
    benchmark: Any, joined: tuple[SubscriberCore, socket.socket]
) -> None:
    """The same round through SubscriberCore: ``recv_view(0)`` and ``release``."""
    core, pub = joined
    state = {"seq": 0}

    def round_() -> None:
        seq = state["seq"]
        state["seq"] += 1
        pub.send(proto.encode_frame(seq, seq % SLOTS, PAYLOAD))
        got_seq, slot, _payload = core.recv_view(0)
        core.release(got_seq, slot)
        pub.recv(64)

    benchmark(round_)
    assert core.held == {}
