"""``subscribe()``: one entry point for local publishers and remote (``ucx://``) servers."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ._args import DeviceLike, optional_device
from ._errors import UsageError, UsageTypeError
from .channel import Follower, Subscriber
from .channel import follow as follow_local
from .channel import subscribe as subscribe_local

if TYPE_CHECKING:  # pragma: no cover
    from .remote import RemoteSubscriber


def _address_text(address: object) -> str:
    """``address`` as text: a socket path or ``ucx://host:port``; else a clear error."""
    try:
        text = os.fspath(address)  # type: ignore[call-overload]
    except TypeError:
        raise UsageTypeError(
            "an address is a socket path (str or path-like) or 'ucx://host:port', "
            f"not {type(address).__name__}"
        ) from None
    return os.fsdecode(text)


def subscribe(
    address: str | os.PathLike[str],
    *,
    mode: str = "block",
    credit: int | None = None,
    device: DeviceLike | None = None,
    timeout: float = 10.0,
    allowed_uids: Iterable[int] | None = None,
    secret: str | bytes | None = None,
    insecure: bool = False,
    spin_us: float = 0.0,
    wait: float = 0.0,
    depth: int | None = None,
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
        Local GPU, an ordinal or a ``cupy.cuda.Device`` (default: the
        producer's GPU for a local publisher, 0 for a remote one).
    timeout:
        Seconds for connecting and the handshake.
    allowed_uids:
        Local publishers only: the uids the publisher may run as.
    secret, insecure:
        Remote servers only: the shared secret (default
        ``$CUPY_IPCPOOL_SECRET``), or ``insecure=True`` for a server without one.
    spin_us:
        Local publishers only: microseconds ``recv`` busy-polls before it
        sleeps (default 0).
    wait:
        Local publishers only: seconds to wait for a publisher that is not up
        yet (no socket, or a dead publisher's socket file) instead of failing
        at once; ``math.inf``: no limit.  Default 0.  To keep receiving across
        publisher restarts, see :func:`follow`.
    depth:
        Local publishers, ``mode="ahead"`` only: most frames handed out ahead
        of their messages (see :func:`cupy_ipcpool.channel.subscribe`).

    Raises
    ------
    UsageError
        An option that does not apply to this kind of address.
    """
    text = _address_text(address)
    device = optional_device(device)
    if text.startswith("ucx://"):
        if allowed_uids is not None:
            raise UsageError("allowed_uids applies to local publishers; remote ones use a secret")
        if spin_us:
            raise UsageError("spin_us applies to local publishers")
        if wait:
            raise UsageError(
                "wait applies to local publishers; a ucx:// subscriber connects at once"
            )
        if depth is not None:
            raise UsageError("depth (mode='ahead') applies to local publishers")
        from .remote import subscribe as subscribe_remote

        kwargs: dict[str, Any] = {} if credit is None else {"slots": credit}
        return subscribe_remote(
            text,
            secret=secret,
            insecure=insecure,
            mode=mode,
            device=0 if device is None else device,
            timeout=timeout,
            **kwargs,
        )
    if secret is not None or insecure:
        raise UsageError(
            "secret and insecure apply to ucx:// addresses; a local publisher checks the uid"
        )
    return subscribe_local(
        address,
        mode=mode,
        credit=credit,
        device=device,
        timeout=timeout,
        allowed_uids=allowed_uids,
        spin_us=spin_us,
        wait=wait,
        depth=depth,
    )


def follow(
    address: str | os.PathLike[str],
    *,
    wait: float = math.inf,
    restart_on_close: bool = False,
    **options: Any,
) -> Follower[Subscriber]:
    """Receive frames from whichever publisher serves ``address``, across its restarts.

    Returns a :class:`~cupy_ipcpool.channel.Follower` at once; it subscribes
    at the first ``recv()`` (or iteration step), waiting for a publisher.
    When a subscription ends with ``EndOfStream(clean=False)`` (the publisher
    died or was killed, hung up, or evicted this subscriber) it closes that
    subscriber and subscribes again to the next publisher at ``address``.  A
    clean close ends the iteration, unless ``restart_on_close``.

    Parameters
    ----------
    address:
        A local publisher's socket path (``ucx://`` addresses are not supported).
    wait:
        Seconds to wait for a publisher each time one is needed (default
        ``math.inf``: no limit); past it, ``recv`` raises
        :class:`~cupy_ipcpool.ChannelTimeoutError` and the follower stays usable.
    restart_on_close:
        After a clean close too, wait for the next publisher.
    **options:
        :func:`subscribe`'s options for each subscription (``mode``,
        ``credit``, ``device``, ``timeout``, ``allowed_uids``, ``spin_us``,
        ``depth``).

    Notes
    -----
    Sequence numbers start again with each publisher, whose pool (descriptor,
    slots) is a new one; frames of the old publisher stay valid until they
    are released or dropped.  ``follower.reconnects`` counts the publishers
    joined after the first.  See ``docs/protocol.md`` ("Restarts").

    Raises
    ------
    UsageError
        A ``ucx://`` address, or an option :func:`subscribe` does not take.
    """
    text = _address_text(address)
    if text.startswith("ucx://"):
        raise UsageError(
            "follow() follows local publishers; for a ucx:// server, subscribe again "
            "when its stream ends"
        )
    return follow_local(text, wait=wait, restart_on_close=restart_on_close, **options)
