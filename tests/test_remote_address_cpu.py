"""CPU tier: a remote server's address has one parser, for the Python API and the command line.

``remote.subscribe("ucx://host")`` (no port) and ``"ucx://host:0"`` are usage
errors naming the form ``ucx://HOST:PORT`` and the port a server listens on
by default, as ``relay``'s REMOTE is, with the same words
(``_wire.parse_address``); where a server listens has its own
(``_wire.parse_listen``: the port written, 0 for any).  Every entry point
refuses such an address before anything connects or UCXX is looked for.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

import cupy_ipcpool as cip
from cupy_ipcpool import remote
from cupy_ipcpool.remote import _cli
from cupy_ipcpool.remote import _wire as wire

GOOD = [
    ("ucx://10.0.0.1:1234", ("10.0.0.1", 1234)),
    ("ucx://[::1]:99", ("::1", 99)),
    ("ucx://node7.example:65535", ("node7.example", 65535)),
    ("ucx://localhost:1", ("localhost", 1)),
]

#: (address, words of the error): each names what to give.
BAD = [
    ("ucx://node7", ["'ucx://node7' has no port: give ucx://HOST:PORT", "listens on 13337"]),
    ("ucx://node7:0", ["port 0 is no server's port: give ucx://HOST:PORT", "13337"]),
    ("node7:5", ["'node7:5' has no scheme: give ucx://node7:5"]),
    ("node7", ["has no scheme: give ucx://node7"]),
    ("tcp://node7:5", ["is not a ucx:// address"]),
    ("ucx://node7:70000", ["the port must be a number in 0..65535"]),
    ("ucx://:5", ["no host"]),
    ("ucx://node7:5/x", ["expected ucx://host:port"]),
    ("/tmp/cam.sock", ["expected ucx://host:port"]),
]


@pytest.mark.parametrize(("address", "parts"), GOOD)
def test_a_server_address_written_out_is_split(address: str, parts: tuple[str, int]) -> None:
    assert wire.parse_address(address) == parts
    assert remote.parse_address(address) == parts
    assert _cli.remote_address(address) == address


@pytest.mark.parametrize(("address", "words"), BAD, ids=[a for a, _ in BAD])
def test_the_api_and_the_command_line_refuse_alike(address: str, words: list[str]) -> None:
    with pytest.raises(cip.UsageError) as api:
        wire.parse_address(address)
    text = str(api.value)
    for w in words:
        assert w in text, text
    with pytest.raises(argparse.ArgumentTypeError) as cli:
        _cli.remote_address(address)
    assert str(cli.value) == text  # one parser, one message


def test_an_address_that_is_no_string_is_a_type_error() -> None:
    with pytest.raises(cip.UsageTypeError, match="ucx://HOST:PORT, not int"):
        wire.parse_address(13337)  # type: ignore[arg-type]


def TOP_LEVEL(a: str) -> Any:
    return cip.subscribe(a, insecure=True)


def _subscribe_calls() -> list[Any]:
    return [
        TOP_LEVEL,
        lambda a: remote.subscribe(a, insecure=True, memory="host"),
        lambda a: remote.RemoteSubscriber(a, insecure=True, memory="host"),
        lambda a: remote.Relay(a, "/tmp/cip-never.sock", insecure=True, memory="host"),
        lambda a: remote.relay(a, "/tmp/cip-never.sock", insecure=True, memory="host"),
    ]


@pytest.mark.parametrize(
    "call",
    _subscribe_calls(),
    ids=["subscribe", "remote.subscribe", "RemoteSubscriber", "Relay", "relay"],
)
@pytest.mark.parametrize(("address", "words"), BAD[:3], ids=[a for a, _ in BAD[:3]])
def test_every_entry_point_refuses_before_connecting(call: Any, address: str, words: list) -> None:
    """No default port is guessed and port 0 is not dialled: a usage error comes first (also
    before a missing secret, or UCXX, would be reported)."""
    if call is TOP_LEVEL and "://" not in address:
        pytest.skip("cupy_ipcpool.subscribe takes an address without ucx:// as a socket path")
    with pytest.raises(cip.UsageError) as raised:
        call(address)
    assert words[0] in str(raised.value), str(raised.value)


@pytest.mark.parametrize(
    ("listen", "parts"),
    [
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("ucx://0.0.0.0:5", ("0.0.0.0", 5)),
        ("[::1]:7", ("::1", 7)),
    ],
)
def test_where_a_server_listens_is_split(listen: str, parts: tuple[str, int]) -> None:
    assert wire.parse_listen(listen) == parts
    assert _cli.listen_address(listen) == listen


@pytest.mark.parametrize("listen", ["127.0.0.1", "node7", "127.0.0.1:70000", "tcp://h:1"])
def test_a_listen_address_without_a_good_port_is_refused_alike(listen: str) -> None:
    with pytest.raises(cip.UsageError) as api:
        wire.parse_listen(listen)
    with pytest.raises(argparse.ArgumentTypeError) as cli:
        _cli.listen_address(listen)
    assert str(cli.value) == str(api.value)
    if ":" not in listen:
        assert "has no port: give HOST:PORT (13337 by default; 0: any free port)" in str(api.value)


def test_serve_and_the_server_check_listen_before_anything(tmp_path: Any) -> None:
    missing = str(tmp_path / "nobody.sock")  # serve would connect here next
    with pytest.raises(cip.UsageError, match="has no port"):
        remote.serve(missing, listen="127.0.0.1", insecure=True, memory="host")
    with pytest.raises(cip.UsageError, match="has no port"):
        remote.RemoteServer(object(), listen="127.0.0.1", insecure=True)  # type: ignore[arg-type]
