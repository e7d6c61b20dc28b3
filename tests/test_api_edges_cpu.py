"""CPU tier: the API edges a CuPy user meets (issue 45, point 5).

A ``cupy.cuda.Device`` is taken wherever a device ordinal is, through one
helper (``_args.device_ordinal``), and every entry point checks its device
before it connects or looks for a GPU.  Options are keyword-only by one rule
(``_args``: the call's subject positional, every option that says *how*
keyword-only; a call that only waits takes its timeout positionally); a call
that passed an option by position before still works, with a
``DeprecationWarning`` naming the keyword, and the keyword call warns nothing.
No GPU needed: GPU classes are checked on closed instances, where the
argument handling runs before anything else.
"""

from __future__ import annotations

import inspect
import os
import sys
import types
import typing
import warnings
from typing import Any

import numpy as np
import pytest

import cupy_ipcpool as cip
from cupy_ipcpool import _args, _driver, _pool
from cupy_ipcpool.channel import Follower, Frame, Publisher, Subscriber
from cupy_ipcpool.remote import (
    DeviceSource,
    HostChannelPublisher,
    HostChannelSubscriber,
    HostFrame,
    RemoteSubscriber,
)
from cupy_ipcpool.remote._host import spec_of
from tests._remote import wait_for


class FakeDevice:
    """What ``cupy.cuda.Device(n)`` offers the library: an integer ``id``."""

    def __init__(self, ident: object) -> None:
        self.id = ident


# -- one helper turns a device into its ordinal ---------------------------------------------


@pytest.mark.parametrize(
    ("given", "ordinal"),
    [(0, 0), (3, 3), (np.int64(2), 2), (FakeDevice(0), 0), (FakeDevice(np.int32(5)), 5)],
)
def test_an_ordinal_or_a_device_object_gives_the_ordinal(given: object, ordinal: int) -> None:
    got = _args.device_ordinal(given)
    assert got == ordinal and type(got) is int


def test_the_helper_names_cupy_device_when_cupy_is_importable() -> None:
    cupy = pytest.importorskip("cupy")  # cupy.cuda.Device(n) needs no GPU to be made
    assert _args.device_ordinal(cupy.cuda.Device(0)) == 0
    assert _args.device_ordinal(cupy.cuda.Device(7)) == 7


@pytest.mark.parametrize(
    ("given", "error", "words"),
    [
        (True, cip.UsageTypeError, "not bool"),
        (False, cip.UsageTypeError, "not bool"),
        ("0", cip.UsageTypeError, "not str"),
        (0.0, cip.UsageTypeError, "not float"),
        (None, cip.UsageTypeError, "not NoneType"),
        (FakeDevice("0"), cip.UsageTypeError, "not FakeDevice"),
        (FakeDevice(True), cip.UsageTypeError, "not FakeDevice"),
        (-1, cip.UsageError, "non-negative ordinal, got -1"),
        (FakeDevice(-2), cip.UsageError, "non-negative ordinal, got -2"),
    ],
)
def test_what_is_no_device_is_refused_clearly(given: object, error: type, words: str) -> None:
    with pytest.raises(error, match=words) as info:
        _args.device_ordinal(given)
    if error is cip.UsageTypeError:
        assert isinstance(info.value, TypeError)
        assert "a device ordinal (an int) or a cupy.cuda.Device" in str(info.value)
    assert isinstance(info.value, ValueError)  # every UsageError is one


def test_none_stays_the_callers_default_device() -> None:
    assert _args.optional_device(None) is None
    assert _args.optional_device(FakeDevice(1)) == 1
    with pytest.raises(cip.UsageTypeError):
        _args.optional_device(True)


# -- every public entry point checks its device first ---------------------------------------


