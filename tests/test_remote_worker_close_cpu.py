"""A UCX worker closed while a receive's data is partway here gives back all it took.

UCX cannot cancel a tag receive that matched a rendezvous send, and UCXX keeps
such a request, and through it its worker (three epolls, an eventfd, sockets,
shared memory), until the request completes.  A worker dropped then, with no
one left to progress it, stayed for the life of the process: a subscriber
closed (BYE) while a frame was arriving lost its worker that way, which a
loaded machine made likely (``test_every_way_a_connection_ends_gives_everything_back``).
Here the interleaving is held, not raced: the receiving side stops exactly
while a frame is partway received.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import struct
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from skips import needs_ucx

from cupy_ipcpool.remote import _ucx as ucx
from tests._fds import open_fds

SECRET = "correct horse battery staple 42"
TAG = 42


def _worker_fds() -> Counter[str]:
    """This process's fds of the kinds a UCX worker (not an endpoint) owns, by kind."""
    gc.collect()
    kinds: Counter[str] = Counter()
    for target in open_fds().values():
        if target.startswith(("anon_inode:[eventpoll]", "anon_inode:[eventfd]", "/dev/shm/")):
            kinds[re.sub(r"[0-9a-f]{6,}", "*", target)] += 1
    return kinds


@contextlib.contextmanager
def _progressing(worker: ucx.Worker) -> Iterator[None]:
    """Progress ``worker`` on a thread meanwhile (as a server's loop does its own)."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            worker.progress()
            time.sleep(0.0005)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def _partway(dst: np.ndarray, value: int, req: Any) -> bool:
    return ucx.request_state(req) is None and bool((dst[:: 1 << 12] == value).any())


@needs_ucx
@pytest.mark.timeout(60)
def test_a_worker_closed_with_a_receive_partway_goes() -> None:
    n = 8 << 20
    sender = ucx.Worker(loopback_only=True)
    try:
        before = _worker_fds()
        receiver = ucx.Worker(loopback_only=True)
        assert _worker_fds() != before  # the kinds counted are the worker's own
        endpoint = sender.connect(receiver.address)
        src, dst = np.full(n, 7, np.uint8), np.zeros(n, np.uint8)
        recv = receiver.recv(dst, TAG)
        send = sender.send(endpoint, src, TAG)
        deadline = time.monotonic() + 30
        # One progress step each at a time: stop once the data started landing.
        while not _partway(dst, 7, recv):
            assert ucx.request_state(recv) is None, "the whole frame landed in one step"
            assert time.monotonic() < deadline, "the receive never started"
            sender._worker.progress_once()
            receiver._worker.progress_once()
        del recv  # its owner forgot it (a session abandoning its frames)
        with _progressing(sender):
            t0 = time.monotonic()
            receiver.close()
            took = time.monotonic() - t0
        assert _worker_fds() == before, f"the receiver's worker stayed ({took:.2f} s in close)"
        assert took < ucx.CLOSE_TIMEOUT  # it ended with its data, not at the bound
        assert ucx.request_state(send) is not None
        req = ucx.close_endpoint(endpoint)
        deadline = time.monotonic() + 10
        while req is not None and ucx.request_state(req) is None and time.monotonic() < deadline:
            sender.progress()
            time.sleep(0.001)
    finally:
        sender.close()


@needs_ucx
@pytest.mark.timeout(60)
def test_a_worker_closed_with_a_receive_that_matched_nothing_goes_at_once() -> None:
    worker = ucx.Worker(loopback_only=True)
    dst = np.zeros(1 << 20, np.uint8)
    assert worker.recv(dst, TAG) is not None
    t0 = time.monotonic()
    worker.close(timeout=0.2)  # nothing will come: it is cancelled once the bound passed
    assert time.monotonic() - t0 < 5.0


def _hold_partway(sub: Any, held: threading.Event) -> None:
    """Make ``sub``'s session thread stop (until closed) while a frame is partway received."""
    session = sub._session
    worker = session.worker
    progress = worker.progress

    def partway() -> bool:
        for p in list(session._pending.values()):
            for a, r in zip(p.arrays, p.requests, strict=True):
                if _partway(np.asarray(a).reshape(-1).view(np.uint8), 1, r):
                    return True
        return False

    def held_progress() -> None:
        if sub._stop or held.is_set():
            progress()
            return
        while worker._worker.progress_once():
            if partway():
                held.set()
                while not sub._stop:  # the thread is not scheduled again before close
                    time.sleep(0.001)
                return

    worker.progress = held_progress


@needs_ucx
@pytest.mark.timeout(120)
def test_a_subscriber_closed_while_a_frame_is_partway_gives_its_worker_back() -> None:
    from cupy_ipcpool.remote import HostChannelPublisher, serve, subscribe

    n = 16 << 20
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cam.sock")
        with (
            HostChannelPublisher(path, 2, n) as pub,
            serve(path, memory="host", listen="127.0.0.1:0", secret=SECRET) as server,
        ):
            before = _worker_fds()
            held = threading.Event()
            sub = subscribe(server.address, secret=SECRET, memory="host", slots=1)
            try:
                _hold_partway(sub, held)
                deadline = time.monotonic() + 20
                while not server.subscribers:
                    assert time.monotonic() < deadline
                    time.sleep(0.005)
                arr = np.full(n, 1, np.uint8)
                pub.send(arr, metadata=struct.pack("<Q", 0), timeout=10)
                assert held.wait(30), "the frame never was partway received"
            finally:
                sub.close()
            deadline = time.monotonic() + 20
            while server.subscribers or any(pub.leases(s) for s in range(pub.num_slots)):
                leases = [pub.leases(s) for s in range(pub.num_slots)]
                assert time.monotonic() < deadline, (
                    f"the server kept the subscriber: {len(server.subscribers)} subscribers, "
                    f"leases {leases} (a send into a worker that no one progresses)"
                )
                pub.poll(0.01)
            assert _worker_fds() == before, "the subscriber's UCX worker stayed"
