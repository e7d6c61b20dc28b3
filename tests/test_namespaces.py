"""Peers in another PID and mount namespace fetch a pool's fds (CPU tier, real namespaces).

The consumer runs under ``unshare --pid --fork --mount-proc``: its own PID
namespace (it is pid 1 there; the exporter's pid names nothing, or another
process) and its own mount namespace, with the socket directory still shared.
It runs as this test's uid, or drops to uid 65534 (no capabilities, so no
``CAP_SYS_PTRACE``).  The exporter is this test process: memfds served by an
:class:`FdServer`, described by a real :class:`PoolDescriptor` that travels as
bytes.  Needs root (``unshare`` of a PID namespace, and the drop to 65534);
skips with the reason where either is refused.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from _namespaces import (
    CHECKOUT,
    CONSUMER_HEAD,
    DROP_UID,
    NOBODY,
    UNSHARE,
    shared_socket_dir,
    unshare_skip_reason,
)

from cupy_ipcpool._errors import PeerRefusedError, TransportError
from cupy_ipcpool._handles import PoolDescriptor, own_pid_namespace
from cupy_ipcpool._transport import FdServer, fetch_fds, process_start_time

pytestmark = pytest.mark.timeout(120)

CHILD_TIMEOUT_S = 60

#: The consumer: drop to the uid asked for, import this checkout, fetch as told, report JSON.
CHILD = (
    CONSUMER_HEAD
    + r"""    # imported first: the interpreter's own files may be private to root (a pyenv in
    # /root); what the fetch does after the drop runs as that uid
    from cupy_ipcpool._handles import PoolDescriptor
    from cupy_ipcpool._transport import fetch_fds
"""
    + DROP_UID
    + r"""    desc = PoolDescriptor.from_bytes(bytes.fromhex(args["desc"]))
    kw = dict(pid=desc.exporter_pid, start_time=desc.exporter_start_time, fds=desc.fds,
              socket_path=desc.socket_path, token=desc.pool_id, method=args["method"],
              exporter_uid=desc.exporter_uid)
    if args["with_namespace"]:  # as attach() does; without: a descriptor that does not say
        kw["pid_namespace"] = desc.exporter_pid_namespace
    fds_before = len(os.listdir("/proc/self/fd"))
    try:
        got = fetch_fds(**kw)
    except OSError as exc:
        out["error"] = [type(exc).__name__, exc.errno, str(exc)]
    else:
        out["data"] = [os.pread(fd, 4096, 0).hex() for fd in got]
        out["cloexec"] = not any(os.get_inheritable(fd) for fd in got)
        for fd in got:
            os.close(fd)
    out["fds_leaked"] = len(os.listdir("/proc/self/fd")) - fds_before
except (ImportError, PermissionError) as exc:  # a file this uid cannot read
    out["unreadable"] = f"{type(exc).__name__}: {exc}"
except BaseException as exc:
    out["crash"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""
)


def _content(i: int) -> bytes:
    return f"slot {i} of a memfd pool: {i * 7919:08d}".encode()


