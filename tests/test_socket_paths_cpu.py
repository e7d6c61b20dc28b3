"""CPU tier: a Unix socket path no socket can be bound or reached at is refused where it is given.

The kernel's ``sun_path`` holds 108 bytes; a path with its NUL fits in 107
(``MAX_SOCKET_PATH``), the limit of Python's ``socket`` module and of the C
library (``tests/test_c_library.py`` checks the C side).  Every bind and connect
goes through one check, ``check_socket_path``: the channel's publisher core
(under ``Publisher`` and ``HostChannelPublisher``), the fd server, the
subscribers and the relay refuse a longer path with a ``UsageError`` that gives
the limit, the path's length and the fix, before anything is bound, linked or
connected.  A path of exactly 107 bytes works end to end.

How a socket is put at its path (``c/src/listen.c``, through
``c/tests/cip_listen_probe.c``, whose own ``link()`` can fail as on a file
system without hard links): it listens, with its mode, before the path appears,
by a hard link or else by a rename; a file already there is never replaced
(only a publisher's stale socket is, before binding), and nothing is left
beside it.
"""

from __future__ import annotations

import errno
import os
import pathlib
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import pytest

import cupy_ipcpool as cip
from cupy_ipcpool._handles import MAX_SOCKET_PATH
from cupy_ipcpool._transport import FdServer, bind_unix, check_socket_path, fetch_fds_over_socket
from cupy_ipcpool.remote import HostChannelPublisher, HostChannelSubscriber, relay

TOKEN = b"socket-paths-test-token!"


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A fresh directory with a short path (under /tmp, whatever $TMPDIR says)."""
    d = tempfile.mkdtemp(prefix="cip-", dir="/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def path_of(directory: str, size: int) -> str:
    """A path of exactly ``size`` bytes in ``directory``."""
    path = os.path.join(directory, "s" * (size - len(os.fsencode(directory)) - 1))
    assert len(os.fsencode(path)) == size
    return path


def assert_says_limit_length_and_fix(exc: BaseException, size: int) -> None:
    text = str(exc)
    assert isinstance(exc, cip.UsageError), repr(exc)
    assert f"is {size} bytes long" in text, text
    assert f"at most {MAX_SOCKET_PATH} bytes" in text, text
    assert "use a shorter path" in text and "/tmp or $XDG_RUNTIME_DIR" in text, text


def test_the_limit_is_sun_path_less_its_nul() -> None:
    assert MAX_SOCKET_PATH == 108 - 1  # Linux's sun_path, less the NUL
    # Python's own socket module draws the same line: 107 bytes bind, 108 cannot
    with tempfile.TemporaryDirectory(dir="/tmp") as d, socket.socket(socket.AF_UNIX) as s:
        s.bind(path_of(d, MAX_SOCKET_PATH))
        with socket.socket(socket.AF_UNIX) as t, pytest.raises(OSError, match="too long"):
            t.bind(path_of(d, MAX_SOCKET_PATH + 1))


def test_check_socket_path_takes_107_bytes_and_refuses_more(short_dir: str) -> None:
    ok = path_of(short_dir, MAX_SOCKET_PATH)
    assert check_socket_path(ok) == ok
    assert check_socket_path(pathlib.Path(ok)) == ok
    assert check_socket_path(os.fsencode(ok)) == ok  # bytes, as the socket module takes them
    for size in (MAX_SOCKET_PATH + 1, 4096):
        with pytest.raises(cip.UsageError) as raised:
            check_socket_path(path_of(short_dir, size))
        assert_says_limit_length_and_fix(raised.value, size)
    # counted in bytes as the kernel sees them, not in characters
    wide = os.path.join(short_dir, "é" * ((MAX_SOCKET_PATH - len(short_dir)) // 2))
    assert len(wide) <= MAX_SOCKET_PATH < len(os.fsencode(wide))
    with pytest.raises(cip.UsageError, match=f"is {len(os.fsencode(wide))} bytes long"):
        check_socket_path(wide)
    with pytest.raises(cip.UsageError, match="empty"):
        check_socket_path("")
    with pytest.raises(cip.UsageError, match="NUL"):
        check_socket_path(short_dir + "/a\x00b")
    with pytest.raises(TypeError, match="path-like, not int"):
        check_socket_path(5)  # type: ignore[arg-type]


def test_bind_and_connect_refuse_a_path_too_long_and_leave_nothing(short_dir: str) -> None:
    long = path_of(short_dir, MAX_SOCKET_PATH + 1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        with pytest.raises(cip.UsageError) as raised:
            bind_unix(s, long, 0o600, backlog=1)
        assert_says_limit_length_and_fix(raised.value, MAX_SOCKET_PATH + 1)
        # nothing bound next to it, nothing linked at it (a socket no one could reach)
        assert os.listdir(short_dir) == []
    # the fd fetch's connect (the engine's): the same refusal, before any socket is made
    with pytest.raises(cip.UsageError) as raised:
        fetch_fds_over_socket(long, b"t", 1, timeout=1.0)
    assert_says_limit_length_and_fix(raised.value, MAX_SOCKET_PATH + 1)


CIP_ERR_TRANSPORT = 8  # c/include/cupy_ipcpool.h


@pytest.fixture(scope="module")
def listen_probe(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """``c/tests/cip_listen_probe.c``, built once: it binds with ``cipi_bind_listen`` (or
    ``cipi_publisher_listen``) and has its own ``link()``, which says what it sees and, under
    ``CIP_PROBE_LINK_ERRNO``, fails as on a file system without hard links."""
    from test_c_library import C_DIR, build_c_program

    return build_c_program(
        tmp_path_factory.mktemp("listen-probe"),
        "cip_listen_probe",
        [C_DIR / "tests" / "cip_listen_probe.c"],
    )


def errno_id(value: int | None) -> str:
    """A test id: the errno's name, or "link" where link() works."""
    return "link" if value is None else errno.errorcode[value]


