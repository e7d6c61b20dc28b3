"""The publisher's accept thread in C (``c/src/acceptor.c``), driven from a plain C program.

``c/tests/cip_accept_probe.c`` runs the acceptor as a C publisher would (rows of read
flags of ``c/src/reader_rows.c`` behind a mutex, one fd sent with each WELCOME); the
clients are real sockets of this process.  The Python publisher runs the same thread
through ``_engine.Acceptor`` (tests/test_session.py, test_hardening.py and the rest of
the CPU tier); here it runs where the sanitizer lanes can watch it: AddressSanitizer +
UndefinedBehaviorSanitizer, and ThreadSanitizer (.ci/run).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_c_library import C_DIR, Probe, build_c_program

from cupy_ipcpool.channel import _protocol as proto

#: Bound on every wait here (only a broken build waits that long).
BOUND = 10.0


@pytest.fixture(scope="module")
def accept_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_c_program(
        tmp_path_factory.mktemp("caccept"),
        "cip_accept_probe",
        [C_DIR / "tests" / "cip_accept_probe.c"],
    )


@pytest.fixture
def probe(accept_exe: Path) -> Iterator[Probe]:
    p = Probe(accept_exe)
    try:
        yield p
    finally:
        p.close()


def _listen(
    probe: Probe,
    path: Path,
    rows: int = 2,
    per_uid: int = 8,
    handshake_ms: int = 5000,
    max_subs: int = 64,
) -> str:
    assert probe(f"listen {path} {rows} {per_uid} {handshake_ms} {max_subs}") == "ok"
    assert probe("start") == "ok"
    return str(path)


def _client(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.settimeout(BOUND)
        s.connect(address)
    except BaseException:
        s.close()
        raise
    return s


def _hello(mode: str = "block", credit: int = 5, payload: bytes = b"hi") -> bytes:
    return proto.encode_hello(proto.MODE_CODES[mode], credit, os.getpid(), payload)


def _answer(s: socket.socket) -> tuple[proto.Message, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(s, proto.MAX_WELCOME_SIZE + 1, 8)
    for fd in fds:
        os.close(fd)
    return proto.decode(data), fds


def _refused(s: socket.socket) -> str:
    reply, _ = _answer(s)
    assert isinstance(reply, proto.Refuse), reply
    return reply.reason


def _until(probe: Probe, field: int, want: str) -> list[str]:
    """``state`` until its ``field`` says ``want`` (the accept thread's doing)."""
    deadline = time.monotonic() + BOUND
    while True:
        state = probe("state").split()
        if state[field] == want:
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.005)


def _until_answer(probe: Probe, command: str, want: str) -> None:
    """``command`` until the probe answers ``want`` (the accept thread's doing)."""
    deadline = time.monotonic() + BOUND
    while (got := probe(command)) != want:
        assert time.monotonic() < deadline, got
        time.sleep(0.005)


def test_each_subscriber_is_welcomed_with_its_row_and_the_fds(probe: Probe, tmp_path: Path) -> None:
    """The WELCOME carries the producer's next seq, the granted credit, the payload with
    the subscriber's own row, and the fds; the producer takes each with what it asked for."""
    address = _listen(probe, tmp_path / "p.sock")
    assert probe("seq 7") == "ok"
    one = _client(address)
    one.send(_hello(credit=5, payload=b"hi"))
    reply, fds = _answer(one)
    assert isinstance(reply, proto.Welcome)
    assert (reply.sub_id, reply.num_slots, reply.next_seq, reply.credit) == (1, 4, 7, 2)
    assert reply.payload == b"pay\0\0\0\0!" and len(fds) == 1
    two = _client(address)
    two.send(_hello("ahead", credit=1, payload=b""))
    reply, _ = _answer(two)
    assert isinstance(reply, proto.Welcome) and reply.payload == b"pay\1\0\0\0!"
    assert probe("take") == "ok 2 1:0:block:2:6869 2:1:ahead:1: / 0"
    three = _client(address)
    three.send(_hello())
    assert _refused(three) == "no free subscriber row in the sync page"
    assert probe("drop 1") == "ok"  # its row is free again
    four = _client(address)
    four.send(_hello())
    reply, _ = _answer(four)
    assert isinstance(reply, proto.Welcome) and reply.sub_id == 3  # a refused one took no id
    assert reply.payload == b"pay\0\0\0\0!"
    for s in (one, two, three, four):
        s.close()


