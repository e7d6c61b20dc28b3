"""``subscribe()``: one entry point for local publishers and remote (``ucx://``) servers."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ._errors import UsageError
from .channel import Subscriber
from .channel import subscribe as subscribe_local

if TYPE_CHECKING:  # pragma: no cover
    from .remote import RemoteSubscriber


def subscribe(
    address: str | os.PathLike[str],
    *,
    mode: str = "block",
    credit: int | None = None,
    device: int | None = None,
    timeout: float = 10.0,
    allowed_uids: Iterable[int] | None = None,
    token: str | bytes | None = None,
    insecure: bool = False,
    spin_us: float = 0.0,
) -> Subscriber | RemoteSubscriber:
    """Connect to a publisher and receive its frames.

    ``address`` is a local publisher's socket path (zero-copy: the slots are
    mapped, see :func:`cupy_ipcpool.channel.subscribe`), or
    ``ucx://host:port`` of a :class:`cupy_ipcpool.remote.RemoteServer` on
    another machine (frames are received over UCX into a local receive ring;
    needs the ``remote`` extra, see ``docs/remote.md``).  Both kinds iterate,
    ``recv()``, lease and end the same way.

    Parameters
    ----------
    address:
        A socket path, or ``ucx://host:port``.
    mode:
        ``"block"`` (every frame; the producer may wait) or ``"latest"``
        (frames are skipped for this subscriber while it holds its credit).
    credit:
        Most frames held at once.  Remote: the number of receive slots
        (default 4).
    device:
        Local GPU (default: the producer's GPU for a local publisher, 0 for a
        remote one).
    timeout:
        Seconds for connecting and the handshake.
    allowed_uids:
        Local publishers only: the uids the publisher may run as.
    token, insecure:
        Remote servers only: the shared secret (default
        ``$CUPY_IPCPOOL_TOKEN``), or ``insecure=True`` for a server without one.
    spin_us:
        Local publishers only: microseconds ``recv`` busy-polls before it
        sleeps (default 0).

    Raises
    ------
    UsageError
        An option that does not apply to this kind of address.
    """
    text = os.fspath(address)
    if isinstance(text, str) and text.startswith("ucx://"):
        if allowed_uids is not None:
            raise UsageError("allowed_uids applies to local publishers; remote ones use a token")
        if spin_us:
            raise UsageError("spin_us applies to local publishers")
        from .remote import subscribe as subscribe_remote

        kwargs: dict[str, Any] = {} if credit is None else {"slots": credit}
        return subscribe_remote(
            text,
            token=token,
            insecure=insecure,
            mode=mode,
            device=0 if device is None else device,
            timeout=timeout,
            **kwargs,
        )
    if token is not None or insecure:
        raise UsageError(
            "token and insecure apply to ucx:// addresses; a local publisher checks the uid"
        )
    return subscribe_local(
        address,
        mode=mode,
        credit=credit,
        device=device,
        timeout=timeout,
        allowed_uids=allowed_uids,
        spin_us=spin_us,
    )
