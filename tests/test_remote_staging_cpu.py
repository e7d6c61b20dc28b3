"""CPU tier: when device frames of the remote tier go through staging buffers (remote/_staging.py).

The decision reads the configured UCX transports and the control connection's
two ends (real sockets here); the memory check needs a GPU
(``tests/test_remote_gpu.py`` runs the staged path end to end).
"""

from __future__ import annotations

import socket

import pytest

from cupy_ipcpool.remote._staging import same_machine, transports_include_cuda_ipc


@pytest.mark.parametrize(
    ("tls", "included"),
    [
        ("", True),  # unset: UCX's default, every transport
        ("all", True),
        ("cuda", True),
        ("cuda_ipc", True),
        ("tcp,cuda_copy,cuda_ipc", True),
        ("TCP,CUDA_IPC", True),
        ("tcp,cuda_copy", False),
        ("tcp", False),
        ("rc,cuda_copy", False),
        ("^cuda_ipc", False),
        ("^cuda", False),
        ("^rc,ud", True),
        (" tcp , cuda_ipc ", True),
    ],
)
def test_which_transport_settings_let_ucx_pick_cuda_ipc(tls, included):
    assert transports_include_cuda_ipc(tls) is included


def _connected_pair(host: str) -> tuple[socket.socket, socket.socket]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as listener:
        listener.bind((host, 0))
        listener.listen(1)
        client = socket.create_connection(listener.getsockname()[:2])
        server, _ = listener.accept()
    return client, server


def test_a_loopback_peer_is_this_machine():
    client, server = _connected_pair("127.0.0.1")
    with client, server:
        assert same_machine(client) and same_machine(server)


def test_a_peer_at_one_of_this_machines_interfaces_is_this_machine():
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        pytest.skip(f"this machine's host name does not resolve: {exc}")
    if address.startswith("127."):
        pytest.skip(f"the host name resolves to a loopback address ({address})")
    client, server = _connected_pair(address)
    with client, server:
        assert client.getpeername()[0] == address
        assert same_machine(client) and same_machine(server)


class _Ends:
    """The two ends of a connection between two machines, as a socket reports them."""

    family = socket.AF_INET

    def __init__(self, local: str, peer: str) -> None:
        self._local, self._peer = local, peer
        if ":" in local:
            self.family = socket.AF_INET6

    def getsockname(self) -> tuple[str, int]:
        return (self._local, 40000)

    def getpeername(self) -> tuple[str, int]:
        return (self._peer, 13337)


def test_a_peer_at_another_address_is_another_machine():
    assert not same_machine(_Ends("10.0.0.1", "10.0.0.2"))  # type: ignore[arg-type]
    assert same_machine(_Ends("10.0.0.1", "10.0.0.1"))  # type: ignore[arg-type]
    assert same_machine(_Ends("::1", "::1"))  # type: ignore[arg-type]


def test_a_socket_without_a_peer_is_not_this_machine():
    a, b = socket.socketpair()  # AF_UNIX: no IP address at either end
    with a, b:
        assert not same_machine(a)
    unconnected = socket.socket()
    with unconnected:
        assert not same_machine(unconnected)