@pytest.mark.parametrize(
    ("send", "reason"),
    [
        (_hello("latest"), "no latest here"),
        (b"\x00" * 20, "bad HELLO: bad magic"),
        (proto.encode_bye(), "bad HELLO: expected HELLO, got BYE"),
        (_hello(payload=b"abcd")[:-2], "bad HELLO: HELLO length field says 4 bytes"),
    ],
    ids=["mode-refused", "garbage", "not-a-hello", "truncated"],
)
def test_what_is_refused_is_told_why_and_takes_nothing(
    probe: Probe, tmp_path: Path, send: bytes, reason: str
) -> None:
    address = _listen(probe, tmp_path / "p.sock")
    s = _client(address)
    s.send(send)
    assert _refused(s).startswith(reason)
    assert s.recv(64) == b""  # and closed
    s.close()
    assert probe("state").split()[1:4] == ["0", "0", "0"]  # no row, no id, nothing to take


def test_one_that_hangs_up_before_it_is_taken_gives_its_row_back(
    probe: Probe, tmp_path: Path
) -> None:
    address = _listen(probe, tmp_path / "p.sock")
    s = _client(address)
    s.send(_hello())
    assert isinstance(_answer(s)[0], proto.Welcome)
    assert probe("state").split()[1] == "1"  # its row
    s.close()
    _until(probe, 1, "0")
    assert probe("take") == "ok 0 / 1 1:0"


def test_handshakes_have_one_deadline_and_a_cap_per_uid(probe: Probe, tmp_path: Path) -> None:
    address = _listen(probe, tmp_path / "p.sock", per_uid=2, handshake_ms=300)
    idle = [_client(address) for _ in range(3)]
    assert "the oldest, made room" in _refused(idle[0])
    _until_answer(probe, f"hs {os.getuid()}", "ok 2")
    assert probe("hs -1") == "ok 2"
    for s in idle[1:]:
        assert _refused(s) == "no HELLO within 0.3 s"
    assert probe("hs -1") == "ok 0"
    late = _client(address)  # the thread still serves
    late.send(_hello())
    assert isinstance(_answer(late)[0], proto.Welcome)
    for s in [*idle, late]:
        s.close()


def test_max_subscribers_counts_until_the_producer_drops_one(probe: Probe, tmp_path: Path) -> None:
    address = _listen(probe, tmp_path / "p.sock", max_subs=1)
    one = _client(address)
    one.send(_hello())
    assert isinstance(_answer(one)[0], proto.Welcome)
    two = _client(address)
    two.send(_hello())
    assert _refused(two) == "the publisher already has max_subscribers=1"
    assert probe("take").startswith("ok 1 1:0:")
    assert probe("drop 1") == "ok"
    three = _client(address)
    three.send(_hello())
    assert isinstance(_answer(three)[0], proto.Welcome)
    for s in (one, two, three):
        s.close()


def test_stop_ends_the_handshakes_and_leaves_the_welcomed_to_take(
    probe: Probe, tmp_path: Path
) -> None:
    """After stop nobody is welcomed: a handshake in progress ends without a WELCOME (EOF:
    a subscriber that waits for a publisher tries again), a connect is refused, and those
    welcomed and not yet taken are left for the producer's last take."""
    address = _listen(probe, tmp_path / "p.sock")
    welcomed = _client(address)
    welcomed.send(_hello())
    assert isinstance(_answer(welcomed)[0], proto.Welcome)
    midway = _client(address)
    _until_answer(probe, "hs -1", "ok 1")
    assert probe("stop") == "ok"
    assert midway.recv(64) == b""
    with pytest.raises(ConnectionRefusedError):
        _client(address)
    assert probe("take").startswith("ok 1 1:0:")
    for s in (welcomed, midway):
        s.close()


