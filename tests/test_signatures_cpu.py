"""The subscribe keywords have one definition: ``cupy_ipcpool.channel.subscribe``.

Every other entry point spells its keywords out (so that ``help()``, IDEs
and docs/reference.md show them) or forwards ``**options`` checked against
that signature (``follow``).  These tests hold each spelled-out copy to the
definition -- names, order, kinds, defaults, annotations -- so that a
keyword added, renamed or given another default in one place fails here
until every copy follows.  No GPU needed: only signatures are read.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest

import cupy_ipcpool
from cupy_ipcpool import _connect
from cupy_ipcpool._errors import UsageError
from cupy_ipcpool.channel import Subscriber, _subscriber
from cupy_ipcpool.channel import _follow as channel_follow
from cupy_ipcpool.channel._subscriber_core import SubscriberCore

#: The definition.
DEFINITION = _subscriber.subscribe
#: Keywords of ``cupy_ipcpool.subscribe`` that only ``ucx://`` addresses take.
REMOTE_ONLY = ("secret", "insecure")
#: Keywords of the definition that are about waiting for a publisher, not one subscription.
WAITING = ("wait",)


def _params(fn: Callable[..., Any], drop: tuple[str, ...] = ()) -> list[tuple[Any, ...]]:
    """``(name, kind, default, annotation)`` of each parameter, ``self`` and ``drop`` left out."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self" or p.name in drop:
            continue
        out.append((p.name, p.kind, p.default, str(p.annotation)))
    return out


def _keywords(fn: Callable[..., Any]) -> list[str]:
    return [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]


def test_the_top_level_subscribe_is_the_definition_plus_the_remote_keywords() -> None:
    assert cupy_ipcpool.subscribe is _connect.subscribe
    assert _params(_connect.subscribe, drop=REMOTE_ONLY) == _params(DEFINITION)
    # the remote-only keywords mean what the remote subscribe says
    remote = pytest.importorskip("cupy_ipcpool.remote")
    assert _params(_connect.subscribe)[0][0] == "address"
    top = {p[0]: p for p in _params(_connect.subscribe)}
    far = {p[0]: p for p in _params(remote.subscribe)}
    for name in REMOTE_ONLY:
        assert top[name][1:3] == far[name][1:3], name


def test_the_subscriber_takes_the_definitions_keywords_but_wait() -> None:
    assert _params(Subscriber.__init__) == _params(DEFINITION, drop=WAITING)


def test_the_session_core_takes_them_but_the_device() -> None:
    """The GPU-free core under both (``hello``: its own, the HELLO payload's extra bytes;
    ``depth``: the GPU layer's, frames handed out ahead of their messages)."""
    assert _params(SubscriberCore.__init__, drop=("hello",)) == _params(
        DEFINITION, drop=(*WAITING, "device", "depth")
    )


def test_what_the_top_level_subscribe_forwards_to_a_remote_server_agrees() -> None:
    """``ucx://`` addresses: shared keywords keep the local defaults (credit maps to slots)."""
    remote = pytest.importorskip("cupy_ipcpool.remote")
    far = {p[0]: p for p in _params(remote.subscribe)}
    top = {p[0]: p for p in _params(_connect.subscribe)}
    for name in ("mode", "timeout"):
        assert far[name][1:3] == top[name][1:3], name
    assert "slots" in far and "device" in far  # what _connect passes for credit and device


@pytest.mark.parametrize(
    "path",
    ["cupy_ipcpool.remote._source.DeviceSource", "cupy_ipcpool.remote._host.HostChannelSubscriber"],
)
def test_the_bridges_spell_a_subset_the_same_way(path: str) -> None:
    """Wrappers that take some of the keywords take them as the definition does."""
    module, _, name = path.rpartition(".")
    cls = getattr(pytest.importorskip(module), name)
    ours = {p[0]: p for p in _params(DEFINITION)}
    for p in _params(cls.__init__):
        if p[0] in ours:
            assert p == ours[p[0]], (path, p[0])


def test_both_follows_have_one_signature_and_forward_the_definitions_options() -> None:
    assert cupy_ipcpool.follow is _connect.follow
    assert _params(_connect.follow) == _params(channel_follow.follow)
    names = [p.name for p in inspect.signature(_connect.follow).parameters.values()]
    assert names == ["address", "wait", "restart_on_close", "options"]
    assert channel_follow.subscribe is DEFINITION  # what follow(**options) is checked against


def test_the_follow_docstring_names_every_option() -> None:
    doc = inspect.getdoc(_connect.follow) or ""
    part = doc.split("**options:", 1)[1].split("\n\n", 1)[0]
    named = re.findall(r"``(\w+)``", part)
    expected = [k for k in _keywords(DEFINITION) if k not in WAITING]
    assert named == expected, "follow()'s docstring: list subscribe's options"


@pytest.mark.parametrize("follow", [_connect.follow, channel_follow.follow])
def test_follow_checks_options_against_the_definition(follow: Callable[..., Any]) -> None:
    for name in _keywords(DEFINITION):
        if name in WAITING:
            continue
        value = inspect.signature(DEFINITION).parameters[name].default
        follow("/nonexistent/sock", **{name: value}).close()  # taken, nothing connects yet
    with pytest.raises(UsageError, match="follow"):
        follow("/nonexistent/sock", colour="blue")
