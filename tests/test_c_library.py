"""The C library (c/) for real, without a GPU: built with the system compiler, run as a
separate process against the CPU publisher core over memfd slots.

``c/tests/cip_probe.c`` drives the library from a line protocol on stdin; the
publisher runs in a spawned process (:func:`_producer_main`) driven over a
pipe.  What the C side does is checked from its answers: the frames it hands
out (and whether their slots still hold each frame's bytes), the status codes
and messages it reports, and its open fds before and after.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import importlib.util
import os
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cupy_ipcpool import _engine
from cupy_ipcpool._errors import IpcPoolError, UsageError
from cupy_ipcpool._handles import MAX_SOCKET_PATH, ArrayHandle, PoolDescriptor
from cupy_ipcpool._transport import check_socket_path, process_start_time
from cupy_ipcpool.channel import _protocol as proto
from cupy_ipcpool.channel._payload import FRAME_HEAD, FRAME_VOID, WELCOME_HEAD
from cupy_ipcpool.channel._syncpage import (
    _SET_WINDOW,
    FORCED,
    RECORD_CAP,
    FlagLayout,
    FrameWaits,
    SharedFlags,
    frame_state,
)
from tests import _pipe_child
from tests._pipe_child import PipeChild

ROOT = Path(__file__).resolve().parent.parent
C_DIR = ROOT / "c"
#: The library's sources: every ``.c`` file of ``c/src`` (one concern each; what they share is
#: declared in ``c/src/cip_internal.h``), as CMake, the docs and every build here take them.
LIB_SOURCES = sorted((C_DIR / "src").glob("*.c"))
SPAWN = _pipe_child.CHILDREN  # forkserver children (tests/_pipe_child.py)
CMD_TIMEOUT = 20.0
CFLAGS = ["-std=c99", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread"]
#: ``CUPY_IPCPOOL_C_SANITIZE=address,undefined`` (or ``thread``): every program the tests
#: build is built with those sanitizers, and any finding fails its test (ASan and UBSan stop
#: the program; LeakSanitizer and ThreadSanitizer report at exit: see ``Probe.close``).
SANITIZE = os.environ.get("CUPY_IPCPOOL_C_SANITIZE", "").strip()
if SANITIZE:
    CFLAGS = [f for f in CFLAGS if not f.startswith("-O")] + ["-O1", "-g"]
    CFLAGS += ["-fno-omit-frame-pointer", f"-fsanitize={SANITIZE}", "-fno-sanitize-recover=all"]


def read_messages(conn: socket.socket, count: int, timeout: float) -> list[proto.Message]:
    """Read a hand-built publisher's connection until ``count`` messages arrived (or
    ``timeout``, or the hang-up)."""
    out: list[proto.Message] = []
    deadline = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        ready, _, _ = select.select([conn], [], [], 0.05)
        if ready:
            data = conn.recv(1 << 17)
            if not data:
                break
            out.append(proto.decode(data))
    return out


# ---------------------------------------------------------------- building


def compiler() -> str | None:
    """The system C compiler (``$CC``, ``cc``, ``gcc`` or ``clang``), or None."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


#: How many compilations of the library (by sources and flags) the temp dir keeps.
_OBJECT_BUILDS_KEPT = 8


def library_objects(extra: tuple[str, ...] = ()) -> list[Path]:
    """The library's sources (:data:`LIB_SOURCES`) compiled with :data:`CFLAGS` and ``extra``
    into object files, once for every build of this test run that asks for the same ones.

    They are kept under the system's temporary directory by a digest of the compiler, the
    flags and every source and header of ``c/``: a change to any of them compiles afresh
    (the newest :data:`_OBJECT_BUILDS_KEPT` compilations stay), and the pytest-xdist
    workers share one compilation (the first takes a lock, the others wait on it).  Skips
    if there is no compiler.
    """
    cc = compiler()
    if cc is None:
        pytest.skip(
            "no C compiler (cc, gcc, clang or $CC) on this machine: the C library is not built"
        )
    flags = [*CFLAGS, *extra, f"-I{C_DIR / 'include'}"]
    digest = hashlib.sha256("\0".join([cc, *flags]).encode())
    for path in sorted(C_DIR.glob("*/*.[ch]")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    cache = Path(tempfile.gettempdir()) / f"cupy_ipcpool-c-objects-{os.getuid()}"
    cache.mkdir(mode=0o700, exist_ok=True)
    built = cache / digest.hexdigest()[:24]
    objects = [built / (src.stem + ".o") for src in LIB_SOURCES]
    with open(cache / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (built / "done").exists():
            shutil.rmtree(built, ignore_errors=True)
            built.mkdir()
            cmd = [cc, *flags, "-c", *map(str, LIB_SOURCES)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=built)
            assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}{done.stderr}"
            (built / "done").touch()
            # the builds of older sources and flags: the newest few stay (lanes run side by side)
            older = sorted((d for d in cache.iterdir() if d.is_dir()), key=os.path.getmtime)
            for stale in older[:-_OBJECT_BUILDS_KEPT]:
                shutil.rmtree(stale, ignore_errors=True)
    return objects


def build_c_program(
    out_dir: Path,
    name: str,
    sources: list[Path],
    extra: tuple[str, ...] = (),
    *,
    library: bool = True,
) -> Path:
    """Compile ``sources`` with the library into ``out_dir/name``; skip if no compiler.

    Parameters
    ----------
    out_dir:
        Build directory (never the repository).
    name:
        Executable name.
    sources:
        The program's own sources.
    extra:
        More compiler flags.
    library:
        Link the library in (its objects from :func:`library_objects`, compiled with the
        same flags); False for a program that is built without it.

    Returns
    -------
    Path
        The executable.
    """
    cc = compiler()
    if cc is None:
        pytest.skip(
            "no C compiler (cc, gcc, clang or $CC) on this machine: the C library is not built"
        )
    exe = out_dir / name
    cmd = [
        cc,
        *CFLAGS,
        *extra,
        f"-I{C_DIR / 'include'}",
        *map(str, sources),
        *(map(str, library_objects(extra)) if library else []),
        "-o",
        str(exe),
        "-ldl",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}{done.stderr}"
    return exe


def build_c_library(out_dir: Path) -> Path:
    """``libcupy_ipcpool.so`` built into ``out_dir`` (for ctypes); skip if no compiler.

    Skipped under ``CUPY_IPCPOOL_C_SANITIZE``: a sanitizer's runtime must be the first
    library of its process, and ctypes loads this one into an unsanitized Python.
    """
    if SANITIZE:
        pytest.skip(
            f"CUPY_IPCPOOL_C_SANITIZE={SANITIZE}: the ctypes-loaded library would need the "
            "sanitizer's runtime preloaded into Python itself; the probes run its code sanitized"
        )
    return build_c_program(
        out_dir,
        "libcupy_ipcpool.so",
        LIB_SOURCES,
        ("-shared", "-fPIC"),
        library=False,
    )


# ---------------------------------------------------------------- the library through ctypes

CIP_MAX_NDIM = 16
CIP_MODE_BLOCK, CIP_MODE_LATEST = 0, 1
CIP_TRANSPORT_AUTO, CIP_TRANSPORT_PIDFD, CIP_TRANSPORT_SOCKET = 0, 1, 2


class CipArray(ctypes.Structure):
    """``cip_array``."""

    _fields_ = [
        ("data", ctypes.c_uint64),
        ("offset", ctypes.c_uint64),
        ("generation", ctypes.c_uint64),
        ("nbytes", ctypes.c_uint64),
        ("slot", ctypes.c_uint32),
        ("dtype", ctypes.c_int32),
        ("itemsize", ctypes.c_uint32),
        ("ndim", ctypes.c_uint32),
        ("shape", ctypes.c_uint64 * CIP_MAX_NDIM),
        ("strides", ctypes.c_int64 * CIP_MAX_NDIM),
    ]


class CipFrame(ctypes.Structure):
    """``cip_frame``."""

    _fields_ = [
        ("seq", ctypes.c_uint64),
        ("slot", ctypes.c_uint32),
        ("generation", ctypes.c_uint32),
        ("num_arrays", ctypes.c_uint32),
        ("metadata_len", ctypes.c_uint32),
        ("arrays", ctypes.POINTER(CipArray)),
        ("metadata", ctypes.c_void_p),
    ]


class CipSubOptions(ctypes.Structure):
    """``cip_sub_options``."""

    _fields_ = [
        ("mode", ctypes.c_int),
        ("credit", ctypes.c_uint32),
        ("timeout_ms", ctypes.c_int),
        ("device", ctypes.c_int),
        ("allowed_uids", ctypes.POINTER(ctypes.c_uint32)),
        ("n_allowed_uids", ctypes.c_size_t),
    ]


class CLib:
    """The C library loaded with ctypes: its functions, typed, as attributes.

    For tests (here and in ``test_c_library_gpu.py``) that drive the library from
    Python: the GPU tests launch their kernels with CuPy on the library's pointers.
    """

    _SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
        "cip_status_name": (ctypes.c_char_p, [ctypes.c_int]),
        "cip_last_error": (ctypes.c_char_p, []),
        "cip_sub_options_init": (None, [ctypes.POINTER(CipSubOptions)]),
        "cip_sub_open": (
            ctypes.c_int,
            [ctypes.c_char_p, ctypes.POINTER(CipSubOptions), ctypes.POINTER(ctypes.c_void_p)],
        ),
        "cip_sub_recv": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(CipFrame)]),
        "cip_frame_wait": (
            ctypes.c_int,
            [ctypes.c_void_p, ctypes.POINTER(CipFrame), ctypes.c_void_p],
        ),
        "cip_sub_release": (
            ctypes.c_int,
            [ctypes.c_void_p, ctypes.POINTER(CipFrame), ctypes.c_void_p],
        ),
        "cip_frame_complete": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(CipFrame)]),
        "cip_sub_incomplete_frames": (
            ctypes.c_int,
            [
                ctypes.c_void_p,
                ctypes.POINTER(ctypes.c_uint64),
                ctypes.c_size_t,
                ctypes.POINTER(ctypes.c_size_t),
            ],
        ),
        "cip_sub_untracked_frames": (ctypes.c_uint64, [ctypes.c_void_p]),
        "cip_sub_forced_flags": (ctypes.c_uint64, [ctypes.c_void_p]),
        "cip_sub_device": (ctypes.c_int, [ctypes.c_void_p]),
        "cip_sub_close": (ctypes.c_int, [ctypes.c_void_p]),
        "cip_sub_free": (ctypes.c_int, [ctypes.c_void_p]),
        "cip_pool_attach": (
            ctypes.c_int,
            [
                ctypes.c_char_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.POINTER(ctypes.c_void_p),
            ],
        ),
        "cip_pool_slot_ptr": (
            ctypes.c_int,
            [ctypes.c_void_p, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64)],
        ),
        "cip_pool_close": (ctypes.c_int, [ctypes.c_void_p]),
        "cip_parse_frame_payload": (
            ctypes.c_int,
            [
                ctypes.c_char_p,
                ctypes.c_size_t,
                ctypes.c_uint64,
                ctypes.c_uint32,
                ctypes.c_uint64,
                ctypes.c_uint64,
                ctypes.POINTER(CipArray),
                ctypes.c_size_t,
                ctypes.POINTER(CipFrame),
            ],
        ),
        "cip_flag_state": (ctypes.c_int, [ctypes.c_uint32, ctypes.c_uint32]),
        "cip_sync_layout": (
            ctypes.c_int,
            [
                ctypes.c_uint32,
                ctypes.c_uint32,
                ctypes.POINTER(ctypes.c_size_t),
                ctypes.POINTER(ctypes.c_size_t),
            ],
        ),
    }

    def __init__(self, path: Path | str) -> None:
        self.dll = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in self._SIGNATURES.items():
            fn = getattr(self.dll, name)  # ctypes keeps this object: typed once for all
            fn.restype = restype
            fn.argtypes = argtypes

    def __getattr__(self, name: str) -> Any:
        if name not in self._SIGNATURES:
            raise AttributeError(f"{name} is not declared in CLib._SIGNATURES")
        return getattr(self.dll, name)

    def why(self, status: int) -> str:
        """``"NAME: message"`` of a status and this thread's last error."""
        name = self.cip_status_name(status).decode()
        return f"{name}: {self.cip_last_error().decode(errors='replace')}"

    def check(self, status: int, what: str) -> None:
        """Raise AssertionError naming ``what`` unless ``status`` is CIP_OK."""
        if status != 0:
            raise AssertionError(f"{what}: {self.why(status)}")

    def options(self, mode: int = CIP_MODE_BLOCK, timeout_ms: int = 30000) -> CipSubOptions:
        """Defaults (``cip_sub_options_init``) with ``mode`` and ``timeout_ms``."""
        opts = CipSubOptions()
        self.cip_sub_options_init(ctypes.byref(opts))
        opts.mode = mode
        opts.timeout_ms = timeout_ms
        return opts

    def subscribe(self, address: str, mode: int = CIP_MODE_BLOCK) -> ctypes.c_void_p:
        """``cip_sub_open``; raises AssertionError with the library's message on failure."""
        sub = ctypes.c_void_p()
        opts = self.options(mode)
        self.check(
            self.cip_sub_open(address.encode(), ctypes.byref(opts), ctypes.byref(sub)),
            "cip_sub_open",
        )
        return sub

    def incomplete(self, sub: ctypes.c_void_p) -> list[int]:
        """``cip_sub_incomplete_frames``, all of them."""
        count = ctypes.c_size_t()
        self.check(self.cip_sub_incomplete_frames(sub, None, 0, ctypes.byref(count)), "count")
        seqs = (ctypes.c_uint64 * max(1, count.value))()
        self.check(
            self.cip_sub_incomplete_frames(sub, seqs, count.value, ctypes.byref(count)),
            "cip_sub_incomplete_frames",
        )
        return list(seqs[: count.value])

    @staticmethod
    def frame(seq: int, slot: int, generation: int) -> CipFrame:
        """A ``cip_frame`` naming a received frame (what ``cip_frame_complete`` reads)."""
        f = CipFrame()
        f.seq, f.slot, f.generation = seq, slot, generation
        return f


