"""The producer's calls in C (``c/src/producer.c``), driven from a plain C program.

``c/tests/cip_producer_probe.c`` is a publisher with no GPU and no Python: a lease book, a
session and the accept thread under the producer's calls, as a C publisher runs them.
The subscribers are real sockets of this process speaking the wire by hand (the
reference encoders of ``channel._protocol``).  The Python publisher runs the same calls
through ``_engine.Producer`` (the rest of the CPU tier); here they run where the sanitizer
lanes can watch them (.ci/run).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _memfd_backend import MemfdConsumer
from test_c_library import C_DIR, Probe, build_c_program

from cupy_ipcpool import EndOfStream
from cupy_ipcpool.channel import _protocol as proto

#: Bound on every wait here (only a broken build waits that long).
BOUND = 10.0


@pytest.fixture(scope="module")
def producer_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_c_program(
        tmp_path_factory.mktemp("cproducer"),
        "cip_producer_probe",
        [C_DIR / "tests" / "cip_producer_probe.c"],
    )


@pytest.fixture
def probe(producer_exe: Path) -> Iterator[Probe]:
    p = Probe(producer_exe)
    try:
        yield p
    finally:
        p.close()


def _listen(
    probe: Probe, tmp_path: Path, slots: int = 4, max_subs: int = 8, lease_ms: int = 0
) -> str:
    path = tmp_path / "p.sock"
    assert probe(f"listen {path} {slots} {max_subs} {lease_ms}") == "ok"
    return str(path)


def _subscribe(address: str, mode: str = "block", credit: int = 8) -> tuple[socket.socket, int]:
    """A subscriber by hand: HELLO, WELCOME; its socket and sub_id."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.settimeout(BOUND)
        s.connect(address)
        s.send(proto.encode_hello(proto.MODE_CODES[mode], credit, os.getpid(), b""))
        data, fds, _flags, _addr = socket.recv_fds(s, proto.MAX_WELCOME_SIZE + 1, 8)
        for fd in fds:
            os.close(fd)
        welcome = proto.decode(data)
        assert isinstance(welcome, proto.Welcome), welcome
    except BaseException:
        s.close()
        raise
    assert welcome.payload == b"pay" and len(fds) == 1
    return s, welcome.sub_id


def _adopted(probe: Probe, n: int) -> list[str]:
    """``poll 0`` until ``news`` tells of n more adopted; their ``id:mode:credit``."""
    deadline = time.monotonic() + BOUND
    joined: list[str] = []
    while len(joined) < n:
        assert probe("poll 0").startswith("ok")
        news = probe("news").split(" / ")
        joined += news[0].split()[2:]
        assert time.monotonic() < deadline, joined
        time.sleep(0.002)
    return joined


def _frame(s: socket.socket) -> proto.Frame:
    msg = proto.decode(s.recv(proto.MAX_FRAME_SIZE))
    assert isinstance(msg, proto.Frame), msg
    return msg


def test_a_c_publisher_streams_to_subscribers_round_robin(probe: Probe, tmp_path: Path) -> None:
    """Frames go out in seq order to every subscriber, in slots picked round-robin after the
    last published; releases end the leases and poll counts each once."""
    address = _listen(probe, tmp_path)
    one, id1 = _subscribe(address)
    two, id2 = _subscribe(address, "latest", credit=1)
    assert sorted(_adopted(probe, 2)) == sorted([f"{id1}:block:2", f"{id2}:latest:1"])
    got = []
    for n in range(6):
        slot = int(probe("acquire 1000").split()[1])
        assert probe(f"publish {slot} frame{n}") == f"ok {n}"
        f = _frame(one)
        assert (f.seq, f.slot, f.payload) == (n, slot, f"frame{n}".encode())
        got.append(slot)
        one.send(proto.encode_release(f.seq, f.slot))
        if n == 0:  # the latest one takes the first and holds it
            g = _frame(two)
            assert (g.seq, g.slot) == (0, slot)
        assert probe("poll 1000") == "ok 1"
    # slot 0 stays the latest subscriber's (credit 1, frame 0 held): the pick passes it
    assert got == [0, 1, 2, 3, 1, 2]
    assert probe("state") == "ok 6 2 2 0"  # next seq, last slot, subscribers, evictions
    two.send(proto.encode_release(0, 0))
    assert probe("poll 1000") == "ok 1"
    assert probe("acquire 0") == "ok 3"  # after the last published (2)
    one.close()
    two.close()