def run_listen_probe(
    probe: pathlib.Path, address: str, mode: str, *args: str, link_errno: int | None = None
) -> list[str]:
    """The probe's lines; with ``link_errno``, its ``link()`` fails with that errno."""
    env = dict(os.environ)
    env.pop("CIP_PROBE_LINK_ERRNO", None)
    if link_errno is not None:
        env["CIP_PROBE_LINK_ERRNO"] = str(link_errno)
    out = subprocess.run(
        [probe, address, mode, *args], capture_output=True, text=True, timeout=30, env=env
    )
    lines = out.stdout.splitlines()
    assert out.returncode == (0 if lines[-1:] == ["ok"] else 1), out
    assert "Sanitizer" not in out.stderr, out.stderr
    return lines


def test_a_bound_path_appears_only_once_its_socket_listens(
    short_dir: str, listen_probe: pathlib.Path
) -> None:
    """A client that waits for the path to appear (a relay's reader, a follower) finds it
    accepting connections: the socket listens, with its mode, before it is linked into place.
    ``c/tests/cip_listen_probe.c`` has its own ``link()``, which looks at that moment."""
    address = os.path.join(short_dir, "s")
    lines = run_listen_probe(listen_probe, address, "600")
    assert lines == ["at link: listening=1 mode=600", "ok"]
    assert stat.S_IMODE(os.lstat(address).st_mode) == 0o600
    assert os.listdir(short_dir) == ["s"]  # its temporary directory is gone


@pytest.mark.parametrize(
    ("link_errno", "mode"),
    [(errno.EPERM, "600"), (errno.EXDEV, "666"), (errno.EOPNOTSUPP, "600"), (errno.EMLINK, "666")],
    ids=["EPERM-600", "EXDEV-666", "EOPNOTSUPP-600", "EMLINK-666"],
)
def test_without_hard_links_the_listening_socket_is_moved_into_place(
    short_dir: str, listen_probe: pathlib.Path, link_errno: int, mode: str
) -> None:
    """On a file system without hard links (link() fails with EPERM, EXDEV, EOPNOTSUPP or
    EMLINK) the socket, already listening with its mode, is renamed into place: a client
    connects at the path, the file is a socket of that mode, and neither the temporary
    directory nor its file is left behind."""
    address = os.path.join(short_dir, "s")
    lines = run_listen_probe(listen_probe, address, mode, link_errno=link_errno)
    assert lines == [f"at link: listening=1 mode={mode}", "ok"]
    there = os.lstat(address)
    assert stat.S_ISSOCK(there.st_mode)
    assert stat.S_IMODE(there.st_mode) == int(mode, 8)
    assert os.listdir(short_dir) == ["s"]