def _unshare(*command: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": CHECKOUT}
    return subprocess.run(
        [*UNSHARE, *prefix, *command],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=env,
        cwd="/",
        check=False,
    )


@pytest.fixture(scope="module")
def namespaces() -> None:
    env = {**os.environ, "PYTHONPATH": CHECKOUT}
    reason = unshare_skip_reason(CHILD_TIMEOUT_S, env=env, cwd="/")
    if reason is not None:
        pytest.skip(reason)


def _nobody_skip_reason() -> str | None:
    """Why the consumer cannot drop to uid 65534 here (None: it can).

    The consumer imports what it needs first and drops after, so a checkout
    or interpreter private to root (a 0700 home) does not stop it; a file it
    still has to read after the drop makes it skip with that file's error.
    """
    if os.geteuid() != 0:
        return "dropping to uid 65534 needs root"
    return None


@pytest.fixture(scope="module", params=["same-uid", "uid-65534"])
def consumer_uid(request: pytest.FixtureRequest, namespaces: None) -> int | None:
    """None: the consumer keeps this test's uid; else the uid it drops to."""
    if request.param == "same-uid":
        return None
    reason = _nobody_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return NOBODY


@pytest.fixture
def shared_dir() -> Iterator[str]:
    """The socket directory both namespaces see, traversable by uid 65534."""
    with shared_socket_dir("ipcpool-ns-") as path:
        yield path


class MemfdExporter:
    """This process exports memfds through an fd server at ``path``, as a pool would."""

    def __init__(self, path: str, allowed_uids: set[int], n: int = 3) -> None:
        self.fds = []
        for i in range(n):
            fd = os.memfd_create(f"ns-test-{i}", os.MFD_CLOEXEC)
            os.write(fd, _content(i))
            self.fds.append(fd)
        token = os.urandom(16)
        self.server = FdServer(self.fds, token=token, path=path, allowed_uids=allowed_uids)
        self.desc = PoolDescriptor(
            pool_id=token,
            exporter_pid=os.getpid(),
            exporter_start_time=process_start_time(os.getpid()),
            exporter_uid=os.geteuid(),
            device_uuid=b"\x00" * 16,
            device_ordinal=0,
            num_slots=n,
            slot_nbytes=4096,
            alloc_nbytes=4096,
            fds=tuple(self.fds),
            socket_path=self.server.path,
        )

    def close(self) -> None:
        self.server.close()
        for fd in self.fds:
            os.close(fd)

    def __enter__(self) -> MemfdExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _consume(
    desc: PoolDescriptor | bytes,
    uid: int | None,
    *,
    method: str = "auto",
    with_namespace: bool = True,
    prefix: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run the consumer in its own PID and mount namespace; return its report."""
    data = desc if isinstance(desc, bytes) else desc.to_bytes()
    args = {"desc": data.hex(), "uid": uid, "method": method, "with_namespace": with_namespace}
    done = _unshare(*prefix, sys.executable, "-c", CHILD, json.dumps(args))
    assert done.returncode == 0, f"consumer exited {done.returncode}: {done.stderr}"
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if "unreadable" in report:
        pytest.skip(f"uid {uid} cannot read a file it needs ({CHECKOUT}): {report['unreadable']}")
    assert "crash" not in report, report["crash"]
    assert report["pid"] == 1  # its own PID namespace...
    assert report["pid_namespace"] != own_pid_namespace()
    assert report["fds_leaked"] == 0
    if uid is not None:
        assert report["uid"] == uid
        assert int(report["cap_eff"], 16) == 0  # no CAP_SYS_PTRACE, no capability at all
    return report


def _expect_data(report: dict[str, Any], n: int = 3) -> None:
    assert "error" not in report, f"the consumer failed: {report['error']}"
    assert [bytes.fromhex(h) for h in report["data"]] == [_content(i) for i in range(n)]
    assert report["cloexec"]


# ------------------------------------------------------------------ the honest path


@pytest.mark.parametrize("with_namespace", [True, False], ids=["descriptor-ns", "ns-unknown"])
def test_auto_fetches_over_the_shared_socket(
    consumer_uid: int | None, shared_dir: str, with_namespace: bool
) -> None:
    """``auto`` takes the socket when the exporter's pid is not visible: the bytes arrive.

    ``descriptor-ns``: the descriptor names the exporter's PID namespace, so
    pidfd is not tried.  ``ns-unknown``: the consumer does not pass it (a
    descriptor that cannot say): pidfd_open finds no such pid (ESRCH) and
    ``auto`` falls back.
    """
    with MemfdExporter(os.path.join(shared_dir, "fds.sock"), {NOBODY}) as ex:
        assert ex.desc.exporter_pid != 1
        _expect_data(_consume(ex.desc, consumer_uid, with_namespace=with_namespace))
        assert ex.server.allowed_uids == {os.geteuid(), NOBODY}


@pytest.mark.parametrize("with_namespace", [True, False], ids=["descriptor-ns", "ns-unknown"])
def test_a_pid_naming_another_process_there_is_not_taken_for_the_exporter(
    consumer_uid: int | None, shared_dir: str, with_namespace: bool
) -> None:
    """The exporter's pid may name a live process in the consumer's namespace.

    Here it names the consumer itself (pid 1 there), whose fds 0-2 are its
    stdio: pidfd must not hand those out as slots.  With the namespace in the
    descriptor pidfd is not tried; without it the start time tells them apart.
    """
    with MemfdExporter(os.path.join(shared_dir, "fds.sock"), {NOBODY}) as ex:
        fields = {k: getattr(ex.desc, k) for k in ex.desc.__dataclass_fields__ if k != "_local"}
        foreign = PoolDescriptor(**{**fields, "exporter_pid": 1, "fds": (0, 1, 2)})
        # the fd server sends the exporter's memfds, not the consumer's stdio
        _expect_data(_consume(foreign, consumer_uid, with_namespace=with_namespace))


# ------------------------------------------------------------------ errors that say why


def test_pidfd_alone_names_the_other_namespace(consumer_uid: int | None, shared_dir: str) -> None:
    with MemfdExporter(os.path.join(shared_dir, "fds.sock"), {NOBODY}) as ex:
        report = _consume(ex.desc, consumer_uid, method="pidfd")
    kind, err, msg = report["error"]
    assert (kind, err) == ("TransportError", errno.ESRCH)
    assert "another PID namespace" in msg and ex.desc.socket_path in msg
    assert "has exited" not in msg


def test_socket_directory_not_shared_says_both_causes_and_the_fix(
    consumer_uid: int | None, shared_dir: str
) -> None:
    """The consumer's mount namespace hides the socket directory (a tmpfs over it)."""
    with MemfdExporter(os.path.join(shared_dir, "fds.sock"), {NOBODY}) as ex:
        hide = ("sh", "-c", f'mount -t tmpfs none {shared_dir} && exec "$@"', "sh")
        report = _consume(ex.desc, consumer_uid, prefix=hide)
    kind, err, msg = report["error"]
    assert kind == "TransportError" and err == errno.ENOENT
    assert "pidfd_getfd could not see the exporter: it runs in another PID namespace" in msg
    assert f"no fd server at {ex.desc.socket_path}" in msg
    assert "not visible from this process" in msg and "socket_path=" in msg


def test_socket_refusal_says_both_causes(consumer_uid: int | None, shared_dir: str) -> None:
    """The fd server does not allow the consumer's uid: the refusal and the namespace, both."""
    # another uid is allowed (so the socket is 0666 and the server itself refuses), not 65534
    with MemfdExporter(os.path.join(shared_dir, "fds.sock"), {NOBODY - 1}) as ex:
        report = _consume(ex.desc, consumer_uid)
        if consumer_uid is None:
            _expect_data(report)  # the exporter's own uid is always allowed
            return
    kind, err, msg = report["error"]
    assert (kind, err) == (PeerRefusedError.__name__, errno.EACCES)
    assert "another PID namespace" in msg and "refused this process's uid 65534" in msg


@pytest.mark.parametrize("with_namespace", [True, False], ids=["descriptor-ns", "ns-unknown"])
def test_an_exited_exporter_is_reported_as_such(
    consumer_uid: int | None, shared_dir: str, with_namespace: bool
) -> None:
    """SIGKILLed exporter (its socket file left behind): no server, from either namespace."""
    path = os.path.join(shared_dir, "fds.sock")
    exporter = subprocess.Popen(
        [sys.executable, "-c", _EXPORT_AND_WAIT, path],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": CHECKOUT},
    )
    try:
        assert exporter.stdout is not None
        desc = bytes.fromhex(exporter.stdout.readline().decode().strip())
    finally:
        exporter.send_signal(signal.SIGKILL)
        exporter.wait(CHILD_TIMEOUT_S)
        if exporter.stdout is not None:
            exporter.stdout.close()
    assert os.path.exists(path)  # left behind: connecting is refused
    pid = PoolDescriptor.from_bytes(desc).exporter_pid
    kind, err, msg = _consume(desc, consumer_uid, with_namespace=with_namespace)["error"]
    assert kind == "TransportError"
    if with_namespace:
        assert err == errno.ECONNREFUSED
        assert "another PID namespace" in msg
        assert "the exporter has exited or closed its fd server" in msg
    else:
        assert err == errno.ESRCH
        assert msg.startswith(f"[ESRCH] the exporter has exited: no process {pid}")
    # from the exporter's own namespace: exited, said plainly, the socket not asked
    with pytest.raises(TransportError) as ei:
        fetch_fds(
            pid=pid,
            start_time=PoolDescriptor.from_bytes(desc).exporter_start_time,
            fds=(3,),
            socket_path=path,
            token=b"x",
            pid_namespace=own_pid_namespace(),
        )
    assert ei.value.errno == errno.ESRCH
    assert "the exporter process has exited" in str(ei.value)
    assert "namespace" not in str(ei.value)


#: An exporter process: serve one memfd at argv[1] (allowing uid 65534), print the
#: descriptor, wait to be killed.
_EXPORT_AND_WAIT = r"""
import os, sys, time
from cupy_ipcpool._handles import PoolDescriptor
from cupy_ipcpool._transport import FdServer, process_start_time
fd = os.memfd_create("ns-test-exited")
tok = os.urandom(16)
server = FdServer([fd], token=tok, path=sys.argv[1], allowed_uids={65534})
desc = PoolDescriptor(pool_id=tok, exporter_pid=os.getpid(),
    exporter_start_time=process_start_time(os.getpid()), exporter_uid=os.geteuid(),
    device_uuid=bytes(16), device_ordinal=0, num_slots=1, slot_nbytes=4096,
    alloc_nbytes=4096, fds=(fd,), socket_path=server.path)
print(desc.to_bytes().hex(), flush=True)
time.sleep(120)
"""


#: A publisher core in a PID namespace of its own: a subscriber from outside is a process
#: its kernel cannot name (SO_PEERCRED pid 0); report what it knows of it.
_PUBLISH_AND_REPORT = r"""
import json, sys, time
from cupy_ipcpool.channel._handshake import Welcome
from cupy_ipcpool.channel._publisher_core import PublisherCore
joined = []
core = PublisherCore(sys.argv[1], 2, welcome=Welcome(), on_join=joined.append)
print("ready", flush=True)
deadline = time.monotonic() + 30
while not joined and time.monotonic() < deadline:
    core.poll(0.05)
print(json.dumps({"pid": joined[0].pid, "peer_pid": joined[0].peer_pid}), flush=True)
core.close()
"""


def test_a_subscriber_the_kernel_cannot_name_is_never_watched_by_its_claimed_pid(
    namespaces: None, shared_dir: str
) -> None:
    """The pid a subscriber claims in HELLO is a number of its own namespace: the publisher
    must not watch that number for the subscriber's death (it would name some other process
    there, whose exit would make the publisher write a live reader's flags)."""
    from cupy_ipcpool.channel._subscriber_core import SubscriberCore

    address = os.path.join(shared_dir, "pub.sock")
    env = {**os.environ, "PYTHONPATH": CHECKOUT}
    with subprocess.Popen(
        [*UNSHARE, sys.executable, "-c", _PUBLISH_AND_REPORT, address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd="/",
    ) as pub:
        try:
            assert pub.stdout is not None and pub.stderr is not None
            assert pub.stdout.readline().strip() == "ready", pub.stderr.read()
            with SubscriberCore(address, timeout=20):
                line = pub.stdout.readline()
            report = json.loads(line)
            assert report["pid"] == os.getpid()  # the claim, shown for the user
            assert report["peer_pid"] == 0  # the kernel's: nobody to watch
        finally:
            pub.kill()
            pub.wait(10)
