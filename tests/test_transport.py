"""CPU-tier tests of cupy_ipcpool._transport: real processes, real fds, real sockets."""

from __future__ import annotations

import errno
import gc
import os
import pickle
import socket
import stat
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cupy_ipcpool._errors import PeerRefusedError, TransportError
from cupy_ipcpool._handles import own_pid_namespace
from cupy_ipcpool._transport import (
    FdServer,
    fetch_fds,
    fetch_fds_over_socket,
    pidfd_getfd,
    process_start_time,
)
from tests import _pipe_child
from tests._fds import open_fds

CTX = _pipe_child.CHILDREN  # forkserver children (tests/_pipe_child.py)
NOBODY = 65534
TOKEN = b"secret-token-0123"
JOIN_S = 30

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to start a child that drops to uid 65534"
)


def _content(i: int) -> bytes:
    return f"memfd #{i} payload {i * 7919}".encode()


def _make_memfds(n: int) -> list[int]:
    fds = []
    for i in range(n):
        fd = os.memfd_create(f"transport-test-{i}")
        os.write(fd, _content(i))
        fds.append(fd)
    return fds


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


@pytest.fixture
def memfds() -> Iterator[list[int]]:
    fds = _make_memfds(3)
    yield fds
    _close(fds)


def _read_all(fds: list[int]) -> list[bytes]:
    return [os.pread(fd, 4096, 0) for fd in fds]


def _fds() -> set[str]:
    """This process's open fds as ``"n=target"`` (a number reused for another file is new)."""
    return {f"{fd}={target}" for fd, target in open_fds().items()}