@pytest.mark.parametrize("link_errno", [None, errno.EPERM, errno.EXDEV], ids=errno_id)
@pytest.mark.parametrize("kind", ["file", "socket"])
def test_a_file_created_at_the_path_while_binding_is_not_replaced(
    short_dir: str, listen_probe: pathlib.Path, link_errno: int | None, kind: str
) -> None:
    """``cipi_bind_listen`` itself never replaces what is at the path (only
    ``cipi_publisher_listen`` removes a stale socket, before binding): a file that appeared
    there meanwhile is refused with EADDRINUSE whether the socket is linked or, without hard
    links, would be renamed (a rename would silently replace it).  It stays as it was and
    nothing else is left behind."""
    address = os.path.join(short_dir, "s")
    if kind == "file":
        pathlib.Path(address).write_bytes(b"someone else's")
    else:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as other:
            other.bind(address)
    before = os.lstat(address)
    lines = run_listen_probe(listen_probe, address, "600", link_errno=link_errno)
    assert lines == [
        "at link: listening=1 mode=600",
        f"err {CIP_ERR_TRANSPORT} {errno.EADDRINUSE} "
        f"{address} was created by someone else while binding",
    ]
    after = os.lstat(address)
    assert (after.st_dev, after.st_ino, after.st_mode) == (
        before.st_dev,
        before.st_ino,
        before.st_mode,
    )
    if kind == "file":
        assert pathlib.Path(address).read_bytes() == b"someone else's"
    assert os.listdir(short_dir) == ["s"]


@pytest.mark.parametrize("link_errno", [errno.EIO, errno.EACCES], ids=errno_id)
def test_another_link_failure_is_an_error_and_leaves_nothing(
    short_dir: str, listen_probe: pathlib.Path, link_errno: int
) -> None:
    """Only the errors that mean "no hard links here" fall back to a rename; any other
    failure of link() is said with its errno, and the directory is left as it was."""
    address = os.path.join(short_dir, "s")
    lines = run_listen_probe(listen_probe, address, "600", link_errno=link_errno)
    assert lines == [
        "at link: listening=1 mode=600",
        f"err {CIP_ERR_TRANSPORT} {link_errno} cannot create {address}: {os.strerror(link_errno)}",
    ]
    assert os.listdir(short_dir) == []


@pytest.mark.parametrize("link_errno", [None, errno.EPERM], ids=errno_id)
@pytest.mark.parametrize("mode", ["600", "666"])
def test_a_publisher_replaces_a_stale_socket_with_or_without_hard_links(
    short_dir: str, listen_probe: pathlib.Path, link_errno: int | None, mode: str
) -> None:
    """``cipi_publisher_listen`` (its mode 0600, or 0666 once another uid may connect): a
    socket file nobody listens on is replaced by the new listening socket, moved into place
    by a rename where link() fails as by a link."""
    address = os.path.join(short_dir, "s")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stale:
        stale.bind(address)
    stale_ino = os.lstat(address).st_ino
    lines = run_listen_probe(listen_probe, address, mode, "publisher", link_errno=link_errno)
    assert lines == [f"at link: listening=1 mode={mode}", "ok"]
    there = os.lstat(address)
    assert stat.S_ISSOCK(there.st_mode) and there.st_ino != stale_ino
    assert stat.S_IMODE(there.st_mode) == int(mode, 8)
    assert os.listdir(short_dir) == ["s"]


