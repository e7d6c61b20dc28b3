"""This process's open fds: the one look the tests take at them (standard library only).

A test that checks "nothing stays open" compares the fds open after with those
open before as sets of ``fd -> file``, not as counts: an fd that an earlier
test left to the garbage collector (or one of its threads) may close while a
test looks, which changes the count with nothing of the test's left open, and
its number may be reused for a new file.
"""

from __future__ import annotations

import contextlib
import gc
import os


def open_fds() -> dict[int, str]:
    """This process's open fds, ``fd -> readlink target``."""
    table = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd, closed by now
            table[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return table


def fds_opened_since(before: dict[int, str]) -> dict[int, str]:
    """The fds open now that were not open (as the same file) in ``before``.

    Garbage is collected first, so that what only a reference cycle still
    holds is not counted as left open.
    """
    gc.collect()
    return {fd: t for fd, t in open_fds().items() if before.get(fd) != t}


def fd_count() -> int:
    """How many fds this process has open (for checks that a count stays flat)."""
    return len(os.listdir("/proc/self/fd"))
