"""CPU tier: every ``raise`` in the package stays inside the error model, and the
transport's timeouts raise the model's class for real.

The model (``cupy_ipcpool._errors``, ``cupy_ipcpool.remote._errors``,
docs/reference.md): every error the library raises derives from
:class:`IpcPoolError`; a library class also subclasses the builtin a caller
may catch (``UsageError`` is a ``ValueError``, ``ChannelTimeoutError`` and
``TransportTimeoutError`` are ``TimeoutError``\\ s, ``TransportError`` an
``OSError``...).  The scan below checks every ``raise`` statement of
``cupy_ipcpool/`` (``_bench/``, the benchmark harness, is internal tooling
whose errors stay in its own processes, and is left out) raises one of:

* a class of the model, or what a function annotated to return one returns;
* a variable every binding of which is of the model (an ``except <model> as``
  name, an assignment from the model, a parameter annotated with it);
* a builtin of :data:`ALLOWED_BUILTINS`, where its justification holds;
* a builtin raised inside a ``try`` of the same function that catches it: a
  local control-flow signal that never leaves the function.

Exceptions that only pass through from the standard library (an ``OSError``
of a system call) are not ``raise`` statements and are not covered here; the
failure-path tests (``tests/test_errors_cpu.py``) cover the reachable ones.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import errno
import os
import pathlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

import cupy_ipcpool as cip
from cupy_ipcpool import _errors
from cupy_ipcpool._errors import (
    TransportError,
    TransportTimeoutError,
    UsageError,
    UsageTypeError,
)
from cupy_ipcpool._slots import SlotTable, first_free_slot
from cupy_ipcpool._transport import _admission, _fetch
from cupy_ipcpool.channel._leases import LeaseBook, granted_credit
from cupy_ipcpool.remote import _errors as remote_errors

PACKAGE = pathlib.Path(cip.__file__).parent


def _model() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for module in (_errors, remote_errors):
        for name, obj in vars(module).items():
            if isinstance(obj, type) and issubclass(obj, _errors.IpcPoolError):
                found[name] = obj
    return found


MODEL = _model()

#: Builtins a ``raise`` may name, each where (modules, as paths under the
#: package; None: anywhere) and why.
ALLOWED_BUILTINS: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "AssertionError": (
        None,
        "an invariant the code proves cannot fail (no user input reaches it): a bug "
        "report, not an error of the model",
    ),
    "argparse.ArgumentError": (
        ("__main__.py", "_demo.py", "remote/_cli.py"),
        "argparse's protocol in the command-line modules: argparse turns it into a "
        "usage message and exit status 2; it never leaves a library call",
    ),
    "argparse.ArgumentTypeError": (
        ("__main__.py", "_demo.py", "remote/_cli.py"),
        "argparse's protocol for a type= converter (as above)",
    ),
}

#: ``raise`` statements outside the model in files this change could not edit
#: (others edit them now): ``(path, statement's source)``.  Fix them there and
#: remove them here; they are allowed, not required.
NOT_YET: set[tuple[str, str]] = set()


def _sources() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("_bench/"):
            continue
        yield rel, ast.parse(path.read_text(encoding="utf-8"))


def _parents(tree: ast.AST) -> dict[int, ast.AST]:
    out: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            out[id(child)] = node
    return out


def _names(annotation: ast.expr | None) -> list[str]:
    """The leaf names of an annotation (``A | B`` gives both; strings are parsed)."""
    if annotation is None:
        return []
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return _names(ast.parse(annotation.value, mode="eval").body)
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _names(annotation.left) + _names(annotation.right)
    return [ast.unparse(annotation).rpartition(".")[2]]


def _returns_model() -> set[str]:
    """Functions of the package whose return annotation is a class of the model."""
    found = set()
    for _rel, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = _names(node.returns)
                if names and all(n in MODEL for n in names):
                    found.add(node.name)
    return found


def _is_model_value(
    value: ast.expr, func: ast.AST, factories: set[str], seen: frozenset[str]
) -> bool:
    if isinstance(value, ast.Name) and value.id not in MODEL:
        return _variable_is_model(value.id, func, factories, seen)
    target = value.func if isinstance(value, ast.Call) else value
    leaf = ast.unparse(target).rpartition(".")[2]
    return leaf in MODEL or (isinstance(value, ast.Call) and leaf in factories)


def _variable_is_model(
    name: str, func: ast.AST | None, factories: set[str], seen: frozenset[str] = frozenset()
) -> bool:
    if func is None or name in seen:
        return False
    seen = seen | {name}
    bindings: list[bool] = []
    if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for arg in [*func.args.args, *func.args.kwonlyargs, *func.args.posonlyargs]:
            if arg.arg == name:
                kinds = [n for n in _names(arg.annotation) if n != "str"]
                bindings.append(bool(kinds) and all(n in MODEL for n in kinds))
    for node in ast.walk(func):
        if isinstance(node, ast.ExceptHandler) and node.name == name and node.type is not None:
            kinds = [ast.unparse(t).rpartition(".")[2] for t in _tuple(node.type)]
            bindings.append(all(k in MODEL for k in kinds))
        elif isinstance(node, ast.Assign):
            for tgt in node.targets:
                if isinstance(tgt, ast.Name) and tgt.id == name:
                    bindings.append(_is_model_value(node.value, func, factories, seen))
    return bool(bindings) and all(bindings)


def _tuple(node: ast.expr) -> list[ast.expr]:
    return list(node.elts) if isinstance(node, ast.Tuple) else [node]


def _caught_locally(
    raised: type[BaseException], node: ast.AST, parents: dict[int, ast.AST]
) -> bool:
    """True when ``node`` lies in the body of a ``try`` of its own function catching ``raised``."""
    child, parent = node, parents.get(id(node))
    while parent is not None and not isinstance(
        parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    ):
        if isinstance(parent, ast.Try) and any(child is stmt for stmt in parent.body):
            for handler in parent.handlers:
                for t in _tuple(handler.type) if handler.type is not None else []:
                    caught = getattr(builtins, ast.unparse(t), None)
                    if isinstance(caught, type) and issubclass(raised, caught):
                        return True
        child, parent = parent, parents.get(id(parent))
    return False


def _function_of(node: ast.AST, parents: dict[int, ast.AST]) -> ast.AST | None:
    parent = parents.get(id(node))
    while parent is not None and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
        parent = parents.get(id(parent))
    return parent


def _outside_the_model() -> list[tuple[str, int, str, str]]:
    factories = _returns_model()
    out = []
    for rel, tree in _sources():
        parents = _parents(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            exc = node.exc
            target = exc.func if isinstance(exc, ast.Call) else exc
            dotted = ast.unparse(target)
            leaf = dotted.rpartition(".")[2]
            if leaf in MODEL or (isinstance(exc, ast.Call) and leaf in factories):
                continue
            if isinstance(exc, ast.Name) and _variable_is_model(
                exc.id, _function_of(node, parents), factories
            ):
                continue
            allowed = ALLOWED_BUILTINS.get(dotted)
            if allowed is not None and (allowed[0] is None or rel in allowed[0]):
                continue
            raised = getattr(builtins, dotted, None)
            if (
                isinstance(raised, type)
                and issubclass(raised, BaseException)
                and _caught_locally(raised, node, parents)
            ):
                continue
            out.append((rel, node.lineno, ast.unparse(node), dotted))
    return out


def test_every_raise_in_the_package_is_of_the_error_model() -> None:
    found = [f for f in _outside_the_model() if (f[0], f[2]) not in NOT_YET]
    assert not found, "raise statements outside the error model:\n" + "\n".join(
        f"  cupy_ipcpool/{rel}:{line}: {text}" for rel, line, text, _name in found
    )


def test_the_allowed_builtins_are_what_they_say() -> None:
    for dotted in ALLOWED_BUILTINS:
        module, _, name = dotted.rpartition(".")
        obj = getattr(argparse if module == "argparse" else builtins, name)
        assert isinstance(obj, type) and issubclass(obj, Exception), dotted
        assert not issubclass(obj, _errors.IpcPoolError)


def test_the_scan_sees_what_it_must_refuse() -> None:
    """The scan's own rules, on snippets: it would catch a regression."""
    tree = ast.parse(
        "def f(x):\n"
        "    raise RuntimeError('plain')\n"
        "def g():\n"
        "    try:\n"
        "        raise ConnectionResetError\n"
        "    except OSError:\n"
        "        pass\n"
        "def h():\n"
        "    try:\n"
        "        raise EOFError\n"
        "    except ValueError:\n"
        "        pass\n"
    )
    parents = _parents(tree)
    raises = [n for n in ast.walk(tree) if isinstance(n, ast.Raise)]
    local = [
        _caught_locally(getattr(builtins, ast.unparse(r.exc).split("(")[0]), r, parents)
        for r in raises
        if r.exc is not None
    ]
    assert local == [False, True, False]
    assert "RuntimeError" not in MODEL and "UsageError" in MODEL
    assert "AuthenticationError" in MODEL  # the remote layer's classes count too