@pytest.fixture(scope="module")
def probe_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_c_program(
        tmp_path_factory.mktemp("cbuild"), "cip_probe", [C_DIR / "tests" / "cip_probe.c"]
    )


class Probe:
    """The C program, one command and one answer line at a time (each with a timeout)."""

    def __init__(self, exe: Path, pass_fds: tuple[int, ...] = ()) -> None:
        self.proc = subprocess.Popen(
            [str(exe)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            pass_fds=pass_fds,
        )
        # One answer before anything else (the sync layout of cip_probe, harmless in the
        # other probes, which refuse it): the program runs its loop, past the dynamic
        # loader's fds, so a test's snapshot of its fd table holds only what it keeps.
        self("layout 1 1")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = CMD_TIMEOUT) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"the C probe did not answer within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"the C probe exited ({self.proc.poll()}): {err}")
        return line.strip()

    def __call__(self, line: str, timeout: float = CMD_TIMEOUT) -> str:
        self.send(line)
        return self.answer(timeout)

    def fds(self) -> int:
        answer = self("fds")
        assert answer.startswith("ok "), answer
        return int(answer.split()[1])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.send("quit")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        err = self.proc.stderr.read() if self.proc.stderr else ""
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):  # "quit" unsent to a dead probe
                    f.close()
        # a finding reported at exit (LeakSanitizer, ThreadSanitizer) shows in the status
        assert not SANITIZE or self.proc.returncode <= 0, (
            f"the C probe exited ({self.proc.returncode}) under -fsanitize={SANITIZE}: {err}"
        )


@pytest.fixture
def probe(probe_exe: Path) -> Iterator[Probe]:
    p = Probe(probe_exe)
    try:
        yield p
    finally:
        p.close()


def status(answer: str) -> str:
    """The status name of an ``err`` answer ("CIP_ERR_EVICTED"), or "ok"/"frame"."""
    parts = answer.split()
    return parts[1] if parts[0] == "err" else parts[0]


def frame_of(answer: str) -> tuple[int, int, bytes, str]:
    """``(seq, slot, payload, match)`` of a ``frame`` answer."""
    parts = answer.split()
    assert parts[0] == "frame", answer
    payload = b"" if parts[4] == "-" else bytes.fromhex(parts[4])
    return int(parts[1]), int(parts[2]), payload, parts[5]


@pytest.fixture
def address() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="cip-c-")
    try:
        yield os.path.join(d, "pub.sock")
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- the publisher process


def _geometry_payload(slot: int, generation: int, handles: list[ArrayHandle], meta: bytes) -> bytes:
    head = FRAME_HEAD.pack(slot, generation & 0xFFFFFFFF, len(handles), len(meta))
    return head + b"".join(h.pack() for h in handles) + meta


