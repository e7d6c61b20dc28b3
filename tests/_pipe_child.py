"""Test processes that talk to the test over a pipe (standard library only).

A child's target takes its end of the pipe first: ``target(conn, *args)``.
The test keeps the other end in :class:`PipeChild`; each test module's own
``Child`` (a subclass) says how it reads the child's messages.  This module
imports nothing but the standard library, so that a short-lived child that
imports it (``_restart_children.py``) still starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any, TypeVar

#: Children fork from a server process that imported these once (``forkserver``): a
#: child starts in milliseconds instead of a fresh interpreter's import of the package.
#: Nothing in the server touches CUDA, so a child is as clean as a spawned one.
CHILDREN = mp.get_context("forkserver")
CHILDREN.set_forkserver_preload(
    [
        "cupy_ipcpool",
        "cupy_ipcpool.channel",
        "numpy",
        "pytest",
        # the command line and what its parser imports (tests/_cli_child.py)
        "cupy_ipcpool.__main__",
        "cupy_ipcpool._bench",
        "cupy_ipcpool._demo",
        "cupy_ipcpool.remote._cli",
    ]
)

C = TypeVar("C", bound="PipeChild")


def run_body(conn: Connection, body: Callable[[], Any], *, with_traceback: bool = False) -> None:
    """Run ``body`` in a child; send back ("ok", result) or ("err", type name, message).

    ``with_traceback``: the message ends with the child's traceback.  The pipe is
    closed after either answer.
    """
    try:
        result = body()
    except BaseException as exc:
        message = f"{exc}\n{traceback.format_exc()}" if with_traceback else str(exc)
        conn.send(("err", type(exc).__name__, message))
    else:
        conn.send(("ok", result))
    finally:
        conn.close()


class PipeChild:
    """A daemon process running ``target(conn, *args)``, and the test's end of the pipe."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        self.conn, child_end = CHILDREN.Pipe()
        self.proc = CHILDREN.Process(target=target, args=(child_end, *args), daemon=True)
        self.proc.start()
        child_end.close()

    def recv(self, timeout: float, nothing: str) -> Any:
        """The child's next message; fails with ``nothing`` if none comes within ``timeout``."""
        assert self.conn.poll(timeout), nothing
        return self.conn.recv()

    def finish(self) -> None:
        """Wait up to 10 s for the child to exit, kill it if it has not, close the pipe."""
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


@contextlib.contextmanager
def started(kind: type[C]) -> Iterator[Callable[..., C]]:
    """``start(target, *args)`` makes a ``kind`` child; each one is finished at the end."""
    made: list[C] = []

    def start(target: Callable[..., None], *args: Any) -> C:
        made.append(kind(target, *args))
        return made[-1]

    try:
        yield start
    finally:
        for child in made:
            child.finish()