def test_acquire_waits_for_a_release_and_times_out_without_one(
    probe: Probe, tmp_path: Path
) -> None:
    """With every slot leased, acquire waits for a RELEASE (then returns that slot) and says
    timeout when none comes."""
    address = _listen(probe, tmp_path, slots=2)
    s, _sid = _subscribe(address, credit=2)
    _adopted(probe, 1)
    for n in range(2):
        slot = int(probe("acquire 1000").split()[1])
        assert probe(f"publish {slot} x") == f"ok {n}"
    frames = [_frame(s), _frame(s)]
    t0 = time.monotonic()
    assert probe("acquire 200") == "timeout"
    assert time.monotonic() - t0 >= 0.2
    s.send(proto.encode_release(frames[1].seq, frames[1].slot))
    assert probe("acquire 5000") == f"ok {frames[1].slot}"
    assert probe("poll 0") == "ok 1"
    s.close()


def test_a_departure_is_told_once_and_frees_its_place(probe: Probe, tmp_path: Path) -> None:
    """A subscriber that hangs up holding a frame: its lease comes back, news tells why, and
    its place under max_subscribers is free again."""
    address = _listen(probe, tmp_path, slots=4, max_subs=1)
    s, sid = _subscribe(address)
    _adopted(probe, 1)
    slot = int(probe("acquire 1000").split()[1])
    assert probe(f"publish {slot} x") == "ok 0"
    _frame(s)
    refused = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    refused.settimeout(BOUND)
    refused.connect(address)
    refused.send(proto.encode_hello(proto.MODE_CODES["block"], 1, os.getpid(), b""))
    reply = proto.decode(refused.recv(proto.MAX_WELCOME_SIZE))
    assert isinstance(reply, proto.Refuse) and "max_subscribers" in reply.reason
    refused.close()
    s.close()
    assert probe("poll 5000") == "ok 1"  # its lease, back with its departure
    news = probe("news").split(" / ")
    assert news[0] == "ok 0" and news[1] == "0"
    assert news[2] == f"1 {sid}:disconnected|", news
    assert probe("news") == "ok 0 / 0 / 0"
    again, _ = _subscribe(address)  # max_subscribers=1: the departed one's place
    _adopted(probe, 1)
    again.close()


def test_a_subscriber_gone_before_adoption_is_told_gone(probe: Probe, tmp_path: Path) -> None:
    """One welcomed that hangs up before the producer's next call is told as gone, never
    as joined."""
    address = _listen(probe, tmp_path)
    s, sid = _subscribe(address)
    s.close()
    deadline = time.monotonic() + BOUND
    while True:
        assert probe("poll 0").startswith("ok")
        news = probe("news")
        if news != "ok 0 / 0 / 0":
            break
        assert time.monotonic() < deadline
        time.sleep(0.005)
    # adopted first and then found gone, or gone before adoption: told once, either way
    joined, gone, left = news.split(" / ")
    if gone == f"1 {sid}":
        assert joined == "ok 0" and left == "0"
    else:
        assert joined == f"ok 1 {sid}:block:2", news


def test_stop_adopts_the_welcomed_for_the_bye_and_close_gives_back_every_fd(
    probe: Probe, tmp_path: Path
) -> None:
    """At stop, the welcomed not yet adopted join the session untold, so close says BYE to
    them too; afterwards the probe holds no socket of theirs."""
    before = int(probe("fds").split()[1])
    address = _listen(probe, tmp_path)
    s, _sid = _subscribe(address)
    assert probe("stop") == "ok 0 / 0 / 0"
    assert probe("state").split()[3] == "1"  # in the session, for the BYE
    assert probe("close 0") == "ok 0"
    msg = proto.decode(s.recv(64))
    assert isinstance(msg, proto.Bye)
    s.close()
    # the stopped acceptor closed the listener, its wake-up and its copies of the WELCOME's
    # fd; the session closed the subscriber's socket: the probe's own memfd is what is left
    assert int(probe("fds").split()[1]) == before + 1


# -- the public API: cip_pub_* to Python subscribers ---------------------------------------


@pytest.fixture(scope="module")
def pub_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_c_program(
        tmp_path_factory.mktemp("cpub"), "cip_pub_probe", [C_DIR / "tests" / "cip_pub_probe.c"]
    )


def _lines_until(proc: subprocess.Popen[str], want: str) -> list[str]:
    """The C publisher's lines up to the first that starts with ``want``."""
    lines = []
    while True:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line, f"the C publisher ended before {want!r}: {lines}"
        lines.append(line.strip())
        if line.startswith(want):
            return lines


def _tell_close(proc: subprocess.Popen[str]) -> None:
    """Tell the C publisher (cip_pub_probe) to close: a line on its stdin."""
    assert proc.stdin is not None
    proc.stdin.write("close\n")
    proc.stdin.flush()


