"""The C++ layer (``c/include/cupy_ipcpool.hpp``): RAII over the C library, no second copy.

``c/tests/cip_cpp_probe.cpp`` subscribes, through the header, to a real Python
publisher (:class:`PublisherCore` over a ``SOCK_SEQPACKET`` socket) on the
protocol layer, and this test watches the publisher's lease book: a release by
hand, a release at a frame's end of scope, a frame moved, and the subscription's
own end give each lease back exactly once; ``c/tests/cip_cpp_pub_probe.cpp`` publishes
through it to a Python subscriber core.  The header is also compiled with every
warning an error (its GPU calls compile here; they run on the device only).  Under
``CUPY_IPCPOOL_C_SANITIZE`` the program is built with the sanitizers, as the C
probes are.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _memfd_backend import MemfdConsumer
from test_c_library import C_DIR, CFLAGS, Probe, compiler, library_objects

from cupy_ipcpool import EndOfStream
from cupy_ipcpool.channel._handshake import Welcome
from cupy_ipcpool.channel._publisher_core import PublisherCore

SLOTS = 4
CXXFLAGS = ["-std=c++17", "-Wall", "-Wextra", "-Werror", "-pedantic", "-pthread"] + [
    f for f in CFLAGS if f.startswith(("-O", "-g", "-f"))
]


def _cxx() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _build_cpp(out: Path, name: str) -> Path:
    """Compile ``c/tests/<name>.cpp`` with the header and the C library (compiled as C)."""
    cc, cxx = compiler(), _cxx()
    if cc is None or cxx is None:
        pytest.skip("no C and C++ compiler on this machine: the C++ layer is not built")
    exe = out / name
    cmd = [
        cxx,
        *CXXFLAGS,
        f"-I{C_DIR / 'include'}",
        str(C_DIR / "tests" / f"{name}.cpp"),
        *map(str, library_objects()),
        "-o",
        str(exe),
        "-ldl",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr}"
    return exe


@pytest.fixture(scope="module")
def probe_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_cpp(tmp_path_factory.mktemp("cpp"), "cip_cpp_probe")


@pytest.fixture
def publisher(tmp_path: Path) -> Iterator[PublisherCore]:
    core = PublisherCore(str(tmp_path / "pub.sock"), SLOTS, welcome=Welcome())
    try:
        yield core
    finally:
        core.close()


def _until(core: PublisherCore, what: Any, why: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, why
        core.poll(0.01)


class _Program(Probe):
    """The C++ program, which prints several lines per step: read unbuffered (Probe's
    ``select`` on a buffered pipe would miss lines already read into the buffer)."""

    def __init__(self, exe: Path, address: str, *more: str) -> None:
        self.proc = subprocess.Popen(
            [str(exe), address, *more],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._pending = b""

    def answer(self, timeout: float = 20.0) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"the C++ program said nothing more within {timeout} s")
            chunk = os.read(fd, 4096)
            if not chunk:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise AssertionError(f"the C++ program exited ({self.proc.poll()}): {err}")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode().strip()


def test_the_cpp_layer_gives_every_lease_back_once(
    probe_exe: Path, publisher: PublisherCore
) -> None:
    address = publisher.address
    program = _Program(probe_exe, address)
    try:
        refused = program.answer()
        assert refused.startswith(
            "refused CIP_ERR_TRANSPORT | CIP_ERR_TRANSPORT: cannot connect"
        ), refused
        assert "(is the publisher running?)" in refused
        _until(publisher, lambda: publisher.subscribers, "the C++ subscriber never joined")
        # it asked for 4: the publisher grants at most its max_credit, num_slots - 2
        assert program.answer() == f"joined {SLOTS} slots, credit 2"
        assert program.answer() == "nothing yet 1"  # a receive that timed out: no frame
        book = publisher.lease_book
        slots = []
        for i in range(3):
            slot, _readers = publisher.acquire(5.0)
            publisher.publish(slot, f"frame{i}".encode())
            slots.append(slot)
        program.send("go")
        assert program.answer() == f"by hand 0 {slots[0]} frame0"
        assert program.answer() == "held 0"
        assert program.answer() == f"by scope 1 {slots[1]} frame1"
        assert program.answer() == f"kept 2 {slots[2]} frame2"
        assert program.answer() == "moved-from held 0, kept held 1"
        _until(
            publisher,
            lambda: book.lease_count(slots[0]) == 0 and book.lease_count(slots[1]) == 0,
            "a release by hand or at the end of a scope never reached the publisher",
        )
        assert book.lease_count(slots[2]) == 1  # still held: moved, not released
        program.send("end")
        assert program.answer() == "closed"
        _until(
            publisher,
            lambda: not publisher.subscribers and book.lease_count(slots[2]) == 0,
            "the kept frame or the subscription itself never ended",
        )
        assert book.ended == 3  # three leases, each given back once
    finally:
        program.close()
    assert program.proc.returncode == 0


@pytest.fixture(scope="module")
def pub_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_cpp(tmp_path_factory.mktemp("cpppub"), "cip_cpp_pub_probe")


def test_a_cpp_publisher_streams_to_a_python_subscriber_and_closes_at_scope_end(
    pub_exe: Path, tmp_path: Path
) -> None:
    """cupy_ipcpool::publisher: frames in order with their slots' bytes checked; acquire says
    none is free (std::nullopt) while the subscriber holds every slot; the end of scope
    closes the publisher: BYE after the frames queued."""
    address = str(tmp_path / "p.sock")
    frames = 12
    program = _Program(pub_exe, address, str(frames))
    try:
        assert program.answer() == "listening"
        with MemfdConsumer(address, credit=4) as sub:
            for n in range(frames):
                f = sub.recv(20.0)
                assert (f.seq, f.payload) == (n, b"frame")
                sub.release(f)
                assert program.answer() == f"published {n}"
            assert program.answer() == f"returned {frames}"
            held = [sub.recv(20.0) for _ in range(SLOTS)]  # checked, kept
            assert [f.seq for f in held] == list(range(frames, frames + SLOTS))
            assert program.answer() == "none free"
            assert program.answer() == "closed"
            with pytest.raises(EndOfStream):
                sub.recv(20.0)
    finally:
        program.close()
    assert program.proc.returncode == 0