def _producer_main(
    conn: Connection, address: str, num_slots: int, slot_size: int, kw: dict
) -> None:
    """A :class:`MemfdProducer` driven by ``(command, *args)`` tuples; answers ``(ok, value)``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _memfd_backend import MemfdProducer

    prod = MemfdProducer(address, num_slots, slot_size, **kw)
    conn.send(("ready", os.getpid()))
    rng = np.random.default_rng(7)
    while True:
        cmd, *args = conn.recv()
        try:
            out: Any = None
            if cmd == "wait_subs":
                prod.wait_subscribers(args[0])
            elif cmd == "publish":
                count, payload = args
                out = [prod.publish_next(payload=payload) for _ in range(count)]
            elif cmd == "publish_raw":  # (slot bytes, payload builder args) -> (seq, slot, bytes)
                geometry, meta = args
                slot, _ = prod.core.acquire(5.0)
                data = rng.integers(0, 256, slot_size, dtype=np.uint8).tobytes()
                prod.slots.maps[slot][:] = data
                seq = prod.core.next_seq
                handles = [
                    ArrayHandle(slot if g[0] is None else g[0], seq + 1, *g[1:]) for g in geometry
                ]
                prod.core.publish(slot, _geometry_payload(slot, seq + 1, handles, meta))
                out = (seq, slot, data)
            elif cmd == "poll":
                out = prod.core.poll(args[0])
            elif cmd == "poll_for":  # poll repeatedly for args[0] seconds
                end = time.monotonic() + args[0]
                while time.monotonic() < end:
                    prod.core.poll(0.02)
            elif cmd == "leases":
                book = prod.core.lease_book
                out = sum(book.lease_count(s) for s in range(num_slots))
            elif cmd == "state":
                out = (prod.core.evictions, len(prod.core.subscribers), prod.core.last_leave_reason)
            elif cmd == "close":
                prod.close()
                conn.send(("ok", None))
                return
            conn.send(("ok", out))
        except Exception as exc:  # sent back as text: the test fails with it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Producer(PipeChild):
    """The spawned publisher process."""

    def __init__(self, address: str, num_slots: int = 4, slot_size: int = 4096, **kw: Any) -> None:
        super().__init__(_producer_main, address, num_slots, slot_size, kw)
        if not self.conn.poll(60):
            raise TimeoutError("the publisher process did not start")
        tag, self.pid = self.conn.recv()
        assert tag == "ready"

    def __call__(self, *cmd: Any, timeout: float = 30.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the publisher did not answer {cmd[0]!r}")
        tag, value = self.conn.recv()
        assert tag == "ok", value
        return value

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self("close", timeout=10)
        self.finish()


@pytest.fixture
def producer(address: str) -> Iterator[Callable[..., Producer]]:
    made: list[Producer] = []

    def make(**kw: Any) -> Producer:
        p = Producer(address, **kw)
        made.append(p)
        return p

    try:
        yield make
    finally:
        for p in made:
            p.stop()


def subscribe(
    probe: Probe, pub: Producer, address: str, mode: str = "block", credit: int = 0
) -> str:
    """Open a raw subscription in the probe and wait until the publisher adopted it."""
    answer = probe(f"open_raw {address} {mode} {credit} 5000")
    assert answer.startswith("ok "), answer
    pub("wait_subs", 1)
    return answer


# ---------------------------------------------------------------- one source for the wire


def test_wire_header_is_generated_from_the_python_constants() -> None:
    spec = importlib.util.spec_from_file_location("cip_gen_wire", C_DIR / "gen_wire.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    committed = (C_DIR / "include" / "cupy_ipcpool_wire.h").read_text()
    assert committed == gen.generate(), "run: python c/gen_wire.py --write"
    # a few values a reader can check by eye against docs/wire.md ("Message layouts")
    assert f"#define CIP_WIRE_FRAME_SIZE {struct.calcsize('<HBBQII')}" in committed
    assert f"#define CIP_WIRE_VERSION {proto.VERSION}u" in committed


def test_generator_offsets_follow_the_struct_formats() -> None:
    spec = importlib.util.spec_from_file_location("cip_gen_wire2", C_DIR / "gen_wire.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.fields("<HBBQII") == [(0, 2), (2, 1), (3, 1), (4, 8), (12, 4), (16, 4)]
    assert gen.fields("<4sHBB16sI") == [(0, 4), (4, 2), (6, 1), (7, 1), (8, 16), (24, 4)]
    with pytest.raises(ValueError):
        gen.fields("@I")  # native alignment: not a wire layout


# ---------------------------------------------------------------- the library's modules


def test_the_library_is_modules_of_one_concern_that_export_the_api_only(
    tmp_path: Path,
) -> None:
    """Issue 44: no source of the library is over ~800 lines, and the shared library exports
    the functions of cupy_ipcpool.h and nothing else (what the modules share is hidden)."""
    long = {p.name: n for p in C_DIR.glob("src/*") if (n := len(p.read_text().splitlines())) > 800}
    assert not long, f"over 800 lines: {long}"
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm on this machine: the exported symbols are not checked")
    header = re.sub(
        r"/\*.*?\*/", "", (C_DIR / "include" / "cupy_ipcpool.h").read_text(), flags=re.S
    )
    api = set(re.findall(r"^[\w *]*?\b(cip_\w+)\(", header, flags=re.M))
    lib = build_c_library(tmp_path)
    done = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    exported = {line.split()[-1] for line in done.stdout.splitlines() if line.strip()}
    assert exported == api, (sorted(exported - api), sorted(api - exported))


# ---------------------------------------------------------------- sessions


def test_handshake_frames_and_release(
    probe: Probe, producer: Callable[..., Producer], address: str
) -> None:
    base = probe.fds()
    pub = producer(num_slots=4)
    answer = subscribe(probe, pub, address)
    _, sub_id, num_slots, next_seq, credit, lease_ms, payload, pid = answer.split()
    assert (int(num_slots), int(next_seq), int(lease_ms), int(pid)) == (4, 0, 0, pub.pid)
    assert int(sub_id) >= 1
    assert int(credit) == 2  # the publisher's max_credit: num_slots - 2
    assert struct.unpack("<Q", bytes.fromhex(payload)) == (4096,)  # the memfd backend's payload
    assert probe("map") == "ok 4"
    seqs = pub("publish", 2, b"meta")
    for seq in seqs:
        got_seq, slot, body, match = frame_of(probe("recv 5000"))
        assert (got_seq, body, match) == (seq, b"meta", "1")
        assert pub("leases") >= 1
        assert probe(f"check {got_seq} {slot}") == "ok 1"
        assert probe(f"release {got_seq} {slot}") == "ok"
    pub("poll_for", 0.2)
    assert pub("leases") == 0, "the releases reached the publisher"
    # a frame released twice, or never received, is refused without a message
    assert status(probe("release 0 0")) == "CIP_ERR_NOT_HELD"
    assert status(probe("recv 50")) == "CIP_ERR_TIMEOUT"
    assert probe("close") == "ok"
    assert probe.fds() == base


def test_a_forked_child_closing_a_c_subscription_leaves_the_parent_subscribed(
    probe: Probe, producer: Callable[..., Producer], address: str
) -> None:
    """A child forked from the C subscriber's process may not use its subscription
    (cip_sub_recv_raw refused) and its cip_sub_free closes only its copies: no BYE, nothing
    read, so the publisher keeps the subscriber and the parent receives the next frame (the
    Python subscriber's rule, test_subscriber_fork_cpu)."""
    pub = producer(num_slots=4)
    subscribe(probe, pub, address)
    assert probe("map") == "ok 4"
    assert probe("forkclose") == "ok CIP_OK CIP_ERR_INVALID_ARGUMENT 0"
    (seq,) = pub("publish", 1, b"after")
    got_seq, slot, body, match = frame_of(probe("recv 5000"))
    assert (got_seq, body, match) == (seq, b"after", "1")
    assert probe(f"release {got_seq} {slot}") == "ok"
    pub("poll_for", 0.2)
    evictions, subscribers, why = pub("state")
    assert (evictions, subscribers, why) == (0, 1, ""), why  # no BYE, no hang-up
    assert pub("leases") == 0
    assert probe("close") == "ok"


def test_a_killed_c_subscriber_gives_its_frames_back_while_its_forked_child_lives(
    probe: Probe, producer: Callable[..., Producer], address: str
) -> None:
    """The C subscriber's process holds a frame, forks a child that lives on, and is killed:
    its socket hangs up all the same (the child closed its copy at the fork: the library's
    pthread_atfork handler), so the publisher takes the lease back and drops it (the Python
    subscriber's rule, test_fork_children_cpu)."""
    pub = producer(num_slots=4)
    subscribe(probe, pub, address)
    pub("publish", 1, b"held")
    assert frame_of(probe("recv 5000"))[2] == b"held"
    answer = probe("forkchild")
    assert answer.startswith("ok "), answer
    child = int(answer.split()[1])
    try:
        assert pub("leases") == 1
        probe.proc.kill()
        probe.proc.wait(10)
        deadline = time.monotonic() + 10.0
        while pub("leases") != 0:
            assert time.monotonic() < deadline, "the killed subscriber's lease never came back"
            pub("poll_for", 0.05)
        assert pub("state")[1] == 0  # it left
        assert os.path.exists(f"/proc/{child}")  # the child lives on: it held nothing
    finally:
        os.kill(child, signal.SIGKILL)


def test_block_mode_waits_for_the_subscriber(
    probe: Probe, producer: Callable[..., Producer], address: str
) -> None:
    pub = producer(num_slots=3)
    subscribe(probe, pub, address)
    assert probe("map") == "ok 3"
    pub("publish", 3, b"")
    frames = [frame_of(probe("recv 5000")) for _ in range(3)]
    assert [f[0] for f in frames] == [0, 1, 2]
    assert all(f[3] == "1" for f in frames)
    # every slot is leased to the C subscriber: the publisher cannot take one
    pub.conn.send(("publish", 1, b""))
    assert not pub.conn.poll(0.5), "publish went ahead while every slot was held"
    assert probe(f"release {frames[0][0]} {frames[0][1]}") == "ok"
    assert pub.conn.poll(10)
    tag, value = pub.conn.recv()
    assert (tag, value) == ("ok", [3])
    seq, slot, _, match = frame_of(probe("recv 5000"))
    assert (seq, slot, match) == (3, frames[0][1], "1")
    for s, sl, _, _ in (*frames[1:], (seq, slot, b"", "")):
        assert probe(f"release {s} {sl}") == "ok"


def test_latest_mode_skips_frames_while_credit_is_held(
    probe: Probe, producer: Callable[..., Producer], address: str
) -> None:
    pub = producer(num_slots=4)
    subscribe(probe, pub, address, mode="latest", credit=1)
    assert probe("map") == "ok 4"
    pub("publish", 1, b"")
    seq, slot, _, match = frame_of(probe("recv 5000"))
    assert (seq, match) == (0, "1")
    pub("publish", 3, b"")  # the C side holds its one frame of credit: all skipped
    assert status(probe("recv 300")) == "CIP_ERR_TIMEOUT"
    assert probe(f"release {seq} {slot}") == "ok"
    pub("poll_for", 0.1)
    (last,) = pub("publish", 1, b"")
    seq2, _, _, match = frame_of(probe("recv 5000"))
    assert (seq2, match) == (last, "1")
    assert seq2 == 4, "frames 1-3 were skipped: the gap shows in seq"


def test_eviction_with_frames_queued_reports_eviction_never_a_frame(
    probe: Probe, producer: Callable[..., Producer], address: str
) -> None:
    base = probe.fds()
    pub = producer(num_slots=5, lease_timeout=0.3)
    answer = subscribe(probe, pub, address)
    assert answer.split()[5] == "300"  # the lease timeout, in ms, from the WELCOME
    assert probe("map") == "ok 5"
    pub("publish", 1, b"")
    seq, slot, _, _ = frame_of(probe("recv 5000"))  # held past the lease timeout
    pub("publish", 2, b"")  # queued in the C side's socket, not read
    pub("poll_for", 0.6)
    evictions, subscribers, reason = pub("state")
    assert (evictions, subscribers) == (1, 0), reason
    # two frames are queued before the eviction notice: neither may be handed out
    first = probe("recv 2000")
    assert status(first) == "CIP_ERR_EVICTED", first
    assert "lease_timeout" in first
    assert status(probe("recv 2000")) == "CIP_ERR_EVICTED"  # and on every later call
    assert status(probe(f"release {seq} {slot}")) == "CIP_ERR_EVICTED"
    assert probe("close") == "ok"
    assert probe.fds() == base


def test_frames_queued_before_a_clean_bye_are_delivered(
    probe: Probe, producer: Callable[..., Producer], address: str
) -> None:
    pub = producer(num_slots=5)
    subscribe(probe, pub, address)
    assert probe("map") == "ok 5"
    seqs = pub("publish", 3, b"x")
    pub.stop()  # BYE, then the process exits
    got = [frame_of(probe("recv 5000")) for _ in seqs]
    assert [g[0] for g in got] == seqs
    assert all(g[2] == b"x" for g in got)
    end = probe("recv 2000")
    assert status(end) == "CIP_ERR_END_OF_STREAM", end
    assert status(probe("recv 0")) == "CIP_ERR_END_OF_STREAM"
    for s, sl, _, _ in got:  # after a clean end a release only forgets the frame
        assert probe(f"release {s} {sl}") == "ok"


def test_publisher_sigkilled(probe: Probe, producer: Callable[..., Producer], address: str) -> None:
    base = probe.fds()
    pub = producer(num_slots=4)
    subscribe(probe, pub, address)
    assert probe("map") == "ok 4"
    pub("publish", 2, b"")
    seq, slot, _, match = frame_of(probe("recv 5000"))
    assert match == "1"
    pub.kill()
    end = probe("recv 5000")
    assert status(end) == "CIP_ERR_PUBLISHER_GONE", end  # the queued frame is dropped
    assert status(probe("recv 0")) == "CIP_ERR_PUBLISHER_GONE"
    assert probe(f"check {seq} {slot}") == "ok 1", "the held frame's memory stays readable"
    assert probe(f"release {seq} {slot}") == "ok"
    assert probe("close") == "ok"
    assert probe.fds() == base


def test_publisher_sigkilled_while_the_subscriber_waits(
    probe: Probe, producer: Callable[..., Producer], address: str
) -> None:
    pub = producer(num_slots=4)
    subscribe(probe, pub, address)
    probe.send("recv 20000")
    time.sleep(0.3)
    t0 = time.monotonic()
    pub.kill()
    end = probe.answer()
    assert status(end) == "CIP_ERR_PUBLISHER_GONE", end
    assert time.monotonic() - t0 < 5.0


def test_uid_not_allowed_is_refused(
    probe: Probe, producer: Callable[..., Producer], address: str
) -> None:
    base = probe.fds()
    producer(num_slots=2)
    answer = probe(f"open_raw {address} block 0 5000 {os.geteuid() + 1}")
    assert status(answer) == "CIP_ERR_REFUSED"
    assert f"runs as uid {os.geteuid()}" in answer
    assert probe.fds() == base


def test_refused_by_the_publisher(
    probe_exe: Path, producer: Callable[..., Producer], address: str
) -> None:
    pub = producer(num_slots=4, max_subscribers=1)
    first, second = Probe(probe_exe), Probe(probe_exe)
    try:
        subscribe(first, pub, address)
        base = second.fds()
        answer = second(f"open_raw {address} block 0 5000")
        assert status(answer) == "CIP_ERR_REFUSED", answer
        assert "max_subscribers" in answer
        assert second.fds() == base
    finally:
        first.close()
        second.close()


def test_no_publisher(probe: Probe, address: str) -> None:
    answer = probe(f"open_raw {address} block 0 1000")
    assert status(answer) == "CIP_ERR_TRANSPORT"
    assert "is the publisher running?" in answer


def test_a_socket_path_too_long_is_refused_with_python_s_limit_and_words(probe: Probe) -> None:
    """Python's limit (107 bytes: ``sun_path`` less its NUL) and Python's message, with the
    path's length and the fix, before any socket is made, from both ways of subscribing;
    a path of 107 bytes is tried (and finds no publisher)."""
    d = tempfile.mkdtemp(prefix="cip-", dir="/tmp")
    try:
        for size in (MAX_SOCKET_PATH + 1, 150):
            path = os.path.join(d, "p" * (size - len(d) - 1))
            with pytest.raises(UsageError) as python:
                check_socket_path(path)
            for command in ("open_raw", "open"):
                answer = probe(f"{command} {path} block 0 1000")
                assert status(answer) == "CIP_ERR_INVALID_ARGUMENT", answer
                assert answer == f"err CIP_ERR_INVALID_ARGUMENT {python.value}", answer
                assert f"is {size} bytes long" in answer and "$XDG_RUNTIME_DIR" in answer
        # a path too long to print whole is cut in the message, not the message's end
        answer = probe(f"open_raw {d}/{'p' * 2000} block 0 1000")
        assert answer.endswith("$XDG_RUNTIME_DIR") and f"is {len(d) + 2001} bytes" in answer
        path = os.path.join(d, "p" * (MAX_SOCKET_PATH - len(d) - 1))
        answer = probe(f"open_raw {path} block 0 1000")
        assert status(answer) == "CIP_ERR_TRANSPORT" and "is the publisher running?" in answer
    finally:
        shutil.rmtree(d, ignore_errors=True)


class RecordingPeer:
    """A listening socket that accepts one connection, sends nothing, and records every
    byte that arrives until the other side closes."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(address)
        self.sock.listen(4)
        self.received: list[bytes] = []
        self.hung_up = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(20)
        conn, _ = self.sock.accept()
        conn.settimeout(20)
        with conn:
            while True:
                data = conn.recv(1 << 17)
                if not data:
                    self.hung_up = True
                    return
                self.received.append(data)

    def close(self) -> None:
        self.thread.join(20)
        self.sock.close()


@pytest.mark.parametrize("layer", ["open_raw", "open"])
def test_a_publisher_of_a_uid_not_allowed_is_sent_nothing(
    probe: Probe, address: str, layer: str
) -> None:
    peer = RecordingPeer(address)
    try:
        base = probe.fds()
        answer = probe(f"{layer} {address} block 0 5000 {os.geteuid() + 1}")
        assert status(answer) == "CIP_ERR_REFUSED", answer
        assert f"runs as uid {os.geteuid()}" in answer and "nothing was sent" in answer
        peer.thread.join(20)
        assert peer.hung_up, "the C side kept the refused connection open"
        assert peer.received == [], f"bytes reached a refused peer: {peer.received!r}"
        assert probe.fds() == base
    finally:
        peer.close()


class SlowReader:
    """A publisher of raw frames that stops reading its subscriber's socket.

    Answers the HELLO with a WELCOME (no payload, no fds), then a thread sends
    ``frames`` frames, frame ``seq`` in slot ``seq % num_slots``; nothing is read
    from the connection until :meth:`read` is called.
    """

    def __init__(self, address: str, num_slots: int, frames: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(address)
        self.sock.listen(4)
        self.num_slots, self.frames = num_slots, frames
        self.conn: socket.socket | None = None
        self.sent = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.sock.settimeout(20)
            conn, _ = self.sock.accept()
            conn.settimeout(60)
            self.conn = conn
            conn.recv(1 << 17)  # HELLO
            conn.send(_welcome(num_slots=self.num_slots, credit=self.num_slots))
            for seq in range(self.frames):
                conn.send(proto.encode_frame(seq, seq % self.num_slots))
                self.sent += 1
        except BaseException as exc:  # the test fails with it
            self.error = exc

    def queued(self) -> list[proto.Message]:
        """Everything the subscriber's socket holds for us right now (no waiting)."""
        self.thread.join(20)  # every frame sent (the subscriber took them all)
        assert self.conn is not None
        out = []
        self.conn.setblocking(False)
        try:
            with contextlib.suppress(BlockingIOError):  # EAGAIN: nothing more
                while True:
                    out.append(proto.decode(self.conn.recv(1 << 17)))
        finally:
            self.conn.settimeout(60)
        return out

    def read(self, count: int, timeout: float) -> list[proto.Message]:
        """Read until ``count`` messages arrived (or the timeout, or the hang-up)."""
        assert self.conn is not None
        return read_messages(self.conn, count, timeout)

    def close(self) -> None:
        self.thread.join(20)
        if self.conn is not None:
            self.conn.close()
        self.sock.close()


def test_releases_a_full_socket_did_not_take_are_sent_later_in_order(
    probe: Probe, address: str
) -> None:
    num_slots, frames = 8, 1200  # the C side's socket takes a few hundred RELEASEs
    pub = SlowReader(address, num_slots, frames)
    try:
        assert probe(f"open_raw {address} block 0 5000").startswith("ok "), "handshake"
        # every release returns at once, however full the socket (no wait, no error)
        t0 = time.monotonic()
        assert probe(f"recvrel {frames} 5000", timeout=60) == f"ok {frames}"
        assert time.monotonic() - t0 < 20
        assert pub.error is None, pub.error
        first = pub.queued()
        assert 0 < len(first) < frames, (
            f"{len(first)} RELEASEs were in the socket: it never filled, so this proves nothing"
        )
        # the publisher reads again; the subscriber's next call sends what it owes
        rest: list[proto.Message] = []
        reader = threading.Thread(target=lambda: rest.extend(pub.read(frames - len(first), 20)))
        reader.start()
        assert status(probe("recv 1500")) == "CIP_ERR_TIMEOUT"
        reader.join(30)
        got = [(m.seq, m.slot) for m in (*first, *rest) if isinstance(m, proto.Release)]
        assert got == [(seq, seq % num_slots) for seq in range(frames)], (
            f"{len(got)} RELEASEs of {frames} arrived, or out of order"
        )
        assert probe("close") == "ok"
        assert any(isinstance(m, proto.Bye) for m in pub.read(1, 10)), "BYE after the RELEASEs"
    finally:
        pub.close()


def test_a_publisher_that_never_reads_ends_the_subscription_clearly(
    probe: Probe, address: str
) -> None:
    # past CIP_WIRE_MAX_CREDIT + num_slots RELEASEs owed no credit explains it: the end
    num_slots = 8
    limit = proto.MAX_CREDIT + num_slots
    pub = SlowReader(address, num_slots, limit + 400)
    try:
        assert probe(f"open_raw {address} block 0 5000").startswith("ok "), "handshake"
        answer = probe(f"recvrel {limit + 400} 5000", timeout=120)
        assert status(answer) == "CIP_ERR_TRANSPORT", answer
        assert "has not read this subscriber's messages" in answer
        done = int(answer.split()[3])
        assert limit < done < limit + 400, answer
        assert status(probe("recv 0")) == "CIP_ERR_TRANSPORT"  # and on every later call
        assert probe("close") == "ok"
    finally:
        pub.close()


# ---------------------------------------------------------------- the sync page

MASK = 0xFFFFFFFF


@pytest.mark.parametrize(
    ("num_slots", "rows"), [(1, 1), (2, 4), (8, 64), (63, 3), (64, 1), (65, 1), (1000, 65)]
)
def test_sync_layout_is_the_python_flag_layout(probe: Probe, num_slots: int, rows: int) -> None:
    layout = FlagLayout(num_slots, rows)
    assert probe(f"layout {num_slots} {rows}") == f"ok {layout.reads_offset} {layout.nbytes}"


def test_sync_layout_refuses_an_empty_page(probe: Probe) -> None:
    assert status(probe("layout 0 4")) == "CIP_ERR_INVALID_ARGUMENT"
    assert status(probe("layout 4 0")) == "CIP_ERR_INVALID_ARGUMENT"


#: (word - generation) mod 2**32 -> cip_flag_state, one row per edge of the decode table
DECODE_TABLE = [
    (0, 1),  # the producer's stream set it for this frame
    (5, 1),  # ... or for a later frame of the slot
    (_SET_WINDOW - 1, 1),
    (_SET_WINDOW, 0),  # forced to w + FORCED with w < generation: never written
    (FORCED - 1, 0),  # w = generation - 1
    (FORCED, 1),  # forced, w = generation: written before the death
    (FORCED + 7, 1),
    ((1 << 31) - 1, 1),
    (1 << 31, -1),  # not set yet
    (MASK, -1),  # the flag one generation behind
]


@pytest.mark.parametrize("generation", [0, 1, 1 << 31, MASK - 2, MASK, 0x1234567])
def test_flag_state_decodes_as_python(probe: Probe, generation: int) -> None:
    for distance, expected in DECODE_TABLE:
        word = (generation + distance) & MASK
        assert probe(f"state {word} {generation}") == f"ok {expected}", (word, generation)
        py = frame_state(word, generation)
        assert {None: -1, True: 1, False: 0}[py] == expected, (word, generation)


def test_flag_state_agrees_with_python_on_random_words(probe: Probe) -> None:
    rng = np.random.default_rng(11)
    for word, generation in rng.integers(0, 1 << 32, size=(300, 2), dtype=np.uint64).tolist():
        py = {None: -1, True: 1, False: 0}[frame_state(word, generation)]
        assert probe(f"state {word} {generation}") == f"ok {py}", (word, generation)


def _page_path(flags: SharedFlags) -> str:
    """The page's memfd as another process opens it."""
    return f"/proc/{os.getpid()}/fd/{flags.fd}"


def _states(probe: Probe, word: int, generations: range | list[int]) -> list[int]:
    return [int(probe(f"state {word} {g & MASK}").split()[1]) for g in generations]


def test_forcing_a_frame_flag_keeps_every_frame_of_the_slot_exact(probe_exe: Path) -> None:
    layout = FlagLayout(4, 2)
    flags = SharedFlags.create(layout.nbytes)
    first, second = Probe(probe_exe), Probe(probe_exe)  # two survivors of one producer
    try:
        for p in (first, second):
            assert p(f"page {_page_path(flags)}") == f"ok {layout.nbytes}"
        # slot 0: the producer's stream wrote frames of generations 1..6, then it died;
        # the first survivor's streams wait for generation 9
        flags.store(layout.frame_offset(0), 6)
        assert first("force 0 9") == f"ok 1 {6 + FORCED}", "the last real value + FORCED"
        # the second survivor (waiting for 7, or 9) finds it reached and leaves it alone
        assert second("force 0 7") == f"ok 0 {6 + FORCED}"
        assert second("force 0 9") == f"ok 0 {6 + FORCED}"
        assert not flags.force_frame(layout.frame_offset(0), 8), "Python sees it reached too"
        word = flags.load(layout.frame_offset(0))
        assert _states(second, word, range(1, 7)) == [1] * 6, "written before the death"
        assert _states(second, word, range(7, 11)) == [0] * 4, "never written"
        assert [frame_state(word, g) for g in range(1, 11)] == [True] * 6 + [False] * 4
        # slot 1: the producer set the awaited generation before it died: left alone
        flags.store(layout.frame_offset(1), 12)
        assert first("force 1 12") == "ok 0 12"
        assert first("force 1 10") == "ok 0 12"
        # slot 2: Python forced it first; the C survivor sees that and stores nothing
        flags.store(layout.frame_offset(2), 3)
        assert flags.force_frame(layout.frame_offset(2), 5)
        assert first("force 2 5") == f"ok 0 {3 + FORCED}"
        assert first("word 2") == f"ok {flags.load(layout.frame_offset(2))}"
        # slot 3: generations wrap around 2**32
        flags.store(layout.frame_offset(3), MASK - 1)
        assert first("force 3 1") == f"ok 1 {(MASK - 1 + FORCED) & MASK}"
        word = flags.load(layout.frame_offset(3))
        assert _states(first, word, [MASK - 2, MASK - 1, MASK, 0, 1]) == [1, 1, 0, 0, 0]
        # the read-flag rows are untouched
        assert all(flags.load(layout.read_offset(r, s)) == 0 for r in range(2) for s in range(4))
    finally:
        first.close()
        second.close()
        flags.close()


@pytest.fixture(scope="module")
def book_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_c_program(
        tmp_path_factory.mktemp("cbook"),
        "cip_book_probe",
        [C_DIR / "tests" / "cip_book_probe.c"],
    )


#: Scenarios of what a GPU subscription's bookkeeping sees: (num_slots, record cap,
#: steps).  "write": the producer's stream sets slot's flag; "recv": frame (seq, slot,
#: generation) received; "note": a stream waits on the flag; "others": another
#: survivor forces the flag for an awaited generation; "die": the producer is dead
#: (resolve); "expect": the answers' incomplete seqs (the truth of the scenario).
BOOK_SCENARIOS: dict[str, tuple[int, int, list[tuple[Any, ...]]]] = {
    "the producer keeps ahead": (
        2,
        8,
        [
            ("write", 0, 1),
            ("recv", 0, 0, 1),
            ("write", 1, 1),
            ("recv", 1, 1, 1),
            ("die",),
            ("expect", []),
        ],
    ),
    "the producer lags, then dies": (
        2,
        64,
        [
            ("recv", 0, 0, 1),  # not written yet when received: recorded
            ("recv", 1, 1, 1),
            ("write", 0, 1),
            ("recv", 2, 0, 2),  # frame 0 pruned from the front: the producer wrote it
            ("write", 1, 1),
            ("recv", 3, 1, 2),
            ("write", 0, 2),
            ("recv", 4, 0, 3),
            ("recv", 5, 1, 3),
            ("die",),  # slot 0 written up to 2 (frame 4 never), slot 1 up to 1 (3, 5 never)
            ("expect", [3, 4, 5]),
        ],
    ),
    "frames written before the death in a forced slot are complete": (
        1,
        64,
        [
            ("recv", 0, 0, 1),
            ("recv", 1, 0, 2),
            ("recv", 2, 0, 3),
            ("note", 0, 3),
            ("write", 0, 1),
            ("write", 0, 2),  # 1 and 2 written; 3 never
            ("die",),
            ("expect", [2]),
        ],
    ),
    "another survivor forced first": (
        2,
        64,
        [
            ("recv", 0, 0, 1),
            ("recv", 1, 1, 1),
            ("write", 1, 1),
            ("recv", 2, 1, 2),
            ("others", 0, 1),
            ("others", 1, 3),  # it awaited a later frame of slot 1 than ours
            ("die",),  # ours are reached already: nothing left to force
            ("expect", [0, 2]),
        ],
    ),
    "a full record drops its oldest, counted": (
        1,
        3,
        [("recv", s, 0, s + 1) for s in range(5)] + [("die",), ("expect", [2, 3, 4])],
    ),
    "generations wrap around 2**32": (
        1,
        64,
        [
            ("write", 0, MASK - 1),
            ("recv", 0, 0, MASK),
            ("recv", 1, 0, 0),
            ("write", 0, MASK),
            ("recv", 2, 0, 1),
            ("die",),
            ("expect", [1, 2]),
        ],
    ),
    "the producer alive: nothing incomplete, frames pending": (
        2,
        64,
        [("recv", 0, 0, 1), ("recv", 1, 1, 1), ("note", 1, 1), ("expect", [])],
    ),
}


@pytest.mark.parametrize("name", sorted(BOOK_SCENARIOS))
def test_frame_bookkeeping_answers_as_the_table_says(book_exe: Path, name: str) -> None:
    """One table of scenarios, step by step, against the engine's frame book through both
    ways in: the Python FrameWaits (``_engine.FrameBook``) and the C library's own calls (the
    probe, as cip_sub_recv and cip_sub_incomplete_frames make them).  Both run c/src/book.c
    now; the table's ``expect`` steps, written by hand, are the reference."""
    num_slots, cap, steps = BOOK_SCENARIOS[name]
    layout = FlagLayout(num_slots, 1)
    py_page, c_page = SharedFlags.create(layout.nbytes), SharedFlags.create(layout.nbytes)
    waits = FrameWaits(layout, record_cap=cap)
    book = Probe(book_exe)
    try:
        assert book(f"page {_page_path(c_page)} {num_slots} {cap}") == "ok"
        for step in steps:
            kind, *args = step
            if kind in ("write", "others"):
                slot, value = args
                for page in (py_page, c_page):
                    if kind == "write":
                        page.store(layout.frame_offset(slot), value)
                    else:
                        page.force_frame(layout.frame_offset(slot), value)
            elif kind == "recv":
                seq, slot, gen = args
                # Subscriber.recv: a wait is queued (and the frame recorded) unless the
                # host sees the flag set by the producer
                waited = ((py_page.load(layout.frame_offset(slot)) - gen) & MASK) >= _SET_WINDOW
                if waited:
                    waits.track(py_page, seq, slot, gen)
                elif waits.record:
                    waits.prune(py_page)
                assert book(f"recv {seq} {slot} {gen}") == f"ok {int(waited)}", (name, step)
            elif kind == "note":
                waits.note(*args)
                assert book(f"note {args[0]} {args[1]}") == "ok"
            elif kind == "die":
                forced = waits.resolve(py_page)
                assert book("resolve") == f"ok {len(forced)} {waits.forced}", (name, step)
                assert waits.pending(py_page) == [], "every wait can end"
            elif kind == "expect":
                assert list(waits.answers(py_page)[0]) == args[0], (name, "the Python side")
            # after every step: the same flags, the same answers
            words = [py_page.load(layout.frame_offset(s)) for s in range(num_slots)]
            assert words == [c_page.load(layout.frame_offset(s)) for s in range(num_slots)], step
            incomplete, pending = waits.answers(py_page)
            seqs = ",".join(map(str, incomplete)) or "-"
            assert book("answers") == f"ok {seqs} {len(pending)} {waits.untracked}", (name, step)
            assert book("pending") == f"ok {int(bool(waits.pending(py_page)))}", (name, step)
    finally:
        book.close()
        py_page.close()
        c_page.close()


@pytest.fixture(scope="module")
def close_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_c_program(
        tmp_path_factory.mktemp("cclose"),
        "cip_close_probe",
        [C_DIR / "tests" / "cip_close_probe.c"],
    )


def test_a_closed_subscription_still_answers_which_frames_were_complete(close_exe: Path) -> None:
    """Rule 9, C side: after cip_sub_close the handle answers as before it, holds nothing.

    A GPU subscription (the library's struct, built as cip_sub_open builds one, over a
    memfd sync page: c/tests/cip_close_probe.c) whose producer -- a child process -- sent
    four frames, wrote the flag of the first only (the last is void) and exited: the
    answers (cip_frame_complete per frame, cip_sub_incomplete_frames, the counts,
    cip_sub_get_info, cip_sub_error) are the same after the close; the socket and the
    pidfd are closed and the page unmapped by it; receiving and releasing are refused
    (CIP_ERR_INVALID_ARGUMENT); a second close is CIP_OK; cip_sub_free frees the rest
    (checked by LeakSanitizer under ``CUPY_IPCPOOL_C_SANITIZE=address``).
    """
    probe = Probe(close_exe)
    try:
        fds_alone = probe.fds()
        opened = probe("open 4")
        assert opened.startswith("ok "), opened
        pid = int(opened.split()[1])
        for seq, (slot, void) in enumerate([(0, 0), (1, 0), (2, 0), (3, 1)]):
            assert probe(f"publish {seq} {slot} 1 {void}") == f"ok {seq} {slot} 1"
        assert probe("write 0 1") == "ok"  # frame 0 written; 1 and 2 never; 3 is void
        assert probe("die") == "ok"
        assert probe("recv") == "err CIP_ERR_PUBLISHER_GONE"  # cip_sub_error says why
        before = probe("answers")
        fields = dict(f.split("=", 1) for f in before.split(" ", 6)[1:])
        assert fields["complete"] == "1,0,0,0", before
        incomplete = {int(s) for s in fields["incomplete"].split(",")}
        assert {1, 2} <= incomplete and 0 not in incomplete, before
        assert int(fields["forced"]) >= 2, before
        # sub id, slots, next seq, credit (the default block credit), mode, producer
        assert fields["info"] == f"CIP_OK,7,4,0,64,0,{pid}", before
        assert f"(pid {pid}) exited" in fields["error"], before
        assert probe("held_fds") == "ok 2"  # the socket and the pidfd
        assert probe("mapped") == "ok 1"
        fds_open = probe.fds()

        assert probe("close") == "ok CIP_OK"
        assert probe("answers") == before
        assert probe("held_fds") == "ok 0"
        assert probe.fds() == fds_open - 2 == fds_alone
        assert probe("mapped") == "ok 0"
        assert probe("recv") == "err CIP_ERR_INVALID_ARGUMENT"
        assert probe("release 1") == "err CIP_ERR_INVALID_ARGUMENT"
        assert probe("answers") == before  # the refused calls changed nothing
        assert probe("close") == "ok CIP_OK"
        assert probe("answers") == before
        assert probe("free") == "ok CIP_OK"
        assert probe.fds() == fds_alone
    finally:
        probe.close()


def test_the_record_cap_is_the_python_one() -> None:
    header = (C_DIR / "include" / "cupy_ipcpool_wire.h").read_text()
    assert f"#define CIP_WIRE_SYNC_RECORD_CAP {RECORD_CAP}u" in header
    assert f"#define CIP_WIRE_SYNC_FORCED {FORCED}u" in header


# ---------------------------------------------------------------- ctypes (the GPU tests' bindings)


@pytest.fixture(scope="module")
def clib(tmp_path_factory: pytest.TempPathFactory) -> CLib:
    return CLib(build_c_library(tmp_path_factory.mktemp("clib")))


def test_ctypes_structures_match_the_header(clib: CLib) -> None:
    opts = clib.options(CIP_MODE_LATEST, 1234)
    assert (opts.mode, opts.credit, opts.timeout_ms, opts.device) == (1, 0, 1234, -1)
    assert not opts.allowed_uids and opts.n_allowed_uids == 0
    handles = [
        ArrayHandle(3, 7, 64, (4, 5), (20, 4), np.dtype("float32")),
        ArrayHandle(3, 7, 512, (6,), (-8,), np.dtype("int64")),
    ]
    payload = _geometry_payload(3, 7, handles, b"meta")
    arrays = (CipArray * 4)()
    frame = CipFrame()
    st = clib.cip_parse_frame_payload(
        payload, len(payload), 42, 3, 4096, 0x10000, arrays, 4, ctypes.byref(frame)
    )
    clib.check(st, "cip_parse_frame_payload")
    assert (frame.seq, frame.slot, frame.generation, frame.num_arrays) == (42, 3, 7, 2)
    assert ctypes.string_at(frame.metadata, frame.metadata_len) == b"meta"
    for i, h in enumerate(handles):
        a = frame.arrays[i]
        assert (a.data, a.offset, a.generation, a.slot) == (0x10000 + h.offset, h.offset, 7, 3)
        assert (a.itemsize, a.ndim, a.nbytes) == (h.dtype.itemsize, h.ndim, h.nbytes)
        assert tuple(a.shape[: a.ndim]) == h.shape and tuple(a.strides[: a.ndim]) == h.strides
    assert clib.cip_flag_state((7 + FORCED) & MASK, 7) == 1
    reads, nbytes = ctypes.c_size_t(), ctypes.c_size_t()
    clib.check(clib.cip_sync_layout(8, 4, ctypes.byref(reads), ctypes.byref(nbytes)), "layout")
    assert (reads.value, nbytes.value) == (FlagLayout(8, 4).reads_offset, FlagLayout(8, 4).nbytes)
    assert clib.cip_pool_close(None) == 0 and clib.cip_sub_close(None) == 0
    # a frame never received is not known (no GPU needed to ask)
    assert clib.cip_frame_complete(None, ctypes.byref(clib.frame(0, 0, 1))) == -1


def test_a_void_frame_payload_parses_with_no_arrays(clib: CLib) -> None:
    """A void frame (flag index ``slot | FRAME_VOID``: a ``Publisher(ahead=True)`` took the
    slot and did not publish it) parses, with no arrays, so a C consumer of an ahead
    publisher goes on; a void frame that declares arrays, the mark on another slot's
    index, and any other flag index are refused, as the Python subscriber refuses them."""
    assert (
        f"#define CIP_WIRE_FRAME_VOID {FRAME_VOID}u"
        in (C_DIR / "include" / "cupy_ipcpool_wire.h").read_text()
    )
    arrays = (CipArray * 4)()

    def parse(payload: bytes, slot: int = 3) -> tuple[int, CipFrame]:
        frame = CipFrame()
        st = clib.cip_parse_frame_payload(
            payload, len(payload), 42, slot, 4096, 0x10000, arrays, 4, ctypes.byref(frame)
        )
        return st, frame

    for meta in (b"", b"xy"):
        payload = FRAME_HEAD.pack(3 | FRAME_VOID, 7, 0, len(meta)) + meta  # metadata points in
        st, frame = parse(payload)
        clib.check(st, "cip_parse_frame_payload of a void frame")
        assert (frame.seq, frame.slot, frame.generation, frame.num_arrays) == (42, 3, 7, 0)
        assert ctypes.string_at(frame.metadata, frame.metadata_len) == meta
    handle = ArrayHandle(3, 7, 64, (4,), (4,), np.dtype("float32")).pack()
    refused = {
        "void frame with arrays": FRAME_HEAD.pack(3 | FRAME_VOID, 7, 1, 0) + handle,
        "void mark on another slot's flag": FRAME_HEAD.pack(2 | FRAME_VOID, 7, 0, 0),
        "another high bit": FRAME_HEAD.pack(3 | 1 << 30, 7, 0, 0),
    }
    for case, payload in refused.items():
        st, _frame = parse(payload)
        assert clib.why(st).startswith("CIP_ERR_PROTOCOL"), (case, clib.why(st))
    assert "a void frame with 1 arrays" in clib.why(parse(refused["void frame with arrays"])[0])


def test_ctypes_signatures_take_what_the_gpu_tests_pass(clib: CLib, address: str) -> None:
    invalid = 1  # CIP_ERR_INVALID_ARGUMENT: every call below reaches the library
    f, count, ptr = CipFrame(), ctypes.c_size_t(), ctypes.c_uint64()
    stream = 0x1234  # a CuPy stream's .ptr is an int
    assert clib.cip_sub_recv(None, 0, ctypes.byref(f)) == invalid
    assert clib.cip_frame_wait(None, ctypes.byref(f), stream) == invalid
    assert clib.cip_sub_release(None, ctypes.byref(f), stream) == invalid
    assert clib.cip_sub_incomplete_frames(None, None, 0, ctypes.byref(count)) == invalid
    assert clib.cip_sub_untracked_frames(None) == 0 and clib.cip_sub_forced_flags(None) == 0
    assert clib.cip_sub_device(None) == -1
    assert clib.cip_pool_slot_ptr(None, 0, ctypes.byref(ptr)) == invalid
    pool = ctypes.c_void_p()
    st = clib.cip_pool_attach(b"junk", 4, -1, CIP_TRANSPORT_AUTO, ctypes.byref(pool))
    assert clib.why(st).startswith("CIP_ERR_DESCRIPTOR: not a cupy_ipcpool pool descriptor")
    with pytest.raises(AssertionError, match="cip_sub_open: CIP_ERR_TRANSPORT"):
        clib.subscribe(address)
    with pytest.raises(AttributeError):
        clib.cip_no_such_function  # noqa: B018


# ---------------------------------------------------------------- frames with arrays


def _expected(data: bytes, handle: ArrayHandle) -> tuple[str, int]:
    """The probe's rendering of ``handle`` over slot bytes ``data``: text and FNV-1a."""
    arr = np.ndarray(
        handle.shape, handle.dtype, buffer=data, offset=handle.offset, strides=handle.strides
    )
    h = 1469598103934665603
    for b in arr.tobytes():
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    shape = ",".join(map(str, handle.shape))
    strides = ",".join(map(str, handle.strides))
    text = f"{handle.offset}:{handle.dtype.name}:{handle.ndim}:{shape}:{strides}:{handle.nbytes}"
    return text, h


GEOMETRY = [  # (slot: None = the frame's, offset, shape, strides, dtype)
    (None, 0, (3, 4), (16, 4), "float32"),  # C order
    (None, 128, (4, 3), (8, 32), "float64"),  # Fortran order
    (None, 520, (5,), (-2,), "int16"),  # negative stride: touches [512, 522)
    (None, 1024, (2, 2), (16, 32), "complex128"),  # transposed
    (None, 2000, (), (), "bool"),  # 0-d
    (None, 3000, (0, 5), (5, 1), "uint8"),  # empty
    (None, 4000, (3,), (0,), "float16"),  # broadcast
]


def test_frames_with_several_arrays(
    probe: Probe, producer: Callable[..., Producer], address: str
) -> None:
    pub = producer(num_slots=3)
    subscribe(probe, pub, address)
    assert probe("map") == "ok 3"
    for _ in range(3):
        seq, slot, data = pub("publish_raw", GEOMETRY, b"metadata!")
        frame_of(probe("recv 5000"))
        answer = probe("parse")
        parts = answer.split()
        assert parts[:3] == ["ok", str(len(GEOMETRY)), b"metadata!".hex()], answer
        for got, g in zip(parts[3:], GEOMETRY, strict=True):
            handle = ArrayHandle(slot, seq + 1, g[1], g[2], g[3], np.dtype(g[4]))
            text, fnv = _expected(data, handle)
            assert got == f"{text}:{fnv:016x}"
        assert probe(f"release {seq} {slot}") == "ok"


@pytest.mark.parametrize(
    ("geometry", "why"),
    [
        ([(None, 4088, (2,), (8,), "float64")], "do not fit"),  # past the slot's end
        ([(None, 4, (2,), (8,), "float64")], "not a multiple of the item size"),  # misaligned
        ([(None, 0, (4,), (-8,), "float64")], "do not fit"),  # before the slot's start
        ([(None, 0, (2, 3), (4, 2), "float32")], "stride 2 of axis 1"),  # misaligned stride
        ([(5, 0, (2,), (4,), "float32")], "not in the frame's"),  # another slot's memory
    ],
)
def test_frame_payloads_that_do_not_fit_are_refused(
    probe: Probe, producer: Callable[..., Producer], address: str, geometry: list, why: str
) -> None:
    pub = producer(num_slots=3)
    subscribe(probe, pub, address)
    assert probe("map") == "ok 3"
    pub("publish_raw", geometry, b"")
    frame_of(probe("recv 5000"))
    answer = probe("parse")
    assert status(answer) == "CIP_ERR_PROTOCOL", answer
    assert why in answer


# ---------------------------------------------------------------- malformed WELCOMEs


class FakePublisher:
    """A listening socket that answers one HELLO with crafted bytes (and fds)."""

    def __init__(self, address: str, reply: Callable[[bytes], tuple[bytes | None, list[int]]]):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(address)
        self.sock.listen(4)
        self.reply = reply
        self.hello = b""
        self.conn: socket.socket | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(20)
        conn, _ = self.sock.accept()
        self.conn = conn
        conn.settimeout(20)
        self.hello = conn.recv(1 << 17)
        data, fds = self.reply(self.hello)
        if data is None:
            conn.close()
            return
        if len(data) > 100_000:  # beyond the default send buffer; SO_SNDBUFFORCE needs root
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, 32, 2 * len(data))  # SO_SNDBUFFORCE
        with contextlib.suppress(OSError):
            if fds:
                socket.send_fds(conn, [data], fds)
            else:
                conn.send(data)

    def close(self) -> None:
        self.thread.join(20)
        if self.conn is not None:
            self.conn.close()
        self.sock.close()