@pytest.fixture
def no_gpu_lookup(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the ordinal the pool asks the driver for, and stop there (no GPU needed)."""
    asked: list[int] = []

    def record(ordinal: int) -> Any:
        asked.append(ordinal)
        raise cip.CudaUnavailableError("stopped by the test")

    monkeypatch.setattr(_driver, "require_vmm_device", record)
    return asked


def test_ipc_pool_takes_a_device_object(no_gpu_lookup: list[int]) -> None:
    for cls in (cip.IpcPool, cip.IPCBufferManager):
        with pytest.raises(cip.CudaUnavailableError, match="stopped by the test"):
            cls(2, 4096, device=FakeDevice(1))
    assert no_gpu_lookup == [1, 1]
    assert type(no_gpu_lookup[0]) is int


@pytest.mark.parametrize("cls", [cip.IpcPool, cip.IPCBufferManager])
@pytest.mark.parametrize(
    ("device", "error"),
    [(True, cip.UsageTypeError), ("0", cip.UsageTypeError), (-1, cip.UsageError)],
)
def test_ipc_pool_refuses_a_bad_device_before_the_driver(
    no_gpu_lookup: list[int], cls: type, device: object, error: type
) -> None:
    with pytest.raises(error, match="device"):
        cls(2, 4096, device=device)
    assert no_gpu_lookup == []


def _descriptor() -> cip.PoolDescriptor:
    return cip.PoolDescriptor(
        pool_id=b"\x01" * 16,
        exporter_pid=os.getpid(),
        exporter_uid=os.geteuid(),
        exporter_start_time=1,
        device_uuid=b"\x02" * 16,
        device_ordinal=0,
        num_slots=2,
        slot_nbytes=4096,
        alloc_nbytes=4096,
        fds=(1000, 1001),  # never used: the device is checked first
    )


@pytest.mark.parametrize(("device", "error"), [(True, cip.UsageTypeError), (-1, cip.UsageError)])
def test_attach_refuses_a_bad_device_before_the_gpu(device: object, error: type) -> None:
    with pytest.raises(error, match="device"):
        cip.attach(_descriptor(), device=device)


def test_seed_import_refuses_a_bad_device_first() -> None:
    with pytest.raises(cip.UsageTypeError, match="device"):
        cip.import_seed_buffers([[os.getpid(), 0]], 4096, device=True)
    with pytest.raises(cip.UsageError, match="non-negative"):
        cip.import_seed_buffers([[os.getpid(), 0]], 4096, device=FakeDevice(-1))


def _missing(tmp_path: Any) -> str:
    return str(tmp_path / "nobody.sock")  # nothing listens: a device checked later would
    # show as a TransportError (no publisher), not as the usage error


@pytest.mark.parametrize(
    "call",
    [
        lambda a, d: cip.subscribe(a, device=d),
        lambda a, d: cip.channel.subscribe(a, device=d),
        lambda a, d: cip.channel.subscribe(a, device=d, wait=30.0),
        lambda a, d: Subscriber(a, device=d),
        lambda a, d: cip.follow(a, device=d),
        lambda a, d: DeviceSource(a, device=d),
        lambda a, d: cip.remote.serve(a, device=d, insecure=True),
        lambda a, d: cip.remote.DeviceSlots(2, 4096, device=d),
    ],
    ids=[
        "subscribe",
        "channel.subscribe",
        "channel.subscribe-wait",
        "Subscriber",
        "follow",
        "DeviceSource",
        "serve",
        "DeviceSlots",
    ],
)
def test_local_entry_points_check_the_device_before_connecting(tmp_path: Any, call: Any) -> None:
    address = _missing(tmp_path)
    with pytest.raises(cip.UsageTypeError, match="device must be a device ordinal"):
        call(address, True)
    with pytest.raises(cip.UsageError, match="non-negative ordinal, got -3"):
        call(address, FakeDevice(-3))


@pytest.mark.parametrize(
    "call",
    [
        lambda d: cip.subscribe("ucx://127.0.0.1:9", device=d, insecure=True),
        lambda d: cip.remote.subscribe("ucx://127.0.0.1:9", device=d, insecure=True),
        lambda d: RemoteSubscriber("ucx://127.0.0.1:9", device=d, insecure=True),
        lambda d: cip.remote.Relay("ucx://127.0.0.1:9", "/tmp/r.sock", device=d, insecure=True),
        lambda d: cip.remote.relay("ucx://127.0.0.1:9", "/tmp/r.sock", device=d, insecure=True),
    ],
    ids=["subscribe", "remote.subscribe", "RemoteSubscriber", "Relay", "relay"],
)
def test_remote_entry_points_check_the_device_before_connecting(call: Any) -> None:
    # before UCXX is looked for (not installed here) and before anything connects
    with pytest.raises(cip.UsageTypeError, match="device must be a device ordinal"):
        call("1")
    with pytest.raises(cip.UsageError, match="non-negative ordinal"):
        call(-1)


def test_the_device_parameters_say_they_take_a_device_object() -> None:
    """Every public ``device`` parameter is annotated with the one alias, ``DeviceLike``
    (but the constructors the library calls with the ordinal it resolved)."""
    made_by_the_library = {"PeerPool", "SeedBuffers"}
    found = []
    for module in (cip, cip.channel, cip.remote):
        for name in module.__all__:
            if name in made_by_the_library:
                continue
            obj = getattr(module, name)
            target = obj.__init__ if inspect.isclass(obj) else obj
            if not callable(target):
                continue
            try:
                params = inspect.signature(target).parameters
            except (TypeError, ValueError):
                continue
            if "device" in params:
                found.append(f"{module.__name__}.{name}")
                assert "DeviceLike" in str(params["device"].annotation), (name, params["device"])
    assert len(found) >= 14, found


# -- options are keyword-only, with a deprecation where a call changed ----------------------

#: (method, the keyword-only options it now has) for every method whose options changed.
CHANGED = [
    (Subscriber.recv, ("timeout", "stream")),
    (Frame.release, ("stream",)),
    (Publisher.acquire, ("timeout", "stream")),
    (Publisher.frame, ("timeout", "stream")),
    (Publisher.close, ("timeout",)),
    (Follower.recv, ("timeout",)),
    (RemoteSubscriber.recv, ("timeout", "stream")),
    (DeviceSource.recv, ("timeout",)),
    (HostChannelSubscriber.recv, ("timeout",)),
    (HostFrame.release, ("stream",)),
    (HostChannelPublisher.acquire, ("timeout",)),
    (HostChannelPublisher.publish, ("metadata",)),
    (HostChannelPublisher.close, ("linger",)),
]


def _ids(changed: list[tuple[Any, Any]]) -> list[str]:
    return [fn.__qualname__ for fn, _ in changed]


@pytest.mark.parametrize(("method", "options"), CHANGED, ids=_ids(CHANGED))
def test_the_signature_shown_is_the_keyword_only_one(method: Any, options: tuple) -> None:
    params = inspect.signature(method).parameters
    assert not any(p.kind is p.VAR_POSITIONAL for p in params.values()), params
    for name in options:
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, (name, params)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="typing.get_overloads is 3.11+")
@pytest.mark.parametrize(("method", "options"), CHANGED, ids=_ids(CHANGED))
def test_type_checkers_see_the_keyword_only_form_first(method: Any, options: tuple) -> None:
    """Two overloads: the keyword-only form, and the old one marked ``@deprecated``."""
    first, old = typing.get_overloads(method)
    params = inspect.signature(first).parameters
    assert not any(p.kind is p.VAR_POSITIONAL for p in params.values())
    assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in options)
    assert any(p.kind is p.VAR_POSITIONAL for p in inspect.signature(old).parameters.values())


def test_the_public_api_has_no_positional_timeout_or_stream_but_in_waits() -> None:
    """The rule, over every public method: ``timeout``, ``stream``, ``metadata``, ``linger``
    are keyword-only, except a ``timeout`` that is the only parameter of a call that only
    waits (``poll``, ``wait``: ``Event.wait(timeout)``); protocols the library calls on
    objects the user implements (``LeaseSource``, ``SlotMemory``) keep theirs."""
    options = {"timeout", "stream", "metadata", "linger"}
    waits = {"poll", "wait"}
    protocols = {"LeaseSource", "SlotMemory", "DeviceSlots", "HostSlots"}
    offenders = []
    for module in (cip, cip.channel, cip.remote):
        for cls_name in module.__all__:
            cls = getattr(module, cls_name)
            if not inspect.isclass(cls) or issubclass(cls, BaseException):
                continue
            if cls_name in protocols:
                continue
            for name, member in inspect.getmembers(cls, inspect.isfunction):
                if name.startswith("_") or not member.__module__.startswith("cupy_ipcpool"):
                    continue
                params = list(inspect.signature(member).parameters.values())[1:]
                for p in params:
                    if p.name in options and p.kind is p.POSITIONAL_OR_KEYWORD:
                        if name in waits and len(params) == 1 and p.name == "timeout":
                            continue
                        offenders.append(f"{cls_name}.{name}({p.name})")
    assert not offenders, offenders


# ---- the host tier runs on the CPU: the old calls work and warn, the new ones do not


@pytest.fixture
def host_channel(tmp_path: Any) -> Any:
    path = str(tmp_path / "h.sock")
    with HostChannelPublisher(path, 2, 4096) as pub, HostChannelSubscriber(path) as sub:
        wait_for(lambda: pub.subscribers, poll=lambda: pub.poll(0.01), what=lambda: "no join")
        yield pub, sub


def _one_deprecation(record: list[warnings.WarningMessage], keyword: str) -> str:
    assert len(record) == 1, [str(w.message) for w in record]
    w = record[0]
    assert w.category is DeprecationWarning
    text = str(w.message)
    assert f"{keyword}=..." in text and "by position is deprecated" in text, text
    assert w.filename == __file__, w.filename  # attributed to the caller's line
    return text


def test_host_tier_positional_options_work_with_a_warning(host_channel: Any) -> None:
    pub, sub = host_channel
    data = np.arange(16, dtype=np.uint32)
    specs = (spec_of(data),)
    with pytest.warns(DeprecationWarning) as record:
        slot = pub.acquire(5.0)
    text = _one_deprecation(record.list, "timeout")
    assert text.startswith("HostChannelPublisher.acquire(): passing timeout by position"), text
    pub.arrays(slot, specs)[0][...] = data
    with pytest.warns(DeprecationWarning) as record:
        seq = pub.publish(slot, specs, b"meta")
    _one_deprecation(record.list, "metadata")
    with pytest.warns(DeprecationWarning) as record:
        frame = sub.recv(5.0)
    _one_deprecation(record.list, "timeout")
    assert frame.seq == seq and frame.metadata == b"meta"
    np.testing.assert_array_equal(frame.array, data)
    with pytest.warns(DeprecationWarning) as record:
        frame.release(None)
    _one_deprecation(record.list, "stream")
    assert frame.released
    with pytest.warns(DeprecationWarning) as record:
        pub.close(0.0)
    _one_deprecation(record.list, "linger")


def test_host_tier_keyword_options_do_not_warn(host_channel: Any) -> None:
    pub, sub = host_channel
    data = np.arange(8, dtype=np.float32)
    specs = (spec_of(data),)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        slot = pub.acquire(timeout=5.0)
        pub.arrays(slot, specs)[0][...] = data
        pub.publish(slot, specs, metadata=b"m")
        frame = sub.recv(timeout=5.0)
        np.testing.assert_array_equal(frame.array, data)
        frame.release(stream=None)
        pub.send(data, metadata=b"n", timeout=5.0)
        with sub.recv(timeout=5.0) as again:
            assert again.metadata == b"n"
        pub.poll(0.0)  # a call that only waits keeps its timeout positional
        pub.close(linger=0.0)


def test_an_option_both_by_position_and_by_keyword_is_refused(host_channel: Any) -> None:
    pub, _sub = host_channel
    with pytest.raises(cip.UsageTypeError, match="timeout twice"):
        pub.acquire(1.0, timeout=2.0)
    with pytest.raises(TypeError, match="takes timeout= by keyword; got 2 positional"):
        pub.acquire(1.0, 2.0)


# ---- the GPU frame, the follower: made on the CPU with stand-ins


class _Lease:
    def __init__(self) -> None:
        self.released = False
        self.stream: Any = "unset"

    def release(self, stream: Any = None) -> None:
        self.released = True
        self.stream = stream


def test_frame_release_by_position_warns_and_releases_on_that_stream() -> None:
    for cls in (Frame, cip.remote.RemoteFrame):
        lease = _Lease()
        frame = cls(0, 0, (), b"", lease)
        with pytest.warns(DeprecationWarning) as record:
            frame.release("the stream")
        _one_deprecation(record.list, "stream")
        assert lease.released and lease.stream == "the stream"
        lease = _Lease()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cls(1, 0, (), b"", lease).release(stream="s2")
        assert lease.stream == "s2"


class _Receiver:
    def __init__(self) -> None:
        self.asked: list[Any] = []
        self.closed = False

    def recv(self, *, timeout: float | None = None, stream: Any = None) -> Any:
        self.asked.append((timeout, stream))
        return "frame"

    def close(self) -> None:
        self.closed = True


def test_follower_recv_by_position_warns_and_keeps_the_timeout() -> None:
    receiver = _Receiver()
    follower: Follower[Any] = Follower(lambda: receiver, "/nowhere")
    with pytest.warns(DeprecationWarning) as record:
        assert follower.recv(7.0) == "frame"
    _one_deprecation(record.list, "timeout")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert follower.recv(timeout=None, stream="s") == "frame"
    timeout, stream = receiver.asked[0]
    assert 0 < timeout <= 7.0 and stream is None
    assert receiver.asked[1] == (None, "s")
    follower.close()


# ---- GPU classes: the argument handling runs before anything else (closed instances)


def _closed(cls: type, **attrs: Any) -> Any:
    obj = object.__new__(cls)
    for name, value in attrs.items():
        setattr(obj, name, value)
    return obj


@pytest.mark.parametrize(
    ("make", "call", "keyword"),
    [
        (lambda: _closed(Subscriber, _closed=True), lambda o: o.recv(1.0), "timeout"),
        (lambda: _closed(RemoteSubscriber, _closed=True), lambda o: o.recv(1.0), "timeout"),
        (lambda: _closed(Publisher, _closed=True), lambda o: o.frame(1.0), "timeout"),
    ],
    ids=["Subscriber.recv", "RemoteSubscriber.recv", "Publisher.frame"],
)
def test_gpu_methods_warn_then_answer_as_before(make: Any, call: Any, keyword: str) -> None:
    obj = make()
    with pytest.warns(DeprecationWarning) as record, pytest.raises(cip.PoolClosedError):
        call(obj)
    _one_deprecation(record.list, keyword)


def test_publisher_acquire_and_close_by_position_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    pub = _closed(Publisher, _closed=True)
    taken: list[Any] = []
    token = types.SimpleNamespace(slot=4)
    monkeypatch.setattr(Publisher, "_acquire", lambda self, t, s: taken.append((t, s)) or token)
    with pytest.warns(DeprecationWarning) as record:
        assert pub.acquire(3.0) == 4
    _one_deprecation(record.list, "timeout")
    assert taken == [(3.0, None)]
    with pytest.warns(DeprecationWarning) as record:
        pub.close(1.0)  # closed already: returns
    _one_deprecation(record.list, "timeout")


def test_the_slow_path_is_the_only_difference_of_the_keyword_call() -> None:
    """The keyword call runs the method's own body: no wrapper between caller and method."""
    for method, _options in CHANGED:
        assert not hasattr(method, "__wrapped__"), method
        assert method.__code__.co_flags & inspect.CO_VARARGS, method  # the ``*args`` catch


def test_a_pool_still_refuses_bad_sizes_first(no_gpu_lookup: list[int]) -> None:
    with pytest.raises(cip.UsageTypeError, match="num_slots must be an int"):
        _pool.IpcPool(True, 4096, device=FakeDevice(0))
    with pytest.raises(cip.UsageError, match="slot_nbytes"):
        _pool.IpcPool(2, 0, device=0)
    assert no_gpu_lookup == []
