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
