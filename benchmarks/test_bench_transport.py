"""Fetching a pool's fds without the GPU: the fd server and pidfd_getfd, beside bare calls.

CPU only: no GPU is touched.  ``benchmarks/conftest.py`` skips every benchmark on
a machine without a VMM-capable GPU; to run these anywhere, leave it out::

    python -m pytest benchmarks/test_bench_transport.py -p no:cacheprovider --noconftest

One round fetches N memfds (8: a small ring; 252: the most a channel's WELCOME carries)
into this process and closes them.  ``socket``: the library's client
(``fetch_fds_over_socket``) from its fd server (``FdServer``), both the engine's
(``c/src/fetch.c``, ``c/src/fdserver.c``), the server's thread in this process;
``pidfd``: the library's ``pidfd_getfd`` path (``fetch_fds``, one pidfd for the list).
The baselines do the same transfers with bare calls: one ``SCM_RIGHTS`` message per 250
fds on a socket pair (no connect, no request, no checks), and ``os.pidfd_open`` plus
one ``pidfd_getfd`` a fd by ctypes.  The difference of medians in each group is what the
library adds: the connect, the server's checks (uid, admission, token) and its thread's
turn, the client's checks of who serves the socket.
"""

from __future__ import annotations

import ctypes
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from cupy_ipcpool._transport import FdServer, fetch_fds, fetch_fds_over_socket, process_start_time

TOKEN = b"t" * 16
_SYS_PIDFD_GETFD = 438  # x86_64 and aarch64


@pytest.fixture(params=[8, 252], ids=lambda n: f"{n}fds")
def memfds(request: Any) -> Iterator[list[int]]:
    fds = [os.memfd_create(f"bench-{i}", os.MFD_CLOEXEC) for i in range(request.param)]
    yield fds
    for fd in fds:
        os.close(fd)


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def test_baseline_bare_scm_rights(benchmark: Any, memfds: list[int]) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def round_() -> None:
        got: list[int] = []
        for i in range(0, len(memfds), 250):
            socket.send_fds(a, [b"F"], memfds[i : i + 250])
            _, fds, _, _ = socket.recv_fds(b, 1, 253)
            got.extend(fds)
        _close(got)

    with a, b:
        benchmark.group = f"fetch-socket-{len(memfds)}"
        benchmark(round_)


def test_fetch_over_the_fd_server(benchmark: Any, memfds: list[int]) -> None:
    with FdServer(memfds, token=TOKEN) as server:
        path = server.path

        def round_() -> None:
            _close(fetch_fds_over_socket(path, TOKEN, len(memfds), server_uid=os.geteuid()))

        benchmark.group = f"fetch-socket-{len(memfds)}"
        benchmark(round_)


def test_baseline_bare_pidfd_getfd(benchmark: Any, memfds: list[int]) -> None:
    syscall = ctypes.CDLL(None, use_errno=True).syscall
    pid = os.getpid()

    def round_() -> None:
        pidfd = os.pidfd_open(pid)
        try:
            got = [syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0) for fd in memfds]
        finally:
            os.close(pidfd)
        assert min(got) >= 0
        _close(got)

    benchmark.group = f"fetch-pidfd-{len(memfds)}"
    benchmark(round_)


def test_fetch_by_pidfd(benchmark: Any, memfds: list[int]) -> None:
    pid = os.getpid()
    start = process_start_time(pid)

    def round_() -> None:
        _close(
            fetch_fds(
                pid=pid,
                start_time=start,
                fds=memfds,
                socket_path=None,
                token=TOKEN,
                method="pidfd",
            )
        )

    benchmark.group = f"fetch-pidfd-{len(memfds)}"
    benchmark(round_)
