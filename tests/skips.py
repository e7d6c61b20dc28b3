"""Skip markers shared by the CPU-tier tests."""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess

import pytest

import cupy_ipcpool
from cupy_ipcpool import CudaUnavailableError, _driver
from cupy_ipcpool.remote import _ucx as ucx

#: Python's file suffixes of what a child imports (sources, bytecode, extensions).
_IMPORTED = (".py", ".pyc", ".so")


def has_driver() -> bool:
    """True when a CUDA driver can be initialised here."""
    try:
        _driver.driver_module()
    except CudaUnavailableError:
        return False
    return True


#: For tests of the no-driver behaviour: they cannot run where a driver exists.
no_driver = pytest.mark.skipif(has_driver(), reason="a CUDA driver is present on this machine")

#: For tests that need UCXX working (the remote extra installed, its UCX libraries loaded).
needs_ucx = pytest.mark.skipif(
    ucx.available() is not None, reason=f"the remote extra is not installed: {ucx.available()}"
)


@functools.cache
def unreadable_for(uid: int) -> str | None:
    """The first file of the library that ``uid`` cannot read, or None when it reads all.

    A test child that drops to another uid still imports parts of the library
    lazily (the compiled socket calls, at the first session), so a checkout in a
    directory that uid cannot search (a 0700 home, ``mktemp -d``) makes it fail
    with ``ImportError`` instead of the error the test is about.  Asked of the
    kernel as that uid (``test -r`` checks the search bit of every parent too).
    Only root can ask; for anyone else this returns None.
    """
    if os.geteuid() != 0:
        return None
    package = pathlib.Path(cupy_ipcpool.__file__).resolve().parent
    files = sorted(str(p) for p in package.rglob("*") if p.suffix in _IMPORTED)
    script = 'for p do test -r "$p" || { printf %s "$p"; exit 1; }; done'
    try:
        out = subprocess.run(
            ["/bin/sh", "-c", script, "sh", *files],
            user=uid,
            group=uid,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{package} ({type(exc).__name__}: {exc})"
    return None if out.returncode == 0 else out.stdout or str(package)


def drops_to_uid(uid: int) -> pytest.MarkDecorator:
    """Skip a test whose child drops to ``uid`` where it cannot: not root, or a private checkout.

    Parameters
    ----------
    uid
        The uid the test's child process switches to (``os.setuid``).
    """
    if os.geteuid() != 0:
        return pytest.mark.skipif(True, reason=f"dropping to uid {uid} needs root")
    path = unreadable_for(uid)
    return pytest.mark.skipif(
        path is not None,
        reason=(
            f"uid {uid} cannot read the library here ({path}): a parent directory of the "
            f"checkout is private (0700); put the checkout where other users can read it "
            "(chmod o+x its parents, or clone it under /srv or /tmp) to run this test"
        ),
    )