def _welcome(num_slots: int = 2, credit: int = 1, payload: bytes = b"", **over: Any) -> bytes:
    fields = {
        "magic": proto.MAGIC,
        "version": proto.VERSION,
        "type": proto.WELCOME,
        "sub_id": 1,
        "num_slots": num_slots,
        "next_seq": 0,
        "credit": credit,
        "lease_ms": 0,
        "len": len(payload),
    }
    fields.update(over)
    return proto._WELCOME.pack(*fields.values()) + payload


RAW_WELCOMES = {
    # the words both subscribers say, each after "PATH is not a cupy_ipcpool publisher"
    "bad magic": (
        _welcome(magic=0x1234),
        "CIP_ERR_PROTOCOL",
        "(bad magic 0x1234, expected 0x4950)",
    ),
    "bad version": (_welcome(version=9), "CIP_ERR_PROTOCOL", "unsupported protocol version 9"),
    "truncated": (_welcome()[:20], "CIP_ERR_PROTOCOL", "truncated WELCOME"),
    "length field too long": (_welcome(payload=b"ab", len=5), "CIP_ERR_PROTOCOL", "length field"),
    "length field too short": (_welcome(payload=b"ab", len=1), "CIP_ERR_PROTOCOL", "length field"),
    "no slots": (_welcome(num_slots=0), "CIP_ERR_PROTOCOL", "num_slots 0"),
    "too many slots": (_welcome(num_slots=70000), "CIP_ERR_PROTOCOL", "num_slots 70000"),
    "no credit": (_welcome(credit=0), "CIP_ERR_PROTOCOL", "credit"),
    "a frame instead": (
        proto.encode_frame(0, 0, b""),
        "CIP_ERR_PROTOCOL",
        "expected WELCOME, got FRAME",
    ),
    "too large": (
        _welcome(payload=b"x" * (proto.MAX_WELCOME_PAYLOAD + 16)),
        "CIP_ERR_PROTOCOL",
        "larger",
    ),
    "refused": (proto.encode_refuse("go away"), "CIP_ERR_REFUSED", "refused: go away"),
    "malformed refuse": (proto.encode_refuse("go away")[:-2], "CIP_ERR_PROTOCOL", "REFUSE"),
    "hang-up": (None, "CIP_ERR_PUBLISHER_GONE", "closed during the handshake"),
}