def test_out_of_fds_the_thread_backs_off_and_accepts_once_fds_are_free(
    probe: Probe, tmp_path: Path
) -> None:
    """EMFILE: the queued connection stays queued, the thread does not spin on the readable
    listener (it leaves it alone 50 ms at a time), and it is welcomed once fds are free."""
    address = _listen(probe, tmp_path / "p.sock")
    held = int(probe("starve").split()[1])
    assert held > 0
    s = _client(address)  # queued by the kernel; accept(2) fails with EMFILE
    s.send(_hello())
    t0 = int(probe("cpu").split()[1])
    time.sleep(0.5)
    used = int(probe("cpu").split()[1]) - t0
    assert used < 0.1e9, f"the accept thread spun while out of fds: {used / 1e9:.3f} s of CPU"
    assert probe("hs -1") == "ok 0"  # not accepted yet
    assert probe("feed") == "ok"
    reply, fds = _answer(s)
    assert isinstance(reply, proto.Welcome) and len(fds) == 1
    s.close()


def test_a_child_forked_while_the_thread_runs_stops_without_it(
    probe: Probe, tmp_path: Path
) -> None:
    """A process forked while the accept thread runs (``os.fork``, multiprocessing's fork)
    has no such thread: its stop joins nothing and takes no lock the thread may have held
    at the fork, its take finds nothing of the parent's, and the parent serves on."""
    address = _listen(probe, tmp_path / "p.sock")
    welcomed = _client(address)
    welcomed.send(_hello())
    assert isinstance(_answer(welcomed)[0], proto.Welcome)  # pending in the parent
    assert probe("forkstop", timeout=BOUND) == "ok 0"
    late = _client(address)
    late.send(_hello())
    assert isinstance(_answer(late)[0], proto.Welcome)
    assert probe("take").startswith("ok 2 1:0:")
    for s in (welcomed, late):
        s.close()


def test_many_clients_at_once_each_answered_nothing_lost(probe: Probe, tmp_path: Path) -> None:
    """Clients of several threads connect, say HELLO, some hang up at once, while the
    producer takes and drops: every client is answered (WELCOME or REFUSE), every id is
    taken or reported gone, and every row comes back (the ThreadSanitizer lane's run)."""
    address = _listen(probe, tmp_path / "p.sock", rows=16, per_uid=64)
    answers: list[str] = []
    lock = threading.Lock()

    def clients(k: int) -> None:
        for i in range(25):
            s = _client(address)
            s.send(_hello(payload=b"%d.%d" % (k, i)))
            if i % 3 == 0:
                s.close()  # gone before (or as) it is welcomed
                continue
            reply, _ = _answer(s)
            with lock:
                answers.append(type(reply).__name__)
            s.close()

    threads = [threading.Thread(target=clients, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    taken: set[int] = set()
    gone: set[int] = set()

    def take() -> None:
        new_part, gone_part = probe("take")[3:].split(" / ")
        for item in new_part.split()[1:]:
            sub_id = int(item.split(":")[0])
            taken.add(sub_id)
            assert probe(f"drop {sub_id}") == "ok"
        gone.update(int(item.split(":")[0]) for item in gone_part.split()[1:])

    while any(t.is_alive() for t in threads):
        take()
        time.sleep(0.002)
    for t in threads:
        t.join()
    deadline = time.monotonic() + BOUND
    while True:
        take()
        live, welcomed = probe("state").split()[1:3]
        if live == "0" and len(taken) + len(gone) == int(welcomed):
            break
        assert time.monotonic() < deadline, (live, welcomed, len(taken), len(gone))
        time.sleep(0.01)
    assert not taken & gone
    assert len(answers) == 6 * 16
    assert set(answers) <= {"Welcome", "Refuse"}
