"""CPU tier of import_seed_buffers: validation, sizes, and the fd half for real.

A child process stands in for a C++ ``IPCBufferManager``: it holds memfds
(where the seed holds exported CUDA allocations), prints one ``{pid, fd}``
pair per buffer, waits for the consumer and checks what the consumer wrote
back through its fetched fds.  The parent fetches the fds by the path
``import_seed_buffers`` takes up to its first driver call.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import cupy_ipcpool as cip
from cupy_ipcpool import _seedpeer
from cupy_ipcpool._errors import (
    CudaUnavailableError,
    DescriptorError,
    TransportError,
    UsageError,
    UsageTypeError,
)
from cupy_ipcpool._seedpeer import fetch_seed_fds, import_seed_buffers, seed_alloc_nbytes
from cupy_ipcpool._transport import fetch_fds
from tests import _pipe_child
from tests._fds import fds_opened_since, open_fds
from tests.skips import no_driver

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
NOBODY = 65534
JOIN_S = 30
CTX = _pipe_child.CHILDREN  # forkserver children (tests/_pipe_child.py)

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to start a child that drops to uid 65534"
)

# The stand-in producer: memfds with known bytes, one "BUFFER i pid fd" line each,
# READY, then it waits for a line from the consumer and checks the replies.
PRODUCER = r"""
import os, sys
n = int(sys.argv[1])
def content(i): return b"seed buffer %d payload %d" % (i, i * 7919)
def reply(i): return b"consumer wrote %d" % (i * 31,)
fds = []
for i in range(n):
    fd = os.memfd_create("seed-buffer-%d" % i)
    os.write(fd, content(i))
    fds.append(fd)
for i, fd in enumerate(fds):
    print("BUFFER", i, os.getpid(), fd, flush=True)
print("READY", flush=True)
if sys.stdin.readline().strip() != "VERIFY":
    sys.exit(3)