def _memfds(n: int, size: int = 4096) -> list[int]:
    fds = []
    for i in range(n):
        fd = os.memfd_create(f"cip-test-{i}", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        fds.append(fd)
    return fds


@pytest.mark.parametrize("case", sorted(RAW_WELCOMES))
def test_malformed_welcome_is_refused_and_nothing_leaks(
    probe: Probe, address: str, case: str
) -> None:
    data, expected, words = RAW_WELCOMES[case]
    if case == "too large" and os.geteuid() != 0:
        pytest.skip("sending a datagram over 1 MiB needs SO_SNDBUFFORCE (root)")
    fds = _memfds(3)  # travel with every reply: the C side must close them
    fake = FakePublisher(address, lambda _hello: (data, fds))
    try:
        base = probe.fds()
        answer = probe(f"open_raw {address} block 0 5000")
        assert status(answer) == expected, answer
        assert words in answer
        if case == "bad magic":  # named as no publisher, as the Python subscriber does
            assert f"{address} is not a cupy_ipcpool publisher" in answer, answer
        assert probe.fds() == base
        hello = proto.decode(fake.hello)
        assert isinstance(hello, proto.Hello)
        assert (hello.mode, hello.credit) == (proto.MODE_BLOCK, 64)
    finally:
        fake.close()
        for fd in fds:
            os.close(fd)


def _descriptor(fds: list[int], num_slots: int) -> PoolDescriptor:
    return PoolDescriptor(
        pool_id=os.urandom(16),
        exporter_pid=os.getpid(),
        exporter_start_time=process_start_time(os.getpid()),
        exporter_uid=os.geteuid(),
        device_uuid=bytes(range(16)),
        device_ordinal=0,
        num_slots=num_slots,
        slot_nbytes=4096,
        alloc_nbytes=4096,
        fds=tuple(fds),
    )


def _gpu_welcome(case: str) -> tuple[bytes, list[int], list[Any]]:
    """A WELCOME of a cupy_ipcpool Publisher for 2 slots, 4 rows, broken as ``case`` says."""
    n, rows, row = 2, 4, 1
    slots = _memfds(n)
    layout = FlagLayout(n, rows)
    page_size = layout.nbytes
    if case == "page not sealed":
        page_fd = os.memfd_create("cip-page", os.MFD_CLOEXEC)
        os.ftruncate(page_fd, page_size)
        page: Any = page_fd
    elif case == "page of another size":
        page = SharedFlags.create(page_size + 4096)
        page_fd = page.fd
    else:
        page = SharedFlags.create(page_size)
        page_fd = page.fd
    desc = _descriptor(slots, n).to_bytes()
    sync_nbytes = page_size
    if case == "descriptor truncated":
        desc = desc[:-3]
    if case == "descriptor of other slots":
        desc = _descriptor(slots + slots, 2 * n).to_bytes()
    if case == "sync size not the layout's":
        sync_nbytes = page_size + 4096
    head = WELCOME_HEAD.pack(
        len(desc), n, rows, rows if case == "row out of range" else row, sync_nbytes
    )
    payload = head + desc
    if case == "payload too short":
        payload = head[:10]
    if case == "descriptor length wrong":
        payload = WELCOME_HEAD.pack(len(desc) + 1, n, rows, row, sync_nbytes) + desc
    fds = [*slots, page_fd]
    if case == "fd missing":
        fds = slots
    closers = [*slots, page]
    return _welcome(num_slots=n, payload=payload), fds, closers


GPU_WELCOMES = [
    "payload too short",
    "descriptor length wrong",
    "descriptor truncated",
    "descriptor of other slots",
    "row out of range",
    "fd missing",
    "page not sealed",
    "page of another size",
    "sync size not the layout's",
]


def _fd_table(pid: int) -> dict[int, tuple[str, tuple[int, int]]]:
    """``fd -> (link target, (st_dev, st_ino))`` of process ``pid``'s open fds."""
    table = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{name}"
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(path)
            table[int(name)] = (os.readlink(path), (st.st_dev, st.st_ino))
    return table


def _mapped_files(pid: int) -> set[tuple[int, int]]:
    """The files process ``pid`` has mapped, as ``(st_dev, st_ino)``.

    The device counts: an inode number alone names a file only within one
    filesystem, and memfds' small numbers recur on others (a library, a device
    file), which once made this check see a memfd mapped that was not.
    """
    found = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6:
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                found.add((os.makedev(major, minor), int(fields[4])))
    return found


def _library_fds(
    table: dict[int, tuple[str, tuple[int, int]]], sent: set[tuple[int, int]]
) -> list[str]:
    """The fds of ``table`` that only the library opens: fds it received (by inode), pidfds,
    sockets, /proc files (the CUDA driver keeps device files, eventfds and pipes)."""
    return [
        f"{fd}={target}"
        for fd, (target, key) in table.items()
        if key in sent or "pidfd" in target or target.startswith(("socket:", "/proc/"))
    ]


def _peer_hung_up(fake: FakePublisher) -> bool:
    """True once the C side closed its end of the fake publisher's connection."""
    fake.thread.join(20)
    conn = fake.conn
    if conn is None:
        return False
    conn.settimeout(10)
    try:
        while conn.recv(1 << 17):  # a BYE may come first
            pass
    except (TimeoutError, OSError):
        return False
    return True


@pytest.mark.parametrize("case", [*GPU_WELCOMES, "valid"])
def test_gpu_welcome_checked_before_anything_is_mapped(
    probe: Probe, address: str, case: str
) -> None:
    data, fds, closers = _gpu_welcome(case)
    sent = {(st.st_dev, st.st_ino) for st in map(os.fstat, fds)}
    pid = probe.proc.pid
    base = _fd_table(pid)
    opens = 2 if case == "valid" else 1
    tables = []
    try:
        for i in range(opens):
            fake = FakePublisher(f"{address}.{i}", lambda _hello: (data, fds))
            try:
                answer = probe(f"open {address}.{i} block 0 5000")
                if case == "valid":
                    # everything checks out; then the GPU is needed (and these memfds are
                    # no VMM allocations, so a machine with a GPU fails at the import)
                    assert status(answer) in (
                        "CIP_ERR_NO_DRIVER",
                        "CIP_ERR_CUDA",
                        "CIP_ERR_DEVICE",
                    ), answer
                else:
                    assert status(answer) == "CIP_ERR_PROTOCOL", answer
                assert _peer_hung_up(fake), "the C side kept its socket open"
            finally:
                fake.close()
            tables.append(_fd_table(pid))
            assert not sent & _mapped_files(pid), "a page is left mapped"
        after = tables[0]
        left = {fd: after[fd] for fd in after.keys() - base.keys()}
        kept = _library_fds(left, sent)
        if case == "valid":
            # cuInit may open a socket of the driver's own (seen on the H200): the library's
            # socket is shown closed by the publisher's hang-up above, and the second open
            # below must add nothing at all
            kept = [fd for fd in kept if "=socket:" not in fd]
        assert not kept, (kept, answer)
        if case == "valid":
            # where a driver is present, the first open initialised it (and it keeps its
            # own fds for the life of the process); a second open must leave none behind
            assert tables[1] == tables[0], (sorted(tables[0].items()), sorted(tables[1].items()))
        else:
            assert after == base, "a malformed WELCOME touched something before the checks"
    finally:
        for c in closers:
            if isinstance(c, int):
                os.close(c)
            else:
                c.close()


# ---------------------------------------------------------------- descriptors and fds


def test_descriptor_parse_matches_python(probe: Probe) -> None:
    fds = _memfds(3)
    try:
        desc = _descriptor(fds, 3)
        raw = desc.to_bytes()
        assert probe(f"desc {raw.hex()}") == f"ok 3 4096 4096 {os.getpid()} {os.geteuid()} -"
        cases = {
            "truncated": raw[:-1],
            "trailing": raw + b"\x00",
            "bad magic": b"XXXX" + raw[4:],
            "future version": raw[:4] + struct.pack("<H", 99) + raw[6:],
            "reserved": raw[:7] + b"\x01" + raw[8:],
        }
        for name, bad in cases.items():
            answer = probe(f"desc {bad.hex()}")
            assert status(answer) == "CIP_ERR_DESCRIPTOR", (name, answer)
    finally:
        for fd in fds:
            os.close(fd)


def _exporter_main(conn: Connection, n: int) -> None:
    """Export ``n`` memfds (each starting with its index) by pid and over an fd server."""
    from cupy_ipcpool._transport import FdServer

    fds = _memfds(n)
    for i, fd in enumerate(fds):
        os.pwrite(fd, struct.pack("<Q", 0xC0DE0000 + i), 0)
    token = os.urandom(16)
    server = FdServer(fds, token=token)
    desc = PoolDescriptor(
        pool_id=token,
        exporter_pid=os.getpid(),
        exporter_start_time=process_start_time(os.getpid()),
        exporter_uid=os.geteuid(),
        device_uuid=bytes(16),
        device_ordinal=0,
        num_slots=n,
        slot_nbytes=4096,
        alloc_nbytes=4096,
        fds=tuple(fds),
        socket_path=server.path,
    )
    conn.send(desc.to_bytes())
    conn.recv()  # until told to go
    server.close()


@pytest.mark.parametrize("transport", ["pidfd", "socket", "auto"])
def test_fetch_fds_from_another_process(probe: Probe, transport: str) -> None:
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_exporter_main, args=(child, 3), daemon=True)
    proc.start()
    try:
        assert parent.poll(60)
        raw = parent.recv()
        base = probe.fds()
        answer = probe(f"fetch {raw.hex()} {transport}")
        if transport == "pidfd" and "ptrace" in answer:
            pytest.skip(f"pidfd_getfd is not allowed here: {answer}")
        heads = [struct.pack("<Q", 0xC0DE0000 + i).hex() for i in range(3)]
        assert answer == f"ok 3 {' '.join(heads)}"
        assert probe.fds() == base, "the probe closed what it fetched"
        # a descriptor of another pool (token) is refused by the fd server
        wrong = bytearray(raw)
        wrong[8:24] = os.urandom(16)
        answer = probe(f"fetch {bytes(wrong).hex()} socket")
        assert status(answer) == "CIP_ERR_REFUSED" and "token" in answer, answer
        assert probe.fds() == base
    finally:
        parent.send("go")
        proc.join(10)
        parent.close()