def _new_fds(before: set[str], timeout: float = 5.0) -> set[str]:
    """The fds open now that were not in ``before``, once there are none (or ``timeout`` s).

    A server thread of this process closes its side just after the client
    returns, hence the wait.  The set, not the count: an fd an earlier test
    left to the garbage collector may close meanwhile without hiding a new one.
    """
    deadline = time.monotonic() + timeout
    while (new := _fds() - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    return new


# -- child processes (module level so spawn can import them) -------------------


def _drop_privileges() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _run_child(conn: Any, fn: Callable[..., Any], drop: bool, *args: Any) -> None:
    """Run ``fn(*args)`` and send ("ok", result) or ("err", (type, errno, message))."""
    try:
        if drop:
            _drop_privileges()
        result = fn(*args)
        conn.send(("ok", result))
    except BaseException as exc:
        conn.send(("err", (type(exc).__name__, getattr(exc, "errno", None), str(exc))))
    finally:
        conn.close()


def _child_pidfd(pid: int, start_time: int | None, fds: list[int]) -> list[bytes]:
    got = [pidfd_getfd(pid, fd, start_time=start_time) for fd in fds]
    try:
        assert not any(os.get_inheritable(fd) for fd in got), "fetched fds must be CLOEXEC"
        return _read_all(got)
    finally:
        _close(got)


def _child_fetch(kw: dict[str, Any]) -> list[bytes]:
    got = fetch_fds(**kw)
    try:
        return _read_all(got)
    finally:
        _close(got)


def _child_socket(path: str, token: bytes, count: int) -> list[bytes]:
    got = fetch_fds_over_socket(path, token, count)
    try:
        return _read_all(got)
    finally:
        _close(got)


def _child_exporter(conn: Any) -> None:
    """Create memfds, report (pid, start_time, fds), then exit (closing them)."""
    fds = _make_memfds(2)
    conn.send((os.getpid(), process_start_time(os.getpid()), fds))
    conn.close()


def _spawn(fn: Callable[..., Any], *args: Any, drop: bool = False) -> tuple[str, Any]:
    parent, child = CTX.Pipe(duplex=False)
    proc = CTX.Process(target=_run_child, args=(child, fn, drop, *args))
    proc.start()
    child.close()
    try:
        if not parent.poll(JOIN_S):
            raise AssertionError("child did not report in time")
        result: tuple[str, Any] = parent.recv()
    finally:
        parent.close()
        proc.join(JOIN_S)
        if proc.is_alive():
            proc.kill()
            proc.join(JOIN_S)
    return result


def _expect_ok(result: tuple[str, Any]) -> Any:
    kind, value = result
    assert kind == "ok", f"child failed: {value}"
    return value


def _expect_err(result: tuple[str, Any]) -> tuple[str, int | None, str]:
    kind, value = result
    assert kind == "err", f"child unexpectedly succeeded: {value}"
    name, err, msg = value
    return name, err, msg


# -- helpers -------------------------------------------------------------------


def test_process_start_time() -> None:
    st = process_start_time(os.getpid())
    assert st > 0
    assert process_start_time(os.getpid()) == st
    with pytest.raises(TransportError) as ei:
        process_start_time(2**22 + 12345)  # above pid_max's ceiling
    assert ei.value.errno == errno.ESRCH


def test_errors_pickle() -> None:
    e = TransportError(errno.EPERM, "ptrace said no; use CAP_SYS_PTRACE")
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is TransportError
    assert e2.errno == errno.EPERM and e2.strerror == e.strerror and str(e2) == str(e)
    p = PeerRefusedError("uid 7 refused", errno.EPROTO)
    p2 = pickle.loads(pickle.dumps(p))
    assert type(p2) is PeerRefusedError
    assert p2.errno == errno.EPROTO and p2.strerror == "uid 7 refused"
    assert PeerRefusedError("x").errno == errno.EACCES


# -- pidfd ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_pidfd_child_fetches_parent_fds(memfds: list[int]) -> None:
    pid = os.getpid()
    got = _expect_ok(_spawn(_child_pidfd, pid, process_start_time(pid), memfds))
    assert got == [_content(i) for i in range(3)]


def test_pidfd_own_process_cloexec(memfds: list[int]) -> None:
    fd = pidfd_getfd(os.getpid(), memfds[1])
    try:
        assert not os.get_inheritable(fd)
        assert os.pread(fd, 100, 0) == _content(1)
    finally:
        os.close(fd)


def test_pidfd_start_time_mismatch(memfds: list[int]) -> None:
    pid = os.getpid()
    with pytest.raises(TransportError) as ei:
        pidfd_getfd(pid, memfds[0], start_time=process_start_time(pid) + 1)
    assert ei.value.errno == errno.ESRCH
    assert "reused" in str(ei.value)


def _unused_fd() -> int:
    """An fd number not open here (and above any fd pidfd_open will take)."""
    used = {int(n) for n in os.listdir("/proc/self/fd")}
    return next(n for n in range(900, 1000) if n not in used)


def test_pidfd_closed_fd_ebadf() -> None:
    memfd = os.memfd_create("closed")
    fd = os.dup2(memfd, _unused_fd(), inheritable=False)
    assert os.pread(fd, 1, 0) == b""
    _close([memfd, fd])  # fd was open, now it is not
    with pytest.raises(TransportError) as ei:
        pidfd_getfd(os.getpid(), fd)
    assert ei.value.errno == errno.EBADF
    assert "no longer open" in str(ei.value)


@pytest.mark.timeout(60)
def test_pidfd_exporter_exited_esrch() -> None:
    parent, child = CTX.Pipe(duplex=False)
    proc = CTX.Process(target=_child_exporter, args=(child,))
    proc.start()
    child.close()
    try:
        assert parent.poll(JOIN_S)
        pid, start_time, fds = parent.recv()
    finally:
        parent.close()
        proc.join(JOIN_S)
    assert proc.exitcode == 0
    for st in (start_time, None):
        with pytest.raises(TransportError) as ei:
            pidfd_getfd(pid, fds[0], start_time=st)
        assert ei.value.errno == errno.ESRCH
        assert "exited" in str(ei.value)
    ns = own_pid_namespace()
    kw: dict[str, Any] = dict(pid=pid, start_time=start_time, fds=fds, token=TOKEN)
    # the exporter's pid namespace is ours: ESRCH is final, the socket is not tried
    for socket_path in (None, "/nonexistent/fds.sock"):
        with pytest.raises(TransportError) as ei:
            fetch_fds(**kw, socket_path=socket_path, pid_namespace=ns)
        assert ei.value.errno == errno.ESRCH
        assert "the exporter process has exited" in str(ei.value)
        assert "namespace" not in str(ei.value) and "nonexistent" not in str(ei.value)
    # the namespace is not known: the socket is tried; no server there either is ESRCH,
    # and the message says what else it could be
    with pytest.raises(TransportError) as ei:
        fetch_fds(**kw, socket_path="/nonexistent/fds.sock")
    assert ei.value.errno == errno.ESRCH
    msg = str(ei.value)
    assert msg.startswith("[ESRCH] the exporter has exited: no process")
    assert "no fd server at /nonexistent/fds.sock" in msg
    assert "another PID namespace" in msg and "socket_path=" in msg
    with pytest.raises(TransportError) as ei:
        fetch_fds(**kw, socket_path=None)
    assert ei.value.errno == errno.ESRCH
    assert "has exited, or it runs in another PID namespace" in str(ei.value)


def test_auto_uses_the_socket_for_a_pid_of_another_namespace(memfds: list[int]) -> None:
    """A pid of another PID namespace is never looked up here, even where it would resolve."""
    pid, start = os.getpid(), process_start_time(os.getpid())
    other = own_pid_namespace() + 1
    with FdServer(memfds, token=TOKEN) as server:
        kw: dict[str, Any] = dict(
            pid=pid, start_time=start, fds=memfds, token=TOKEN, exporter_uid=os.geteuid()
        )
        # pidfd_getfd on this very pid would work: it is not tried
        with pytest.raises(TransportError) as ei:
            fetch_fds(**kw, socket_path=server.path, method="pidfd", pid_namespace=other)
        assert ei.value.errno == errno.ESRCH
        assert "another PID namespace" in str(ei.value) and server.path in str(ei.value)
        with pytest.raises(TransportError) as ei:
            fetch_fds(**kw, socket_path=None, pid_namespace=other)
        assert ei.value.errno == errno.ESRCH and "socket_path=" in str(ei.value)
        before = _fds()
        got = fetch_fds(**kw, socket_path=server.path, pid_namespace=other)
        try:
            assert _read_all(got) == [_content(i) for i in range(3)]
        finally:
            _close(got)
        # the server's thread (in this process) closes its side just after the client returns
        assert not _new_fds(before)
        # the socket failing too: both causes, the socket's errno, the fix
        with pytest.raises(PeerRefusedError) as pe:
            fetch_fds(**dict(kw, token=b"wrong"), socket_path=server.path, pid_namespace=other)
        msg = str(pe.value)
        assert pe.value.errno == errno.EACCES
        assert "could not see the exporter: it runs in another PID namespace" in msg
        assert "refused the token" in msg
    with pytest.raises(TransportError) as ei:  # the server has gone
        fetch_fds(**kw, socket_path=server.path, pid_namespace=other)
    msg = str(ei.value)
    assert ei.value.errno in (errno.ENOENT, errno.ECONNREFUSED)
    assert "another PID namespace" in msg and f"no fd server at {server.path}" in msg
    assert "not visible from this process" in msg and "socket_path=" in msg


def test_auto_tells_a_reused_pid_from_a_pid_it_cannot_place(memfds: list[int]) -> None:
    """A live pid with another start time: reused (same namespace), or maybe foreign."""
    pid, wrong = os.getpid(), process_start_time(os.getpid()) + 1
    with FdServer(memfds, token=TOKEN) as server:
        kw: dict[str, Any] = dict(
            pid=pid, start_time=wrong, fds=memfds, socket_path=server.path, token=TOKEN
        )
        with pytest.raises(TransportError) as ei:
            fetch_fds(**kw, pid_namespace=own_pid_namespace())
        assert ei.value.errno == errno.ESRCH and "pid was reused" in str(ei.value)
        got = fetch_fds(**kw)  # namespace unknown: falls back to the socket
        try:
            assert _read_all(got) == [_content(i) for i in range(3)]
        finally:
            _close(got)


@needs_root
@pytest.mark.timeout(60)
def test_pidfd_eperm_for_other_uid_and_auto_falls_back(memfds: list[int]) -> None:
    pid = os.getpid()
    start = process_start_time(pid)
    name, err, msg = _expect_err(_spawn(_child_pidfd, pid, start, memfds, drop=True))
    assert name == "TransportError" and err == errno.EPERM
    assert "CAP_SYS_PTRACE" in msg and "ptrace_scope" in msg and 'transport="socket"' in msg

    with FdServer(memfds, token=TOKEN, allowed_uids={NOBODY}) as server:
        assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o666
        assert stat.S_IMODE(os.stat(os.path.dirname(server.path)).st_mode) == 0o711
        kw = dict(pid=pid, start_time=start, fds=memfds, socket_path=server.path, token=TOKEN)
        got = _expect_ok(_spawn(_child_fetch, dict(kw, method="auto"), drop=True))
        assert got == [_content(i) for i in range(3)]
        # pidfd only: the EPERM comes through, no fallback
        name, err, _ = _expect_err(_spawn(_child_fetch, dict(kw, method="pidfd"), drop=True))
        assert err == errno.EPERM


# -- socket --------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_socket_child_fetches(memfds: list[int]) -> None:
    with FdServer(memfds, token=TOKEN) as server:
        got = _expect_ok(_spawn(_child_socket, server.path, TOKEN, 3))
        assert got == [_content(i) for i in range(3)]


def test_socket_default_permissions_and_close_removes(memfds: list[int]) -> None:
    server = FdServer(memfds, token=TOKEN)
    path = server.path
    directory = os.path.dirname(path)
    assert os.path.basename(directory).startswith("cupy_ipcpool-")
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    server.close()
    server.close()  # idempotent
    assert not os.path.exists(path) and not os.path.exists(directory)
    with pytest.raises(TransportError) as ei:
        fetch_fds_over_socket(path, TOKEN, 3)
    assert ei.value.errno == errno.ENOENT and "exited" in str(ei.value)
    # the served fds stay open
    assert _read_all(memfds) == [_content(i) for i in range(3)]


def test_socket_explicit_path(tmp_path: Any, memfds: list[int]) -> None:
    path = str(tmp_path / "x.sock")
    with FdServer(memfds, token=TOKEN, path=path) as server:
        assert server.path == path
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        got = fetch_fds_over_socket(path, TOKEN, 3)
        assert _read_all(got) == [_content(i) for i in range(3)]
        _close(got)
    assert not os.path.exists(path) and tmp_path.exists()


def test_socket_wrong_token_and_count(memfds: list[int]) -> None:
    with FdServer(memfds, token=TOKEN) as server:
        before = _fds()
        with pytest.raises(PeerRefusedError) as ei:
            fetch_fds_over_socket(server.path, b"wrong", 3)
        assert "token" in str(ei.value)
        with pytest.raises(TransportError) as ei2:
            fetch_fds_over_socket(server.path, TOKEN, 2)
        assert ei2.value.errno == errno.EPROTO
        got = fetch_fds_over_socket(server.path, TOKEN, 3)
        _close(got)
        assert not _new_fds(before)


def test_socket_many_fds_chunked(memfds: list[int]) -> None:
    fds = [os.dup(memfds[i % 3]) for i in range(600)]
    try:
        with FdServer(fds, token=TOKEN) as server:
            got = fetch_fds_over_socket(server.path, TOKEN, 600)
            try:
                assert len(got) == 600
                assert os.pread(got[599], 100, 0) == _content(599 % 3)
                assert os.pread(got[250], 100, 0) == _content(250 % 3)
            finally:
                _close(got)
    finally:
        _close(fds)


def test_the_fd_server_speaks_the_documented_protocol_to_a_hand_built_client(
    memfds: list[int],
) -> None:
    """An independent peer of the engine's server (its client is the engine's too): the
    request ``FDS1 | u8 len | token`` by hand, the reply read as _fdserver's docstring
    says: status 0, the count (u32, big-endian), one ``F`` per 250 fds with them attached,
    then the end; a wrong token: status 2, then the end."""
    import struct

    with FdServer(memfds, token=TOKEN) as server:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(5)
            c.connect(server.path)
            c.sendall(b"FDS1" + bytes([len(TOKEN)]) + TOKEN)
            head = b""
            while len(head) < 5:
                head += c.recv(5 - len(head))
            assert head == b"\x00" + struct.pack("!I", len(memfds))
            data, fds, _flags, _addr = socket.recv_fds(c, 16, 253)
            try:
                assert data == b"F" and len(fds) == len(memfds)
                assert _read_all(fds) == [_content(i) for i in range(len(memfds))]
            finally:
                _close(fds)
            assert c.recv(16) == b""  # all sent: closed
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(5)
            c.connect(server.path)
            c.sendall(b"FDS1" + bytes([len(TOKEN)]) + bytes(len(TOKEN)))
            assert c.recv(16) == b"\x02"  # bad token
            assert c.recv(16) == b""


def test_socket_malformed_clients_do_not_stop_server(memfds: list[int]) -> None:
    with FdServer(memfds, token=TOKEN) as server:
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        garbage = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        long_token = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with silent, garbage, long_token:
            silent.connect(server.path)  # connects and says nothing
            garbage.connect(server.path)
            garbage.sendall(b"GARBAGE GARBAGE GARBAGE")
            long_token.connect(server.path)
            long_token.sendall(b"FDS1\xff" + b"x" * 10)
            t0 = time.monotonic()
            got = fetch_fds_over_socket(server.path, TOKEN, 3, timeout=3.0)
            assert time.monotonic() - t0 < 2.0
            assert _read_all(got) == [_content(i) for i in range(3)]
            _close(got)
            garbage.settimeout(5)
            assert garbage.recv(16) == b"\x03"  # bad request, then closed
            long_token.settimeout(5)
            assert long_token.recv(16) == b"\x03"
        got = fetch_fds_over_socket(server.path, TOKEN, 3)
        _close(got)


@needs_root
@pytest.mark.timeout(60)
def test_socket_uid_refused_by_peercred(memfds: list[int]) -> None:
    with FdServer(memfds, token=TOKEN, allowed_uids={12345}) as server:
        assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o666
        name, err, msg = _expect_err(_spawn(_child_socket, server.path, TOKEN, 3, drop=True))
        assert name == "PeerRefusedError" and err == errno.EACCES
        assert str(NOBODY) in msg and "allowed_uids" in msg
        got = fetch_fds_over_socket(server.path, TOKEN, 3)  # our own uid is still served
        assert _read_all(got) == [_content(i) for i in range(3)]
        _close(got)


@needs_root
@pytest.mark.timeout(60)
def test_socket_file_permissions_refuse_other_uid(memfds: list[int]) -> None:
    with FdServer(memfds, token=TOKEN) as server:
        name, err, msg = _expect_err(_spawn(_child_socket, server.path, TOKEN, 3, drop=True))
        assert name == "TransportError" and err == errno.EACCES
        assert "permissions" in msg and "allow" in msg


# -- fetch_fds -----------------------------------------------------------------


def test_fetch_fds_methods(memfds: list[int]) -> None:
    pid = os.getpid()
    start = process_start_time(pid)
    kw: dict[str, Any] = dict(pid=pid, start_time=start, fds=memfds, token=TOKEN)
    with pytest.raises(ValueError):
        fetch_fds(**kw, socket_path=None, method="carrier-pigeon")
    with pytest.raises(TransportError) as ei:
        fetch_fds(**kw, socket_path=None, method="socket")
    assert "socket" in str(ei.value)
    for method in ("auto", "pidfd"):
        got = fetch_fds(**kw, socket_path=None, method=method)
        assert _read_all(got) == [_content(i) for i in range(3)]
        _close(got)
    with FdServer(memfds, token=TOKEN) as server:
        got = fetch_fds(**kw, socket_path=server.path, method="socket")
        assert _read_all(got) == [_content(i) for i in range(3)]
        _close(got)


def test_fetch_fds_pidfd_partial_failure_closes(memfds: list[int]) -> None:
    closed = _unused_fd()
    before = _fds()
    with pytest.raises(TransportError) as ei:
        fetch_fds(
            pid=os.getpid(),
            start_time=None,
            fds=[*memfds, closed],
            socket_path="/nonexistent/fds.sock",  # EBADF never falls back
            token=TOKEN,
            method="auto",
        )
    assert ei.value.errno == errno.EBADF
    assert f"fd={closed}" in str(ei.value)  # the message names the fd that failed
    assert not _fds() - before


def test_fetch_fds_pidfd_fetches_a_list_leaving_only_its_fds(memfds: list[int]) -> None:
    """A list of fds (repeats included) comes back in order; only they are new (the pidfd is
    closed); an empty list fetches nothing."""
    pid = os.getpid()
    start = process_start_time(pid)
    gc.collect()  # no earlier test's fd closes (and frees its number) during the look below
    before = _fds()
    got = fetch_fds(
        pid=pid, start_time=start, fds=memfds * 4, socket_path=None, token=TOKEN, method="pidfd"
    )
    try:
        assert _read_all(got) == [_content(i) for i in range(3)] * 4
        new = {int(entry.split("=", 1)[0]) for entry in _fds() - before}
        assert new == set(got)  # the pidfd itself is closed
    finally:
        _close(got)
    assert fetch_fds(pid=pid, start_time=start, fds=[], socket_path=None, token=TOKEN) == []
    # a wrong start time is still refused, and nothing is left open
    with pytest.raises(TransportError) as ei:
        fetch_fds(
            pid=pid, start_time=start + 1, fds=memfds, socket_path=None, token=TOKEN, method="pidfd"
        )
    assert ei.value.errno == errno.ESRCH and "reused" in str(ei.value)
    assert not _fds() - before


# -- leaks ---------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["drop", "close"])
def test_a_forked_child_letting_go_of_the_fd_server_leaves_the_parent_serving(
    memfds: list[int], how: str
) -> None:
    """A child forked while the server runs (its thread is not copied) that drops its copy
    (collected) or closes it closes only its own copies: the parent's socket file stays and
    the parent goes on serving; the parent's close then removes the file."""
    server = FdServer(memfds, token=TOKEN)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 0
            try:
                if how == "close":
                    server.close()
                else:
                    del server
                    gc.collect()
            except BaseException:
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.path.exists(server.path)
        got = fetch_fds_over_socket(server.path, TOKEN, len(memfds), timeout=5.0)
        try:
            assert _read_all(got) == [_content(i) for i in range(len(memfds))]
        finally:
            _close(got)
    finally:
        server.close()
    assert not os.path.exists(server.path)


@pytest.mark.timeout(60)
def test_no_fd_leak_over_500_transfers(memfds: list[int]) -> None:
    pid = os.getpid()
    start = process_start_time(pid)
    with FdServer(memfds, token=TOKEN) as server:
        before = _fds()
        for method in ("pidfd", "socket"):
            for _ in range(500):
                got = fetch_fds(
                    pid=pid,
                    start_time=start,
                    fds=memfds,
                    socket_path=server.path,
                    token=TOKEN,
                    method=method,
                )
                assert len(got) == 3
                _close(got)
        # receiver and FdServer live in this process: one count covers both
        assert not _new_fds(before)
        for _ in range(50):  # refusals do not leak either
            with pytest.raises(PeerRefusedError):
                fetch_fds_over_socket(server.path, b"bad", 3)
        assert not _new_fds(before)


# -- admission: per-uid cap and deadlines ------------------------------------------------


def test_admission_caps_per_uid_and_drops_the_oldest() -> None:
    from cupy_ipcpool._transport import Admission

    adm = Admission(2, 5.0)
    assert adm.admit(10, 1000, 0.0) == []
    assert adm.admit(11, 1000, 1.0) == []
    assert adm.admit(20, 2000, 1.5) == []  # another uid has its own room
    assert adm.admit(12, 1000, 2.0) == [10]
    assert adm.count(1000) == 2 and adm.count(2000) == 1 and len(adm) == 3
    assert 10 not in adm and 12 in adm
    assert adm.next_deadline() == 6.0
    assert adm.expired(6.4) == [11]
    assert adm.expired(7.0) == [20, 12]
    assert adm.next_deadline() is None and len(adm) == 0
    assert adm.remove(12) is False
    with pytest.raises(ValueError):
        Admission(0, 1.0)
    adm.admit(1, 5, 0.0)
    with pytest.raises(ValueError):
        adm.admit(1, 5, 0.0)


def test_a_socket_file_is_unlinked_only_while_it_is_ours(tmp_path: Any) -> None:
    """The fd server's and the publisher's one rule: remove the path if it is still ours."""
    from cupy_ipcpool._transport._unix import unlink_if_ours

    path, real = str(tmp_path / "s.sock"), str(tmp_path / "real.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(real)
        st = os.lstat(real)
        ours = (st.st_dev, st.st_ino)
        # a symlink to our very socket is not ours (lstat, not stat): it stays
        os.symlink(real, path)
        unlink_if_ours(path, ours)
        assert os.path.lexists(path)
        os.unlink(path)
        # another file in its place stays
        open(path, "w").close()
        unlink_if_ours(path, ours)
        assert os.path.exists(path)
        # ours is removed; already gone is nothing to do
        unlink_if_ours(real, ours)
        assert not os.path.lexists(real)
        unlink_if_ours(real, ours)