# ------------------------------------------------------------ the model's classes


def test_transport_timeouts_are_transport_errors_and_timeouts() -> None:
    assert issubclass(TransportTimeoutError, TransportError)
    assert issubclass(TransportTimeoutError, TimeoutError)
    assert issubclass(_errors.CompiledPartError, ImportError)
    exc = TransportTimeoutError(errno.ETIMEDOUT, "late")
    assert exc.errno == errno.ETIMEDOUT and str(exc) == "[ETIMEDOUT] late"


def test_every_etimedout_of_the_fd_fetch_is_a_transport_timeout(tmp_path: pathlib.Path) -> None:
    """Status 5 (the fd server gave up on this connection after its deadline) and a server
    that never answers are both a TransportTimeoutError (ETIMEDOUT), also a TimeoutError."""
    from cupy_ipcpool._transport import STATUS_TOO_SLOW

    path = str(tmp_path / "slow.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(2)

        def serve(answer: bytes) -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(64)  # the request
                if answer:
                    conn.sendall(answer)
                else:
                    conn.recv(1)  # until the client gives up

        for answer, timeout, match in (
            (bytes([STATUS_TOO_SLOW]), 10.0, "gave up on this connection after 5 s"),
            (b"", 0.2, "did not answer within 0.2 s"),
        ):
            server = threading.Thread(target=serve, args=(answer,))
            server.start()
            try:
                with pytest.raises(TransportTimeoutError, match=match) as caught:
                    _fetch.fetch_fds_over_socket(path, b"t", 1, timeout=timeout)
            finally:
                server.join(10)
            assert caught.value.errno == errno.ETIMEDOUT
            assert isinstance(caught.value, TimeoutError)


def test_argument_errors_of_the_transport_are_usage_errors() -> None:
    with pytest.raises(UsageError):
        _admission.Admission(0, 1.0)
    with pytest.raises(UsageError):
        _admission.Admission(1, 0.0)
    book = _admission.Admission(1, 1.0)
    book.admit(3, 0, 0.0)
    with pytest.raises(UsageError, match="already admitted"):
        book.admit(3, 0, 0.0)
    with pytest.raises(UsageError):
        _fetch.fetch_fds_over_socket("/nonexistent", b"t", -1)
    # a path no socket fits: the engine's message, whole (it once came out empty)
    with pytest.raises(UsageError, match=r"is 160 bytes long; a Unix socket path holds"):
        _fetch.fetch_fds_over_socket("/x" * 80, b"t", 1)
    with pytest.raises(UsageError, match="the socket path is empty"):
        _fetch.fetch_fds_over_socket("", b"t", 1)
    with pytest.raises(UsageError):
        _fetch.fetch_fds(
            pid=os.getpid(),
            start_time=None,
            fds=[0],
            socket_path=None,
            token=b"t",
            method="carrier pigeon",
        )


def test_argument_errors_of_the_fd_server_are_usage_errors(tmp_path: pathlib.Path) -> None:
    from cupy_ipcpool._transport import FdServer

    path = str(tmp_path / "bad.sock")
    with pytest.raises(UsageTypeError):
        FdServer([0], token="not bytes", path=path)  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        FdServer([0], token=b"t" * 65, path=path)
    with pytest.raises(UsageError):
        FdServer([-1], token=b"t", path=path)


@pytest.mark.timeout(30)
def test_a_client_that_hangs_up_mid_request_is_forgotten(tmp_path: pathlib.Path) -> None:
    from cupy_ipcpool._transport import FdServer

    r, w = os.pipe()
    try:
        with FdServer([r], token=b"t" * 16, path=str(tmp_path / "fds.sock")) as server:
            for _ in range(3):  # half a request, then gone
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                    c.connect(server.path)
                    c.sendall(b"FDS1\x10tt")
            got = _fetch.fetch_fds_over_socket(server.path, b"t" * 16, 1, timeout=5.0)
            try:
                assert len(got) == 1
            finally:
                for fd in got:
                    os.close(fd)
            deadline = time.monotonic() + 5.0
            while server.connections and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.connections == 0  # (the fd server's own count: c/src/fdserver.c)
    finally:
        os.close(r)
        os.close(w)


def test_host_publish_of_a_slot_not_acquired_is_a_usage_error(tmp_path: pathlib.Path) -> None:
    from cupy_ipcpool.remote._host import HostChannelPublisher

    with HostChannelPublisher(str(tmp_path / "h.sock"), 2, 4096) as pub:
        with pytest.raises(UsageError, match="not acquired"):
            pub.publish(0, ())
        slot = pub.acquire(timeout=0)
        pub.abandon(slot)
        with pytest.raises(UsageError, match="not acquired"):
            pub.publish(slot, ())


# --------------------------------------------------------- transport timeouts, real


@contextlib.contextmanager
def _full_backlog(path: str) -> Iterator[None]:
    """A stream listener at ``path`` that never accepts, its backlog filled."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fillers: list[socket.socket] = []
    try:
        listener.bind(path)
        listener.listen(0)
        for _ in range(64):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
            except BlockingIOError:
                s.close()
                break
            fillers.append(s)
        else:
            pytest.fail("the listen backlog never filled")
        yield
    finally:
        for s in fillers:
            s.close()
        listener.close()


@pytest.mark.timeout(30)
def test_a_full_listen_backlog_times_out_as_the_model_says(tmp_path: pathlib.Path) -> None:
    """The fd fetch's connect retries a full backlog until its timeout, then says so: a
    TransportTimeoutError (ETIMEDOUT, also a TimeoutError) naming the fd server."""
    path = str(tmp_path / "full.sock")
    with _full_backlog(path):
        t0 = time.monotonic()
        with pytest.raises(TransportTimeoutError) as info:
            _fetch.fetch_fds_over_socket(path, b"t" * 16, 1, timeout=0.3)
        took = time.monotonic() - t0
        assert isinstance(info.value, TimeoutError) and isinstance(info.value, cip.IpcPoolError)
        assert info.value.errno == errno.ETIMEDOUT
        assert f"connecting to fd server {path} timed out" in str(info.value)
        assert 0.25 < took < 3.0, took


@contextlib.contextmanager
def _mute_server(path: str, *, close_at_once: bool) -> Iterator[threading.Event]:
    """A stream server at ``path`` that accepts and never answers (or closes at once)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    done = threading.Event()
    accepted: list[socket.socket] = []

    def serve() -> None:
        listener.settimeout(10.0)
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            accepted.append(conn)
            if close_at_once:
                conn.recv(64)  # the request arrives; then the server goes away mid-reply
                conn.close()
        done.wait(10.0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield done
    finally:
        done.set()
        thread.join(10.0)
        for conn in accepted:
            conn.close()
        listener.close()


@pytest.mark.timeout(30)
def test_an_fd_fetch_that_gets_no_answer_times_out_as_the_model_says(
    tmp_path: pathlib.Path,
) -> None:
    path = str(tmp_path / "mute.sock")
    with _mute_server(path, close_at_once=False):
        t0 = time.monotonic()
        with pytest.raises(TransportTimeoutError) as info:
            _fetch.fetch_fds_over_socket(path, b"t" * 16, 2, timeout=0.3)
        took = time.monotonic() - t0
    exc = info.value
    assert isinstance(exc, TimeoutError) and isinstance(exc, TransportError)
    assert exc.errno == errno.ETIMEDOUT
    assert f"fd server {path} did not answer within 0.3 s" in str(exc)
    assert 0.25 < took < 3.0, took


@pytest.mark.timeout(30)
def test_an_fd_server_that_closes_mid_reply_is_a_transport_error(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "gone.sock")
    with _mute_server(path, close_at_once=True), pytest.raises(TransportError) as info:
        _fetch.fetch_fds_over_socket(path, b"t" * 16, 2, timeout=5.0)
    exc = info.value
    assert not isinstance(exc, TimeoutError)
    assert exc.errno == errno.ECONNRESET and "closed the connection mid-reply" in str(exc)


# ----------------------------------------------------------------- one credit rule


def test_the_handshake_grants_the_one_credit_rule() -> None:
    # the handshake's former inline rule, for every credit a HELLO can carry and more
    for max_credit in (1, 2, 3, 8, 64):
        for asked in range(-3, 2 * max_credit + 3):
            assert granted_credit(asked, max_credit) == max(1, min(asked, max_credit))
    # the engine's accept thread grants it with the lease book's own rule (c/src/leases.c)
    source = (PACKAGE.parent / "c" / "src" / "acceptor.c").read_text(encoding="utf-8")
    assert "cipi_granted_credit(hello.credit, a->max_credit)" in source


def test_one_pending_limit_for_both_servers() -> None:
    from cupy_ipcpool._transport import MAX_PENDING_PER_UID, _admission, _fdserver
    from cupy_ipcpool.channel import _handshake

    assert _fdserver.MAX_PENDING_PER_UID is _handshake.MAX_PENDING_PER_UID
    assert MAX_PENDING_PER_UID == _admission.MAX_PENDING_PER_UID == 8


def test_one_credit_rule() -> None:
    assert [granted_credit(c, 3) for c in (1, 2, 3, 4, 100)] == [1, 2, 3, 3, 3]
    assert granted_credit(0, 3) == 1  # a HELLO's credit is at least 1 on the wire anyway
    book = LeaseBook(8, max_credit=3)
    for sub_id, asked in enumerate((1, 3, 5)):
        assert book.add_subscriber(sub_id, "latest", asked) == granted_credit(asked, 3)
        assert book.credit(sub_id) == granted_credit(asked, 3)
    assert not hasattr(LeaseBook, "granted_credit")


# ----------------------------------------------------------------- one slot pick


def _reference_pick(start: int, busy: list[bool]) -> int | None:
    n = len(busy)
    for i in range(n):
        if not busy[(start + i) % n]:
            return (start + i) % n
    return None


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_one_slot_pick_rule_for_the_pool_and_the_host_channel(n: int) -> None:
    for mask in range(1 << n):
        busy = [bool(mask >> s & 1) for s in range(n)]
        for start in range(2 * n):
            want = _reference_pick(start, busy)
            assert first_free_slot(start, n, busy.__getitem__) == want
            # the host channel's book: busy = a lease or a local hold
            book = LeaseBook(n)
            for s in range(n):
                if busy[s]:
                    book.hold(s)
            assert book.pick_free_slot(start) == want
            # the pool's table: busy = a local reference; it starts after its cursor
            table = SlotTable(n)
            table.counts[:] = [int(b) for b in busy]
            table.current = start % n
            assert table._pick(None) == _reference_pick(start + 1, busy)
            for s in range(n):
                assert table._pick(s) == (None if busy[s] else s)