bad = [i for i, fd in enumerate(fds) if os.pread(fd, 64, 0) != reply(i)]
print("OK" if not bad else "MISMATCH %r" % (bad,), flush=True)
sys.exit(1 if bad else 0)
"""


def _content(i: int) -> bytes:
    return b"seed buffer %d payload %d" % (i, i * 7919)


def _reply(i: int) -> bytes:
    return b"consumer wrote %d" % (i * 31,)


class Producer:
    """The stand-in producer process and the pairs it printed."""

    def __init__(self, n: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PRODUCER, str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pairs: list[list[int]] = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            words = line.split()
            if words == ["READY"]:
                break
            assert words[0] == "BUFFER" and int(words[1]) == len(self.pairs), line
            self.pairs.append([int(words[2]), int(words[3])])
        assert len(self.pairs) == n, "the producer did not report its buffers"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def verify(self) -> tuple[int, str]:
        out, _ = self.proc.communicate("VERIFY\n", timeout=JOIN_S)
        return self.proc.returncode, out.strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.communicate("", timeout=JOIN_S)  # EOF: it exits without verifying


@pytest.fixture
def producer() -> Iterator[Producer]:
    p = Producer(3)
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def exited_producer() -> Producer:
    p = Producer(2)
    p.stop()
    assert p.proc.returncode == 3
    return p


# -- the fd half, for real -----------------------------------------------------


def test_fetches_every_buffer_and_the_producer_sees_the_writes(producer: Producer) -> None:
    before = open_fds()
    fds = fetch_seed_fds(producer.pairs)
    try:
        assert len(fds) == 3 and len(set(fds)) == 3
        assert not any(os.get_inheritable(fd) for fd in fds), "fetched fds must be CLOEXEC"
        assert [os.pread(fd, 64, 0) for fd in fds] == [_content(i) for i in range(3)]
        for i, fd in enumerate(fds):
            os.ftruncate(fd, 0)
            os.pwrite(fd, _reply(i), 0)
    finally:
        for fd in fds:
            os.close(fd)
    assert not fds_opened_since(before)
    assert producer.verify() == (0, "OK")


def test_numpy_pairs_and_integers_are_accepted(producer: Producer) -> None:
    fds = fetch_seed_fds(np.array(producer.pairs, dtype=np.int64))
    try:
        assert [os.pread(fd, 64, 0) for fd in fds] == [_content(i) for i in range(3)]
    finally:
        for fd in fds:
            os.close(fd)


def test_pairs_in_another_order_give_the_buffers_in_that_order(producer: Producer) -> None:
    fds = fetch_seed_fds([producer.pairs[2], producer.pairs[0]])
    try:
        assert [os.pread(fd, 64, 0) for fd in fds] == [_content(2), _content(0)]
    finally:
        for fd in fds:
            os.close(fd)


def _fetch_as_attach(pairs: list[list[int]]) -> list[int]:
    """What the attach() path does for these (pid, fd) pairs: ``fetch_fds`` by pidfd."""
    return fetch_fds(
        pid=pairs[0][0],
        start_time=None,
        fds=[fd for _, fd in pairs],
        socket_path=None,
        token=b"",
        method="pidfd",
    )


def test_exited_producer_is_esrch_worded_as_attach(exited_producer: Producer) -> None:
    pairs = exited_producer.pairs
    with pytest.raises(TransportError) as attach_err:
        _fetch_as_attach(pairs)
    before = open_fds()
    with pytest.raises(TransportError) as ei:
        fetch_seed_fds(pairs)
    assert ei.value.errno == errno.ESRCH
    assert "exited" in str(ei.value)
    assert ei.value.strerror.startswith(attach_err.value.strerror)
    assert "PID namespace" in ei.value.strerror
    assert not fds_opened_since(before)


def test_fd_not_open_in_the_producer_is_ebadf_and_nothing_stays_open(
    producer: Producer,
) -> None:
    pid = producer.pid
    closed_fd = 999  # a fresh interpreter has nothing open there
    pairs = [*producer.pairs[:2], [pid, closed_fd]]
    before = open_fds()
    with pytest.raises(TransportError) as ei:
        fetch_seed_fds(pairs)
    assert ei.value.errno == errno.EBADF
    assert f"fd={closed_fd}" in str(ei.value) and "no longer open" in str(ei.value)
    assert not fds_opened_since(before)  # the two fds fetched before the failure were closed


@no_driver
def test_import_closes_the_fetched_fds_when_the_driver_is_missing(producer: Producer) -> None:
    before = open_fds()
    with pytest.raises(CudaUnavailableError):
        import_seed_buffers(producer.pairs, 4096, device=0)
    assert not fds_opened_since(before)
    with pytest.raises(CudaUnavailableError):
        cip.import_seed_buffers(producer.pairs, 4096, device=0, rounding="exact")
    assert not fds_opened_since(before)


def test_import_fetches_before_any_driver_call(exited_producer: Producer) -> None:
    # with or without a driver here, the peer's death is what is reported
    before = open_fds()
    with pytest.raises(TransportError) as ei:
        import_seed_buffers(exited_producer.pairs, 4096, device=0)
    assert ei.value.errno == errno.ESRCH
    assert not fds_opened_since(before)


# -- EPERM: a consumer that the ptrace check refuses ---------------------------


def _run_dropped(conn: Any, fn: Callable[..., Any], *args: Any) -> None:
    """As uid nobody, run ``fn(*args)``; send ("ok", result) or ("err", (errno, message))."""
    try:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        conn.send(("ok", fn(*args)))
    except BaseException as exc:
        conn.send(("err", (type(exc).__name__, getattr(exc, "errno", None), str(exc))))
    finally:
        conn.close()


def _fetch_both_ways(pairs: list[list[int]]) -> tuple[str, str]:
    """The attach() path's message and fetch_seed_fds's, both for the same pairs."""
    messages = []
    for fetch in (
        lambda: _fetch_as_attach(pairs),
        lambda: fetch_seed_fds(pairs),
    ):
        try:
            fetch()
        except TransportError as exc:
            assert exc.errno == errno.EPERM, exc
            messages.append(exc.strerror)
        else:
            raise AssertionError("the fetch was not refused")
    return messages[0], messages[1]


@needs_root
def test_eperm_names_the_cause_and_the_fix() -> None:
    fds = [os.memfd_create(f"eperm-{i}") for i in range(2)]
    try:
        pairs = [[os.getpid(), fd] for fd in fds]
        parent, child = CTX.Pipe(duplex=False)
        proc = CTX.Process(target=_run_dropped, args=(child, _fetch_both_ways, pairs))
        proc.start()
        child.close()
        try:
            assert parent.poll(JOIN_S), "child did not report in time"
            kind, value = parent.recv()
        finally:
            parent.close()
            proc.join(JOIN_S)
            if proc.is_alive():
                proc.kill()
        assert kind == "ok", value
        attach_msg, seed_msg = value
        assert seed_msg.startswith(attach_msg)  # attach()'s words, then what differs
        assert "CAP_SYS_PTRACE" in seed_msg and "ptrace_scope" in seed_msg
        assert "offers no socket" in seed_msg and "IPCBufferManager" in seed_msg
    finally:
        for fd in fds:
            os.close(fd)


# -- validation: before anything is fetched ------------------------------------

P = os.getpid()


@pytest.mark.parametrize(
    ("pairs", "exc", "words"),
    [
        ("12", UsageTypeError, "sequence of [pid, fd] pairs"),
        (5, UsageTypeError, "sequence of [pid, fd] pairs"),
        (None, UsageTypeError, "sequence of [pid, fd] pairs"),
        ([P, 0], UsageTypeError, "not the pair itself"),
        ((P, 0), UsageTypeError, "not the pair itself"),
        ([], DescriptorError, "got 0 pairs"),
        ([[P, 0, 1]], DescriptorError, "has 3 items"),
        ([[P]], DescriptorError, "has 1 items"),
        ([5], UsageTypeError, "pairs[0] must be a [pid, fd] pair"),
        (["ab"], UsageTypeError, "pairs[0] must be a [pid, fd] pair"),
        ([[float(P), 0]], UsageTypeError, "two ints"),
        ([[P, True]], UsageTypeError, "two ints"),
        ([[P, "3"]], UsageTypeError, "two ints"),
        ([[0, 3]], DescriptorError, "pid 0 is out of range"),
        ([[-5, 3]], DescriptorError, "pid -5 is out of range"),
        ([[(1 << 22) + 1, 3]], DescriptorError, "out of range"),
        ([[P, -1]], DescriptorError, "fd -1 is out of range"),
        ([[P, 1 << 31]], DescriptorError, "out of range"),
        ([[P, 0], [P + 1, 1]], DescriptorError, "call of its own"),
        ([[P, 0], [P, 1], [P, 0]], DescriptorError, "pairs[2] repeats pairs[0]"),
        ([[P, i] for i in range(65537)], DescriptorError, "got 65537 pairs"),
    ],
)
def test_bad_pairs_are_refused_before_any_fetch(pairs: Any, exc: type, words: str) -> None:
    before = open_fds()
    with pytest.raises(exc) as ei:
        fetch_seed_fds(pairs)
    assert words in str(ei.value)
    with pytest.raises(exc):
        import_seed_buffers(pairs, 4096, device=0)
    assert not fds_opened_since(before)


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        (dict(buffer_step=0), UsageError, "buffer_step must be in"),
        (dict(buffer_step=-4096), UsageError, "buffer_step must be in"),
        (dict(buffer_step=(1 << 44) + 1), UsageError, "buffer_step must be in"),
        (dict(buffer_step=4096.0), UsageTypeError, "buffer_step must be an int"),
        (dict(buffer_step=True), UsageTypeError, "buffer_step must be an int"),
        (dict(buffer_step="4096"), UsageTypeError, "buffer_step must be an int"),
        (dict(device=-1), UsageError, "non-negative ordinal"),
        (dict(device=None), UsageTypeError, "device must be a device ordinal"),
        (dict(device=False), UsageTypeError, "device must be a device ordinal"),
        (dict(device=0.0), UsageTypeError, "device must be a device ordinal"),
        (dict(rounding="floor"), UsageError, 'rounding must be "seed" or "exact"'),
        (dict(alloc_nbytes=4095), UsageError, "at least buffer_step"),
        (dict(alloc_nbytes=0), UsageError, "at least buffer_step"),
        (dict(alloc_nbytes=8192.0), UsageTypeError, "alloc_nbytes must be an int"),
    ],
)
def test_bad_arguments_are_refused_before_any_fetch(
    exited_producer: Producer, kwargs: dict[str, Any], exc: type, words: str
) -> None:
    # the pairs name a process that has gone: a fetch would be ESRCH, so the
    # argument error proves nothing was fetched first
    args: dict[str, Any] = dict(buffer_step=4096, device=0)
    args.update(kwargs)
    before = open_fds()
    with pytest.raises(exc) as ei:
        import_seed_buffers(exited_producer.pairs, **args)
    assert words in str(ei.value)
    assert not fds_opened_since(before)


def test_device_has_no_default() -> None:
    with pytest.raises(TypeError):
        import_seed_buffers([[P, 0]], 4096)  # type: ignore[call-arg]


def test_public_name() -> None:
    assert cip.import_seed_buffers is import_seed_buffers
    assert "import_seed_buffers" in cip.__all__ and "SeedBuffers" in cip.__all__
    assert cip.SeedBuffers is _seedpeer.SeedBuffers


# -- the exporter's allocation size -------------------------------------------

G = 2 * MiB


@pytest.mark.parametrize(
    ("step", "seed", "exact"),
    [
        (1, G, G),
        (4096, G, G),
        (G - 1, G, G),
        (G, 2 * G, G),  # the seed's whole extra granule for an aligned size
        (G + 1, 2 * G, 2 * G),
        (2 * G, 3 * G, 2 * G),
        (5 * MiB + 12, 3 * G, 3 * G),
        (1 << 30, (1 << 30) + G, 1 << 30),
    ],
)
def test_alloc_nbytes_seed_and_exact(step: int, seed: int, exact: int) -> None:
    assert seed_alloc_nbytes(step, G) == seed
    assert seed_alloc_nbytes(step, G, "seed") == seed
    assert seed_alloc_nbytes(step, G, "exact") == exact


def test_alloc_nbytes_rules_hold_for_many_sizes() -> None:
    rng = np.random.default_rng(25)
    for gran in (4096, 64 * 1024, G):
        steps = [int(s) for s in rng.integers(1, 64 * gran, 200)]
        steps += [k * gran for k in range(1, 9)] + [k * gran + 1 for k in range(8)]
        for step in steps:
            seed = seed_alloc_nbytes(step, gran)
            exact = seed_alloc_nbytes(step, gran, "exact")
            assert seed % gran == 0 and exact % gran == 0
            assert step <= exact < step + gran
            assert step < seed <= step + gran  # the seed always leaves room after the step
            assert seed == exact + (gran if step % gran == 0 else 0)


@pytest.mark.parametrize(
    ("args", "exc"),
    [
        ((0, G), UsageError),
        ((-1, G), UsageError),
        ((4096, 0), UsageError),
        ((4096, -G), UsageError),
        ((4096.0, G), UsageTypeError),
        ((4096, float(G)), UsageTypeError),
        ((4096, G, "round"), UsageError),
    ],
)
def test_alloc_nbytes_refuses_bad_input(args: tuple[Any, ...], exc: type) -> None:
    with pytest.raises(exc):
        seed_alloc_nbytes(*args)