def test_fetch_fds_after_the_exporter_exited(probe: Probe) -> None:
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_exporter_main, args=(child, 2), daemon=True)
    proc.start()
    assert parent.poll(60)
    raw = parent.recv()
    parent.send("go")
    proc.join(10)
    parent.close()
    answer = probe(f"fetch {raw.hex()} auto")
    assert status(answer) == "CIP_ERR_TRANSPORT", answer
    assert "exited" in answer


# ---------------------------------------------------------------- CMake packaging


CONSUMER_PROJECT = """
cmake_minimum_required(VERSION 3.16)
project(cip_consumer LANGUAGES C CXX)
find_package(cupy_ipcpool_c 0.1 REQUIRED)
add_executable(consumer {consumer})
target_link_libraries(consumer PRIVATE cupy_ipcpool::cupy_ipcpool_c)
add_executable(check_cxx check.cpp)
target_link_libraries(check_cxx PRIVATE cupy_ipcpool::cupy_ipcpool_c)
"""

CHECK_CXX = """
#include <cupy_ipcpool.h>
#include <cstdio>
#include <cstring>
int main() {
    unsigned char junk[8] = {0};
    cip_descriptor d;
    cip_status st = cip_parse_descriptor(junk, sizeof junk, &d);
    std::printf("%s|%s\\n", cip_status_name(st), cip_last_error());
    return st == CIP_ERR_DESCRIPTOR ? 0 : 1;
}
"""


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_cmake_install_and_find_package(tmp_path: Path) -> None:
    if compiler() is None:
        pytest.skip("no C compiler")

    def run(*cmd: str) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"

    build, prefix = tmp_path / "build", tmp_path / "prefix"
    run(
        "cmake",
        "-S",
        str(C_DIR),
        "-B",
        str(build),
        f"-DCMAKE_INSTALL_PREFIX={prefix}",
        # found by CMAKE_PREFIX_PATH: no entry in the user's own package registry
        "-DCIP_REGISTER_PACKAGE=OFF",
        "-DCMAKE_BUILD_TYPE=Release",
    )
    run("cmake", "--build", str(build), "-j2")
    run("cmake", "--install", str(build))
    assert (prefix / "include" / "cupy_ipcpool.h").exists()
    assert (prefix / "include" / "cupy_ipcpool_wire.h").exists()
    assert list(prefix.glob("lib*/cmake/cupy_ipcpool_c/cupy_ipcpool_cConfig.cmake"))
    project = tmp_path / "consumer"
    project.mkdir()
    shutil.copy(C_DIR / "examples" / "consumer.c", project / "consumer.c")
    (project / "check.cpp").write_text(CHECK_CXX)
    (project / "CMakeLists.txt").write_text(CONSUMER_PROJECT.format(consumer="consumer.c"))
    run("cmake", "-S", str(project), "-B", str(project / "build"), f"-DCMAKE_PREFIX_PATH={prefix}")
    run("cmake", "--build", str(project / "build"))
    done = subprocess.run(
        [str(project / "build" / "check_cxx")], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("CIP_ERR_DESCRIPTOR|not a cupy_ipcpool pool descriptor")
    # the example consumer, run with no publisher there, says so and fails
    done = subprocess.run(
        [str(project / "build" / "consumer"), str(tmp_path / "none.sock")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode != 0
    assert "CIP_ERR_TRANSPORT" in done.stderr


def test_plain_cc_build_of_the_example(tmp_path: Path) -> None:
    build_c_program(tmp_path, "consumer", [C_DIR / "examples" / "consumer.c"])


# ---------------------------------------------------------------- the lease book
# The publisher's lease book (c/src/leases.c) through both ways in: the Python publisher's
# _engine.LeaseCore and a plain C program (c/tests/cip_leases_probe.c), which the sanitizer
# lane builds with AddressSanitizer and UndefinedBehaviorSanitizer.  Its rules are tested
# through the Python LeaseBook (tests/test_protocol.py, test_early_release_cpu.py, ...);
# here, random operations give the same answers both ways, under the sanitizers.


@pytest.fixture(scope="module")
def leases_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_c_program(
        tmp_path_factory.mktemp("cleases"),
        "cip_leases_probe",
        [C_DIR / "tests" / "cip_leases_probe.c"],
    )


_LEASE_ERRORS = {
    "ProtocolError": 7,  # CIP_ERR_PROTOCOL
    "LeaseStateError": 100,
    "SlotIndexError": 101,
    "UsageError": 1,  # CIP_ERR_INVALID_ARGUMENT
}


def _py_answer(method: Callable[..., Any], *args: Any) -> str:
    """``method(*args)`` of the binding, answered in the probe's words."""
    try:
        got = method(*args)
    except (IpcPoolError, ValueError) as exc:
        return f"err {_LEASE_ERRORS[type(exc).__name__]} {exc}"
    if got is None or got is True or got is False:
        return f"ok {-1 if got is None else int(got)}"
    if isinstance(got, list):
        return " ".join(["ok", *map(str, got)])
    return f"ok {got}"


def _py_state(core: Any) -> str:
    n = core.num_slots
    slots = [
        f"[{','.join(str(i) for i, _ in core.leases(s))}]/{core.holds(s)}/"
        f"[{','.join(map(str, sorted(core.readers_to_wait(s))))}]"
        for s in range(n)
    ]
    return " ".join(["ok", str(core.releases_due), str(core.ended), str(core.latest_slots), *slots])


def _random_lease_step(
    rng: random.Random, core: Any, n: int, seq: int, now: float
) -> tuple[str, str, int]:
    """One random operation: ``(probe command, the binding's answer, next seq)``."""
    op = rng.choice(
        ["add", "remove", "suspend", "hold", "unhold", "pub", "pub", "pub", "release",
         "release", "settle", "cancel", "flagged"]
    )  # fmt: skip
    sub, slot = rng.randint(0, 5), rng.randint(0, n - 1)
    q = rng.randint(max(0, seq - n), seq + n)
    held = [(i, f, s) for i in core.subscribers() for f, s in core.held_by(i).items()]
    if op in ("release", "cancel", "settle") and held and rng.random() < 0.8:
        sub, q, slot = rng.choice(held)
    if op == "add":
        m, credit = rng.randrange(3), rng.randint(1, 4)
        mode = ("block", "latest", "ahead")[m]
        return f"add {sub} {m} {credit}", _py_answer(core.add_subscriber, sub, mode, credit), seq
    if op == "remove":
        return f"remove {sub}", _py_answer(core.remove_subscriber, sub), seq
    if op == "suspend":
        core.suspend(sub)
        return f"suspend {sub}", "ok", seq
    if op in ("hold", "unhold"):
        s = rng.randint(-1, n)
        want = _py_answer(getattr(core, op), s)
        return f"{op} {s}", "ok" if want == "ok -1" else want, seq
    if op == "pub":
        free = core.free_slots()
        s = rng.choice(free) if free and rng.random() < 0.9 else slot
        on = rng.random() < 0.9
        return (
            f"pub {s} {seq} {now!r} {int(on)}",
            _py_answer(core.publishing, s, seq, now, on),
            seq + 1,
        )
    if op == "release":
        return f"release {sub} {q} {slot}", _py_answer(core.release, sub, q, slot), seq
    if op == "settle":
        return f"settle {sub} {slot}", _py_answer(core.settle, sub, slot), seq
    if op == "cancel":
        return f"cancel {sub} {q} {slot}", _py_answer(core.cancel, sub, q, slot), seq
    pairs = {(i, s) for i in range(6) for s in range(n) if rng.random() < 0.5}
    which = rng.choice([None, slot])
    listed = " ".join(f"{i}:{s}" for i, s in sorted(pairs))
    want = _py_answer(core.settle_flagged, lambda i, s: (i, s) in pairs, which)
    return f"flagged {-1 if which is None else which} {listed}", want, seq


@pytest.mark.parametrize("seed", range(12))
def test_random_lease_book_operations_answer_alike_both_ways_in(
    leases_exe: Path, seed: int
) -> None:
    rng = random.Random(seed)
    n = rng.choice([1, 2, 3, 5, 8])
    core = _engine.LeaseCore(n)
    probe = Probe(leases_exe)
    try:
        assert probe(f"new {n} -1 -1") == "ok"
        seq, now = 0, 0.0
        for _ in range(150):
            now += rng.random()
            line, want, seq = _random_lease_step(rng, core, n, seq, now)
            assert probe(line) == want, (seed, line)
            assert probe("state") == _py_state(core), (seed, line)
    finally:
        probe.close()


# ---------------------------------------------------------------- the publisher's session
# c/src/pub_session.c, and the wire under it (c/src/pub_wire.c), through both ways in (the
# Python publisher's _engine.PublisherSession and the probe's sadd/spub/...), each on socket
# pairs of its own: the same scripted session gives the same answers, and the sanitizer lane runs
# the session's code (departures, eviction, the notice, close) under AddressSanitizer and
# UndefinedBehaviorSanitizer.  Its rules: tests/test_pub_session_cpu.py.


def _left(got: list[tuple[int, str]] | None) -> str:
    return "".join(f" {i}/{why};" for i, why in got or [])


def _binding_session() -> Callable[[str], str]:
    """The probe's session commands, answered by the binding (LeaseCore + PublisherSession)."""
    state: dict[str, Any] = {}

    def do(line: str) -> str:
        cmd, *args = line.split()
        try:
            if cmd == "new":
                state["core"] = _engine.LeaseCore(int(args[0]))
                return "ok"
            core = state["core"]
            if cmd == "snew":
                state["s"] = _engine.PublisherSession(core, float(args[0]), float(args[1]))
                return "ok"
            s = state["s"]
            if cmd == "sadd":
                mode = ("block", "latest", "ahead")[int(args[1])]
                s.add(int(args[0]), mode, int(args[2]), int(args[3]))
                return "ok"
            if cmd == "spub":
                slot, seq, on, n = map(int, args)
                payload = bytes((seq + i) & 0xFF for i in range(n))
                return "ok" + _left(s.publish(slot, seq, on == 1, payload, seq))
            if cmd == "spage":
                state["page"] = bytearray(int(args[0]) * core.num_slots * 4)
                s.flags(state["page"], 0, int(args[0]))
                return "ok"
            if cmd == "sflag":
                row, slot, value = map(int, args)
                struct.pack_into("<I", state["page"], (row * core.num_slots + slot) * 4, value)
                return "ok"
            if cmd == "srow":
                s.set_row(int(args[0]), int(args[1]))
                return "ok"
            if cmd == "ssettle":
                return f"ok {s.settle(int(args[0]))}"
            if cmd == "stake":
                return "ok" + _left(s.take(int(args[0]), int(args[1])))
            if cmd == "spoll":
                return "ok" + _left(s.poll(int(args[0]), int(args[1]), args[2] == "1"))
            if cmd == "sdrop":
                why = line.split(maxsplit=3)[3]
                return "ok" + _left(s.drop(int(args[0]), why, args[1] == "1"))
            if cmd == "sretry":
                return "ok" + _left(s.retry_notices())
            if cmd == "sexpire":
                return "ok" + _left(s.expire())
            if cmd == "sstate":
                return f"ok {s.count} {s.noticing} {s.evictions}"
            if cmd == "sclose":
                return f"ok {int(s.close(int(args[0]) / 1000))}"
            if cmd == "state":
                return _py_state(core)
        except (IpcPoolError, ValueError) as exc:
            return f"err {_LEASE_ERRORS[type(exc).__name__]} {exc}"
        raise AssertionError(line)

    return do


def _session_script(start: Callable[[tuple[int, ...]], Callable[[str], str]]) -> list[str]:
    """One scripted session: four subscribers (block, latest, block, block); a full socket
    past send_timeout, a BYE, a drop, a lease past lease_timeout, the close.  ``start(fds)``
    gives the way in, told the publisher's ends first; it owns them from then on."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(5)]
    theirs = {i: pairs[i - 1][1] for i in range(1, 6)}
    fds = tuple(pairs[i][0].detach() for i in range(5))
    third = socket.socket(fileno=os.dup(fds[2]))  # to fill its queue
    try:
        do = start(fds)
        answers = [do("new 4 -1 -1"), do("snew 0.2 0.02")]
        for i, mode in ((1, 0), (2, 1), (3, 0), (4, 0)):
            answers.append(do(f"sadd {i} {mode} 2 {fds[i - 1]}"))
        answers.append(do(f"sadd 1 0 2 {fds[4]}"))  # there already: its fd is closed
        assert theirs[5].recv(16) == b""
        answers.append(do("spub 0 0 1 16"))
        for i in (1, 2, 3, 4):
            assert proto.decode(theirs[i].recv(64)).seq == 0  # type: ignore[union-attr]
        third.setblocking(False)  # its queue full: past send_timeout
        with contextlib.suppress(BlockingIOError):
            while True:
                third.send(b"x" * 4096)
        third.close()
        answers.append(do("spub 1 1 1 3"))
        theirs[1].send(proto.encode_release(0, 0))
        theirs[1].send(proto.encode_release(1, 1))
        theirs[2].send(proto.encode_bye())
        answers += [do("stake 1000000 8"), do("stake 0 8")]
        answers += [do("sdrop 4 0 the test let it go"), do("sdrop 4 0 twice"), do("sstate")]
        answers.append(do("spub 2 2 1 0"))  # subscriber 1 holds it past lease_timeout
        answers.append(do("sexpire"))  # not yet
        time.sleep(0.25)
        answers += [do("sexpire"), do("sretry"), do("sstate"), do("state")]
        got = {i: [] for i in (1, 3, 4)}
        for i in got:
            with contextlib.suppress(BlockingIOError):
                while data := theirs[i].recv(1 << 17, socket.MSG_DONTWAIT):
                    if data[:1] != b"x":
                        got[i].append(type(proto.decode(data)).__name__)
        # after frame 0, read above: 1 got frames 1 and 2, then its notice; 3 its notice
        # only (frame 1 never fit); 4 frame 1, then nothing (dropped without notice)
        assert got == {1: ["Frame", "Frame", "Refuse"], 3: ["Refuse"], 4: ["Frame"]}, got
        answers.append(do("sclose 0"))
        return answers
    finally:
        third.close()
        for _ours, t in pairs:
            t.close()


def test_the_publishers_session_answers_alike_both_ways_in(leases_exe: Path) -> None:
    probes: list[Probe] = []

    def with_probe(fds: tuple[int, ...]) -> Callable[[str], str]:
        probes.append(Probe(leases_exe, pass_fds=fds))  # the same numbers in the probe
        for fd in fds:
            os.close(fd)  # the probe's from here on
        return probes[0]

    try:
        via_probe = _session_script(with_probe)
    finally:
        for probe in probes:
            probe.close()
    via_binding = _session_script(lambda _fds: _binding_session())
    assert via_probe == via_binding
    assert via_probe[:6] == ["ok"] * 6
    assert via_probe[6].startswith("err 1 subscriber 1 is already registered")
    assert via_probe[7] == "ok"
    assert via_probe[8] == "ok 3/evicted: its socket stayed full for 0.02 s;"
    assert via_probe[9:11] == ["ok 2/said BYE;", "ok"]
    assert via_probe[11:14] == ["ok 4/the test let it go;", "ok", "ok 1 0 1"]
    assert via_probe[14:16] == ["ok", "ok"]
    assert via_probe[16] == "ok 1/evicted: held frame 2 for more than lease_timeout=0.2 s;"
    assert via_probe[17:19] == ["ok", "ok 0 0 2"]
    assert via_probe[19] == "ok 0 9 0 []/0/[] []/0/[] []/0/[] []/0/[]"  # 4 + 4 + 1 leases ended
    assert via_probe[20] == "ok 1"


def test_the_sessions_messages_write_seconds_as_python_does(leases_exe: Path) -> None:
    """The eviction messages name lease_timeout and send_timeout as Python's repr(float)
    writes them ("30.0 s", "0.05 s", "1e-05 s"): the engine's cipi_fmt_seconds, for
    tricky values and for random ones of every magnitude the session accepts."""
    rng = random.Random(44)
    values = [0.0, 5.0, 0.05, 0.2, 10.0, 30.0, 1e-05, 0.0001, 123.456, 1e9, 1 / 3, 2.5e-7]
    values += [rng.uniform(0, 10) ** rng.choice([-8, -3, 1, 3, 9]) for _ in range(300)]
    values = [v for v in values if 0.0 <= v <= 1e9]
    probe = Probe(leases_exe)
    try:
        got = [probe(f"fmt {v!r}") for v in values]
    finally:
        probe.close()
    assert got == [f"ok {v!r}" for v in values]


def _two_subscriber_script(
    start: Callable[[tuple[int, ...]], Callable[[str], str]],
    lines: Callable[[tuple[int, ...]], list[str]],
) -> list[str]:
    """``lines(fds)`` answered by the way in ``start(fds)`` gives, over two socket pairs (the
    publisher's ends are ``fds``; the way in owns them from then on)."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(2)]
    fds = tuple(pairs[i][0].detach() for i in range(2))
    try:
        do = start(fds)
        return [do(line) for line in lines(fds)]
    finally:
        for _ours, t in pairs:
            t.close()


def _answered_alike_both_ways(
    leases_exe: Path, lines: Callable[[tuple[int, ...]], list[str]]
) -> list[str]:
    """The probe's answers to ``lines``, checked equal to the binding's."""
    probes: list[Probe] = []

    def with_probe(fds: tuple[int, ...]) -> Callable[[str], str]:
        probes.append(Probe(leases_exe, pass_fds=fds))
        for fd in fds:
            os.close(fd)  # the probe's from here on
        return probes[0]

    try:
        via_probe = _two_subscriber_script(with_probe, lines)
    finally:
        for probe in probes:
            probe.close()
    assert via_probe == _two_subscriber_script(lambda _fds: _binding_session(), lines)
    return via_probe


def _settle_lines(fds: tuple[int, ...]) -> list[str]:
    """Leases that end at the read flags the session reads from a page (Publisher(ahead=True)):
    an "ahead" and a "block" subscriber, rows 0 and 1; a flag ends a lease only once it holds
    the generation published in its slot (here each frame's seq), or a later one."""
    return [
        "new 4 -1 -1",
        "snew 0 5",
        f"sadd 1 2 2 {fds[0]}",
        f"sadd 2 0 2 {fds[1]}",
        "ssettle -1",  # no page yet: nothing
        "srow 1 0",  # no page yet: refused
        "spage 2",
        "srow 1 0",
        "srow 2 1",
        "srow 3 0",  # not in the book
        "srow 1 2",  # no such row
        "spub 0 7 1 0",
        "spub 1 8 1 0",
        "ssettle -1",  # every flag still 0
        "sflag 0 0 7",  # subscriber 1 is done with slot 0's frame 7
        "ssettle 1",  # slot 1 only: nothing
        "ssettle -1",
        "sflag 1 0 6",  # subscriber 2: an older generation
        "ssettle 0",
        "sflag 1 0 9",  # past it (cyclic): done
        "ssettle 0",
        "sflag 0 1 4294967295",  # 2**32 - 1 is behind 8, cyclically
        "ssettle 1",
        "state",
        "sclose 0",
    ]


def test_leases_end_at_the_read_flags_alike_both_ways_in(leases_exe: Path) -> None:
    via_probe = _answered_alike_both_ways(leases_exe, _settle_lines)
    assert via_probe[4] == "ok 0"
    assert via_probe[5].startswith("err 1 row 0 is not one of the page's 0 rows")
    assert via_probe[9].startswith("err 1 subscriber 3 is not in the lease book")
    assert via_probe[10].startswith("err 1 row 2 is not one of the page's 2 rows")
    assert via_probe[13] == "ok 0"
    assert via_probe[15:17] == ["ok 0", "ok 1"]
    assert via_probe[18] == "ok 0" and via_probe[20] == "ok 1"
    assert via_probe[22] == "ok 0"
    assert via_probe[23].startswith("ok 2 2 0 []/0/[1,2] [1,2]/0/[] ")


def _poll_lines(fds: tuple[int, ...]) -> list[str]:
    """The publisher's wait for a lease to end (c/src/pub_poll.c): at a read flag, looked at
    before a wait, during a spin and between a wait's steps; at an eviction past
    lease_timeout; or not at all (the wait's timeout)."""
    return [
        "new 4 -1 -1",
        "snew 0.1 5",
        f"sadd 1 2 2 {fds[0]}",  # "ahead", row 0
        f"sadd 2 0 2 {fds[1]}",  # "block", row 1: sends nothing, sets no flag
        "spage 2",
        "srow 1 0",
        "srow 2 1",
        "spub 0 7 1 0",
        "spoll 0 0 1",  # no flag set: nothing ended, no wait
        "sflag 0 0 7",
        "spoll 0 0 0",  # not settling: the flag is not looked at
        "spoll 0 0 1",  # subscriber 1's lease ends at its flag
        "state",
        "spoll 5000000 0 1",  # subscriber 2 holds frame 7: evicted at lease_timeout
        "state",
        "spub 1 8 1 0",
        "sflag 0 1 8",
        "spoll 5000000 200000000 1",  # a spin's first look ends it
        "spoll 20000 0 0",  # nothing ends: the wait's timeout
        "sstate",
        "sclose 0",
    ]


def test_the_publishers_wait_answers_alike_both_ways_in(leases_exe: Path) -> None:
    via_probe = _answered_alike_both_ways(leases_exe, _poll_lines)
    assert via_probe[:11] == ["ok"] * 11
    assert via_probe[11] == "ok"
    assert via_probe[12] == "ok 1 1 0 [2]/0/[1] []/0/[] []/0/[] []/0/[]"  # a RELEASE due
    assert via_probe[13] == "ok 2/evicted: held frame 7 for more than lease_timeout=0.1 s;"
    assert via_probe[14] == "ok 1 2 0 []/0/[1] []/0/[] []/0/[] []/0/[]"
    assert via_probe[15:19] == ["ok"] * 4
    assert via_probe[19:] == ["ok 1 0 1", "ok 0"]  # subscriber 2's notice is queued


# ---------------------------------------------------------------- the publisher's reader rows
# c/src/reader_rows.c through both ways in (the Python publisher's _engine.ReaderRows and
# the probe's r... commands): the same script gives the same answers, and the sanitizer lane
# runs the rows' code under AddressSanitizer and UndefinedBehaviorSanitizer.  Its rules:
# tests/test_reader_rows_cpu.py.


def _binding_rows() -> Callable[[str], str]:
    """The probe's rows commands, answered by the binding (ReaderRows over a bytearray)."""
    state: dict[str, Any] = {}

    def do(line: str) -> str:
        cmd, *args = line.split()
        if cmd == "rnew":
            slots, n = int(args[0]), int(args[1])
            state["page"] = bytearray(4 * slots * n)
            state["rows"] = _engine.ReaderRows(state["page"], 0, n, slots)
            state["slots"] = slots
            return "ok"
        rows, page = state["rows"], state["page"]
        gens = [int(a) for a in args[2:]] if cmd == "rleave" else [int(a) for a in args]
        try:
            if cmd == "rassign":
                index = rows.assign(int(args[0]), int(args[1]))
                return f"ok {'none' if index is None else index}"
            if cmd == "radopt":
                rows.adopt(int(args[0]))
                return "ok"
            if cmd == "rleave":
                rows.leave(int(args[0]), gens, args[1] == "1")
                return "ok"
            if cmd == "rsettle":
                return f"ok {rows.settle(args[0] == '1')}"
            if cmd == "rclose":
                rows.close(gens)
                return "ok"
            if cmd == "rall":
                return f"ok {int(rows.all_settled())}"
            if cmd == "rflag":
                row, slot, value = map(int, args)
                struct.pack_into("<I", page, (row * state["slots"] + slot) * 4, value)
                return "ok"
            if cmd == "rstate":
                words = struct.unpack(f"<{len(page) // 4}I", page)
                n = state["slots"]
                flags = " ".join(
                    ",".join(map(str, words[i : i + n])) for i in range(0, len(words), n)
                )
                return f"ok {rows.live} {rows.departed} {rows.forced} {flags}"
        except UsageError as exc:
            return f"err {_LEASE_ERRORS['UsageError']} {exc}"
        raise AssertionError(line)

    return do


def _rows_script(do: Callable[[str], str]) -> list[str]:
    """Three rows of two slots: a reader that never read, a live one that leaves before its
    flags are in, one that dies, the oldest departed row forced for a newcomer, the close."""
    live = subprocess.Popen(["sleep", "60"])
    dying = subprocess.Popen(["sleep", "60"])
    try:
        answers = [do("rnew 2 3")]
        answers += [do(f"rassign {i} {live.pid}") for i in (1, 2)]
        answers += [do(f"rassign 3 {dying.pid}"), do("rassign 4 1"), do("rassign 1 1")]
        answers += [do("radopt 2"), do("radopt 3"), do("radopt 9")]
        answers += [do("rleave 1 0 5 5"), do("rstate")]  # never adopted: free at once
        answers += [do("rflag 1 0 7"), do("rleave 2 0 7 4294967298"), do("rsettle 0")]
        dying.kill()
        dying.wait()
        answers += [do("rleave 3 0 6 6"), do("rstate")]  # dead: forced, not kept
        answers += [do(f"rassign 5 {live.pid}"), do(f"rassign 6 {live.pid}")]
        answers += [do(f"rassign 7 {live.pid}"), do("rstate")]  # row 1: the oldest, forced
        answers += [do("radopt 5"), do("rclose 8 8"), do("rall"), do("rflag 0 0 8")]
        answers += [do("rflag 0 1 9"), do("rall"), do("rsettle 0"), do("rstate")]
        return answers
    finally:
        for proc in (live, dying):
            proc.kill()
            proc.wait()


def test_the_reader_rows_answer_alike_both_ways_in(leases_exe: Path) -> None:
    probe = Probe(leases_exe)
    try:
        via_probe = _rows_script(probe)
    finally:
        probe.close()
    via_binding = _rows_script(_binding_rows())
    assert via_probe == via_binding
    assert via_probe[:5] == ["ok", "ok 0", "ok 1", "ok 2", "ok none"]
    assert via_probe[5] == "err 1 subscriber 1 has a row already"
    assert via_probe[8] == "err 1 subscriber 9 has no row"
    assert via_probe[10] == "ok 2 0 0 0,0 0,0 0,0"  # a reader that read nothing: no wait
    assert via_probe[13] == "ok 1"  # slot 1 short of 2 (4294967298 modulo 2**32)
    assert via_probe[15] == "ok 0 1 2 0,0 7,0 6,6"  # the dead one's row forced
    assert via_probe[16:19] == ["ok 0", "ok 2", "ok 1"]  # row 1 departed: taken last
    assert via_probe[19] == "ok 3 0 3 0,0 7,2 6,6"  # ... and forced where it was short
    assert via_probe[22] == "ok 0" and via_probe[25:] == ["ok 1", "ok 0", "ok 0 0 3 8,9 7,2 6,6"]
