"""Errors of the remote layer; all derive from :class:`cupy_ipcpool.IpcPoolError`."""

from __future__ import annotations

import errno as _errno
from typing import Any

from .._errors import IpcPoolError, PeerRefusedError


class AuthenticationError(PeerRefusedError):
    """The shared secret did not match (or one side has none and the other requires one).

    Raised on the subscriber when the server refuses its proof or cannot prove
    that it knows the secret itself; the server refuses such peers with a
    REFUSE message and closes the connection.
    """

    def __init__(self, message: str, err: int = _errno.EACCES) -> None:
        super().__init__(message, err)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.strerror, self.errno))


class RemoteUnavailableError(IpcPoolError, ImportError):
    """UCXX is not installed (or failed to load); the message says how to install it."""


__all__ = ["AuthenticationError", "RemoteUnavailableError"]
