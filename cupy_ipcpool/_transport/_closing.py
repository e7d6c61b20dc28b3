"""What the library's closable objects share: ``with`` closes them, ``closed`` says so.

Every pool, channel end, server and relay is a context manager whose
``__exit__`` is its ``close()``, however the block is left.  Those that keep
their state in a ``_closed`` flag also answer :attr:`ClosedFlag.closed` from
it; the pools (:class:`~cupy_ipcpool.IpcPool`, :class:`~cupy_ipcpool.PeerPool`,
:class:`~cupy_ipcpool.SeedBuffers`) in addition refuse a ``with`` once unusable
and run their ``weakref.finalize`` teardown once, warning rather than raising.

It lives in the transport layer, the lowest that has a closable object
(:class:`~._fdserver.FdServer`), so that every layer above may use it.  None
of this is on a per-frame path: frames release themselves on their own.
"""

from __future__ import annotations

import warnings
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from cupy_ipcpool._errors import TeardownWarning

__all__ = ["ClosedFlag", "ClosesOnExit", "FinalizedResource"]

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