def _c_publisher(exe: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [exe, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=None if env is None else {**os.environ, **env},
    )


def test_a_c_publisher_of_the_api_streams_to_python_subscribers(
    pub_exe: Path, tmp_path: Path
) -> None:
    """cip_pub_open_raw / acquire / publish_raw / poll / close: two Python subscriber cores
    (block, latest) map the C publisher's memfd slots and check every frame's bytes; the
    block one gets every frame in order, each slot's content intact until released; close
    says BYE (EndOfStream) and waits for both to hang up (closing is not their leaving:
    on_leave is not told, as in Python)."""
    address = str(tmp_path / "p.sock")
    frames = 40
    with _c_publisher(pub_exe, address, str(frames), "2", "2000") as proc:
        try:
            assert _lines_until(proc, "listening") == ["listening"]
            out = []
            with (
                MemfdConsumer(address, mode="block", credit=2) as block,
                MemfdConsumer(address, mode="latest") as latest,
            ):
                seqs, latest_seqs = [], []
                for _ in range(frames):
                    f = block.recv(BOUND)  # checks the slot's bytes
                    assert f.payload == f"frame {f.seq}".encode()
                    seqs.append(f.seq)
                    block.release(f)  # checks them again
                    with contextlib.suppress(TimeoutError):
                        g = latest.recv(0.0)
                        latest_seqs.append(g.seq)
                        latest.release(g)
                assert seqs == list(range(frames))
                assert latest_seqs == sorted(set(latest_seqs)) and latest_seqs, latest_seqs
                out += _lines_until(proc, "published all")
                _tell_close(proc)
                with pytest.raises(EndOfStream):
                    block.recv(BOUND)
                with pytest.raises(EndOfStream):
                    while True:  # the frames queued before the BYE, then the end
                        latest.release(latest.recv(BOUND))
            out += proc.communicate(timeout=BOUND)[0].splitlines()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, out
    assert out[:2] == ["joined 1 block 2", "joined 2 latest 1"], out
    assert not [line for line in out if line.startswith(("left", "error"))], out
    assert out[-1] == "closed CIP_OK", out  # both hung up within the linger


def test_a_forked_child_closing_a_c_publisher_leaves_the_parent_serving(
    pub_exe: Path, tmp_path: Path
) -> None:
    """A child forked from the C publisher's process may not use it (cip_pub_poll refused)
    and its cip_pub_close closes only its copies (CIP_ERR_TIMEOUT: the subscribers are the
    parent's, connected): the subscriber hears no BYE, the socket file stays, and the
    parent's close ends the stream (the Python publisher's rule, test_publisher_fork_cpu)."""
    address = str(tmp_path / "p.sock")
    with _c_publisher(pub_exe, address, "3", "1", "2000", env={"CIP_PROBE_FORK": "1"}) as proc:
        try:
            assert _lines_until(proc, "listening") == ["listening"]
            with MemfdConsumer(address, mode="block") as sub:
                for seq in range(3):
                    f = sub.recv(BOUND)
                    assert f.seq == seq
                    sub.release(f)
                out = _lines_until(proc, "published all")
                assert "child CIP_ERR_INVALID_ARGUMENT CIP_ERR_TIMEOUT 0" in out, (
                    out
                )  # refused to poll; closed its copies only
                assert os.path.exists(address)
                with pytest.raises(TimeoutError):
                    sub.recv(0.2)  # no BYE: the child said nothing
                _tell_close(proc)
                with pytest.raises(EndOfStream):
                    sub.recv(BOUND)
            out += proc.communicate(timeout=BOUND)[0].splitlines()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0 and out[-1] == "closed CIP_OK", out
    assert not os.path.exists(address)


def test_a_c_publisher_restarts_at_the_path_of_a_killed_one_whose_forked_child_lives(
    pub_exe: Path, tmp_path: Path
) -> None:
    """The C publisher's process forks a child that lives on, and is killed: its socket file
    is stale (the child closed its copy of the listener at the fork: the library's
    pthread_atfork handler), so a new publisher takes the path (the Python publisher's
    rule, test_fork_children_cpu)."""
    from _memfd_backend import MemfdProducer

    address = str(tmp_path / "p.sock")
    env = {"CIP_PROBE_LINGER_CHILD": "1"}
    child = 0
    with _c_publisher(pub_exe, address, "0", "0", "0", env=env) as proc:
        try:
            lines = _lines_until(proc, "child")
            assert lines[0] == "listening", lines
            child = int(lines[-1].split()[1])
            proc.kill()
            proc.wait(BOUND)
            with MemfdProducer(address, 4) as prod, MemfdConsumer(address) as sub:
                prod.wait_subscribers(1, timeout=BOUND)
                assert prod.publish_next(timeout=BOUND) == 0
                sub.release(sub.recv(BOUND))
            assert os.path.exists(f"/proc/{child}")  # it lives on: it held nothing
        finally:
            if child:
                os.kill(child, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()


def test_the_api_publisher_refuses_what_it_cannot_serve(pub_exe: Path, tmp_path: Path) -> None:
    """An ahead subscriber is refused with the reason (no read flags); a live path is refused
    to a second publisher; the socket file goes with the publisher."""
    address = str(tmp_path / "p.sock")
    with _c_publisher(pub_exe, address, "0", "1", "2000") as proc:
        try:
            _lines_until(proc, "listening")
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                s.settimeout(BOUND)
                s.connect(address)
                s.send(proto.encode_hello(proto.MODE_CODES["ahead"], 1, os.getpid(), b""))
                reply = proto.decode(s.recv(proto.MAX_WELCOME_SIZE))
            finally:
                s.close()
            assert isinstance(reply, proto.Refuse) and "no read flags" in reply.reason
            second = subprocess.run(
                [pub_exe, address, "0", "1", "0"],
                capture_output=True,
                text=True,
                timeout=BOUND,
                stdin=subprocess.DEVNULL,
            )
            assert second.returncode == 1
            assert "CIP_ERR_TRANSPORT a publisher is already listening at" in second.stdout
            with MemfdConsumer(address) as sub:  # the one it waits for
                _lines_until(proc, "published all")
                _tell_close(proc)
                with pytest.raises(EndOfStream):
                    sub.recv(BOUND)
            out = proc.communicate(timeout=BOUND)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert out.splitlines()[-1] == "closed CIP_OK"
    assert not os.path.exists(address)


def test_the_api_publisher_tells_on_leave_who_left_and_takes_its_leases_back(
    pub_exe: Path, tmp_path: Path
) -> None:
    """A subscriber that leaves holding frames: on_leave hears who it was (as on_join did) and
    why, its leases come back (the other subscriber's stream goes on to the end)."""
    address = str(tmp_path / "p.sock")
    frames = 6
    with _c_publisher(pub_exe, address, str(frames), "2", "2000") as proc:
        try:
            _lines_until(proc, "listening")
            with MemfdConsumer(address, mode="block", credit=4) as stays:
                quitter = MemfdConsumer(address, mode="block", credit=4)
                try:
                    held = quitter.recv(BOUND)  # and never released
                finally:
                    quitter.close()  # says BYE holding it
                for n in range(frames):
                    f = stays.recv(BOUND)
                    assert f.seq == n and held.seq == 0
                    stays.release(f)
                out = _lines_until(proc, "left")
                assert out[-1] == "left 2 1 block 2 said BYE", out  # as on_join told it
                out += _lines_until(proc, "published all")
                _tell_close(proc)
                with pytest.raises(EndOfStream):
                    stays.recv(BOUND)
            out += proc.communicate(timeout=BOUND)[0].splitlines()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0 and out[-1] == "closed CIP_OK", out
    published = [line.split()[1] for line in out if line.startswith("published ")]
    assert published == [*map(str, range(frames)), "all"], out


def test_the_c_host_publisher_example_feeds_numpy_arrays_to_python(tmp_path: Path) -> None:
    """``c/examples/host_publisher.c``: a C program's frames in host memory, read in Python as
    NumPy arrays by ``HostChannelSubscriber`` (the payload written by ``cip_host_frame_encode``,
    the arrays placed by ``cip_array_layout``): every frame's image holds its number, so does
    its second array, its metadata says so, then the stream ends."""
    import numpy as np

    from cupy_ipcpool.remote import HostChannelSubscriber

    exe = build_c_program(tmp_path, "host_publisher", [C_DIR / "examples" / "host_publisher.c"])
    address = str(tmp_path / "host.sock")
    frames = 5
    with _c_publisher(exe, address, str(frames)) as proc:
        try:
            assert _lines_until(proc, "listening") == [f"listening at {address}"]
            with HostChannelSubscriber(address) as sub:
                for n in range(frames):
                    with sub.recv(timeout=BOUND) as f:
                        assert (f.seq, f.metadata) == (n, f"frame {n}".encode())
                        image, number = f.arrays
                        assert image.dtype == np.float32 and image.shape == (480, 640)
                        assert (image == n).all()
                        assert number.dtype == np.uint64 and number.tolist() == [n]
                with pytest.raises(EndOfStream):
                    sub.recv(timeout=BOUND)
            out = proc.communicate(timeout=BOUND)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0 and out.strip() == f"published {frames} frames; CIP_OK", out
