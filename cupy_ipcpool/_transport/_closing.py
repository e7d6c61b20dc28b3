"""What the library's closable objects share: ``with`` closes them, ``closed`` says so.

Every pool, channel end, server and relay is a context manager whose
``__exit__`` is its ``close()``, however the block is left.  Those that keep
their state in a ``_closed`` flag also answer :attr:`ClosedFlag.closed` from
it; the pools (:class:`~cupy_ipcpool.IpcPool`, :class:`~cupy_ipcpool.PeerPool`,
:class:`~cupy_ipcpool.SeedBuffers`) in addition refuse a ``with`` once unusable
and run their ``weakref.finalize`` teardown once, warning rather than raising.

Objects whose sockets must not outlive their process are registered with
:func:`close_in_forked_children`: a child forked while one is open (``os.fork``,
multiprocessing's ``fork`` workers, a DataLoader's) closes it at once, which closes only
the child's copies of its fds (each such ``close()`` says nothing in a child).  A copy a
long-lived child kept would hide its parent's death: a subscriber's socket would not hang
up (the publisher would keep its leases), a publisher's listening socket would still take
connections (nobody would answer them, and a publisher restarted at the path would find
it live and be refused).

It lives in the transport layer, the lowest that has a closable object
(:class:`~._fdserver.FdServer`), so that every layer above may use it.  None
of this is on a per-frame path: frames release themselves on their own.
"""

from __future__ import annotations

import os
import warnings
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from cupy_ipcpool._errors import TeardownWarning

__all__ = ["ClosedFlag", "ClosesOnExit", "FinalizedResource", "close_in_forked_children"]

_T = TypeVar("_T")
_F = TypeVar("_F", bound="FinalizedResource")


class ClosesOnExit:
    """Mixin: ``with obj:`` gives ``obj`` and calls ``obj.close()`` on leaving the block."""

    __slots__ = ()

    if TYPE_CHECKING:

        def close(self) -> object: ...

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ClosedFlag(ClosesOnExit):
    """Mixin: a :class:`ClosesOnExit` whose ``close()`` sets ``self._closed``."""

    __slots__ = ()

    _closed: bool

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed


class FinalizedResource(ClosedFlag):
    """Mixin of the pools: ``with`` checks the object first; teardown is a finalizer.

    The subclass defines ``_check()`` (raises when the object may not be used
    here: closed, or in a forked child) and sets ``self._finalizer``, the
    ``weakref.finalize`` that releases what it holds.
    """

    __slots__ = ()

    _finalizer: weakref.finalize

    if TYPE_CHECKING:

        def _check(self) -> None: ...

    def __enter__(self: _F) -> _F:
        self._check()
        return self

    def _finalize(self, what: str) -> None:
        """Run the finalizer (a no-op after its first run); a failure warns, naming ``what``.

        Called by ``close()`` once it has set ``_closed``; never raises.
        """
        try:
            self._finalizer()
        except Exception as exc:  # pragma: no cover - teardown never raises
            warnings.warn(f"closing {what} failed: {exc}", TeardownWarning, stacklevel=3)


#: The open objects a forked child closes at once (see the module's docstring).
_CLOSED_IN_CHILDREN: weakref.WeakSet[ClosesOnExit] = weakref.WeakSet()


def _close_inherited() -> None:
    """In a child just forked: close every registered object it inherited (our copies)."""
    for obj in list(_CLOSED_IN_CHILDREN):
        try:
            obj.close()
        except Exception as exc:  # pragma: no cover - such a close never raises
            warnings.warn(
                f"closing the copy of {obj!r} a forked child inherited failed: {exc!r}",
                TeardownWarning,
                stacklevel=1,
            )
    _CLOSED_IN_CHILDREN.clear()


os.register_at_fork(after_in_child=_close_inherited)


def close_in_forked_children(obj: ClosesOnExit) -> None:
    """Close ``obj`` in every child forked while it lives: its ``close()`` there must touch
    nothing of the parent's (send nothing, unlink nothing) and close only the child's
    copies of its fds.  Held weakly: a collected or closed object costs nothing."""
    _CLOSED_IN_CHILDREN.add(obj)
