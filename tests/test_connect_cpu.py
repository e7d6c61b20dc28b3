"""CPU tier: ``cupy_ipcpool.subscribe`` sends ``ucx://`` addresses to the remote layer.

Each kind of address refuses the options of the other with a ``UsageError``;
a ``ucx://`` address reaches the remote client for real (a refused TCP
connection on 127.0.0.1), a path reaches the local channel.
"""

from __future__ import annotations

import socket

import pytest
from skips import needs_ucx

import cupy_ipcpool as cip


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_secret_is_refused_for_a_local_path(tmp_path) -> None:
    with pytest.raises(cip.UsageError, match="ucx://"):
        cip.subscribe(str(tmp_path / "pub.sock"), secret=b"s" * 16)


def test_allowed_uids_is_refused_for_a_remote_address() -> None:
    with pytest.raises(cip.UsageError, match="local publishers"):
        cip.subscribe("ucx://127.0.0.1:9", allowed_uids=[0])


def test_remote_address_needs_a_secret(monkeypatch) -> None:
    monkeypatch.delenv("CUPY_IPCPOOL_SECRET", raising=False)
    with pytest.raises(cip.UsageError, match="secret"):
        cip.subscribe("ucx://127.0.0.1:9")


@needs_ucx
def test_remote_address_reaches_the_remote_client() -> None:
    port = _closed_port()
    with pytest.raises(cip.TransportError, match=f"ucx://127.0.0.1:{port}") as info:
        cip.subscribe(f"ucx://127.0.0.1:{port}", secret=b"s" * 16, timeout=5)
    assert isinstance(info.value, cip.IpcPoolError)


def test_local_path_reaches_the_local_channel(tmp_path) -> None:
    with pytest.raises(cip.TransportError) as info:
        cip.subscribe(str(tmp_path / "nobody.sock"), timeout=1)
    assert "ucx" not in str(info.value)


def test_remote_frames_are_frames() -> None:
    from cupy_ipcpool import remote

    assert issubclass(remote.RemoteFrame, cip.Frame)


@pytest.mark.parametrize("timeout", [0, 0.0, 1e-9])
def test_a_missing_publisher_with_no_time_to_wait_says_it_is_missing(tmp_path, timeout) -> None:
    """``timeout=0`` means "do not wait", not "do not try": the one attempt's own error
    (nobody at the path) is what the caller sees, not a full listen backlog."""
    with pytest.raises(cip.TransportError, match="is the publisher running") as info:
        cip.subscribe(str(tmp_path / "nobody.sock"), timeout=timeout)
    assert "backlog" not in str(info.value)


def test_an_address_that_is_not_a_path_says_what_an_address_is() -> None:
    with pytest.raises(cip.UsageTypeError, match=r"socket path .* or 'ucx://host:port'"):
        cip.subscribe(123, timeout=0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("allowed", "error", "words"),
    [
        (5, cip.UsageTypeError, "iterable of uids"),
        ("1000", cip.UsageTypeError, "iterable of uids"),
        (["1000"], cip.UsageTypeError, "each uid is an int"),
        ([True], cip.UsageTypeError, "each uid is an int"),
        ([-1], cip.UsageError, "0 or more"),
    ],
)
def test_allowed_uids_is_checked_where_it_is_given(tmp_path, allowed, error, words) -> None:
    """One reading of ``allowed_uids`` for the subscriber, the publisher, the fd server
    and the pool: a bare uid or a string is a clear error, not "'int' object is not
    iterable"."""
    from cupy_ipcpool._transport import FdServer
    from cupy_ipcpool.channel._handshake import Welcome
    from cupy_ipcpool.channel._publisher_core import PublisherCore

    with pytest.raises(error, match=words):
        cip.subscribe(str(tmp_path / "nobody.sock"), allowed_uids=allowed, timeout=0)
    with pytest.raises(error, match=words):
        PublisherCore(str(tmp_path / "p.sock"), 2, welcome=Welcome(), allowed_uids=allowed)
    assert not (tmp_path / "p.sock").exists()
    with pytest.raises(error, match=words):
        FdServer([], token=b"t" * 16, allowed_uids=allowed)
    with pytest.raises(error, match=words):  # before any GPU is looked for
        cip.IpcPool(2, 4096, allowed_uids=allowed)