@pytest.mark.parametrize("link_errno", [None, errno.EPERM], ids=errno_id)
def test_a_publisher_refuses_a_live_socket_with_or_without_hard_links(
    short_dir: str, listen_probe: pathlib.Path, link_errno: int | None
) -> None:
    """A socket someone listens on is refused before anything is bound: it stays in place,
    still reachable, and nothing is left beside it."""
    address = os.path.join(short_dir, "s")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as live:
        live.bind(address)
        live.listen(8)
        before = os.lstat(address)
        lines = run_listen_probe(listen_probe, address, "600", "publisher", link_errno=link_errno)
        assert lines == [
            f"err {CIP_ERR_TRANSPORT} {errno.EADDRINUSE} a publisher is already listening at "
            f"{address}; close it or choose another address"
        ]
        after = os.lstat(address)
        assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
        assert os.listdir(short_dir) == ["s"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
            client.connect(address)


def test_the_fd_server_refuses_a_path_too_long(
    short_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fd = os.memfd_create("socket-paths-test")
    try:
        with pytest.raises(cip.UsageError) as raised:
            FdServer([fd], token=TOKEN, path=path_of(short_dir, 200))
        assert_says_limit_length_and_fix(raised.value, 200)
        assert os.listdir(short_dir) == []
        # its default path, under a $TMPDIR too deep for it: the same words, nothing left
        deep = os.path.join(short_dir, "t" * 90)
        os.mkdir(deep)
        monkeypatch.setattr(tempfile, "tempdir", deep)
        with pytest.raises(cip.UsageError, match=f"at most {MAX_SOCKET_PATH} bytes"):
            FdServer([fd], token=TOKEN)
        assert os.listdir(deep) == []
    finally:
        os.close(fd)


def test_publishers_refuse_a_path_too_long_where_it_is_given(short_dir: str) -> None:
    long = path_of(short_dir, MAX_SOCKET_PATH + 1)
    with pytest.raises(cip.UsageError) as raised:
        HostChannelPublisher(long, 2, 4096)
    assert_says_limit_length_and_fix(raised.value, MAX_SOCKET_PATH + 1)
    assert os.listdir(short_dir) == []
    # a socket file already at such a path (left by an older version) changes nothing:
    # the path is refused before the stale file is probed
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.bind(os.path.join(short_dir, "a"))
        os.link(os.path.join(short_dir, "a"), long)
    with pytest.raises(cip.UsageError) as raised:
        HostChannelPublisher(long, 2, 4096)
    assert_says_limit_length_and_fix(raised.value, MAX_SOCKET_PATH + 1)


def test_subscribers_refuse_a_path_too_long(short_dir: str) -> None:
    long = path_of(short_dir, MAX_SOCKET_PATH + 1)
    for open_one in (
        lambda: cip.subscribe(long, timeout=1.0),
        lambda: HostChannelSubscriber(long, timeout=1.0),
    ):
        with pytest.raises(cip.UsageError) as raised:
            open_one()
        assert_says_limit_length_and_fix(raised.value, MAX_SOCKET_PATH + 1)


def test_the_relay_refuses_a_path_too_long_before_it_connects(short_dir: str) -> None:
    # refused before the remote address is tried (and before UCXX is needed)
    with pytest.raises(cip.UsageError) as raised:
        relay("ucx://127.0.0.1:9", path_of(short_dir, 150), insecure=True, memory="host")
    assert_says_limit_length_and_fix(raised.value, 150)
    assert os.listdir(short_dir) == []


def test_a_path_of_107_bytes_works_end_to_end(short_dir: str) -> None:
    path = path_of(short_dir, MAX_SOCKET_PATH)
    with HostChannelPublisher(path, 2, 4096) as pub, HostChannelSubscriber(path, timeout=5) as sub:
        deadline = time.monotonic() + 5
        while not pub.subscribers and time.monotonic() < deadline:
            pub.poll(0.01)
        pub.send(np.arange(4, dtype=np.int32))
        with sub.recv(timeout=5) as frame:
            assert frame.arrays[0].tolist() == [0, 1, 2, 3]
