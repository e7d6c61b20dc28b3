"""Where a remote server takes its frames from: the bridge, a local subscriber of the producer.

:func:`serve` opens the bridge (:class:`DeviceSource` over a GPU channel, or a
:class:`~._host.HostChannelSubscriber` over a host channel) and starts a
:class:`~._server.RemoteServer` on it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, overload

from .._args import (
    DeviceLike,
    deprecated,
    keyword_only_signature,
    moved_to_keywords,
    optional_device,
)
from .._errors import UsageError
from . import _wire as wire
from ._accept import HANDSHAKE_TIMEOUT, MAX_PENDING_PER_ADDRESS
from ._server import RemoteServer


class _DeviceFrame:
    __slots__ = ("_frame", "_stream", "arrays", "metadata", "seq")

    def __init__(self, frame: Any, arrays: tuple[Any, ...], stream: Any) -> None:
        self._frame = frame
        self._stream = stream
        self.seq = frame.seq
        self.arrays = arrays
        self.metadata = frame.metadata

    def release(self) -> None:
        self.arrays = ()
        self._frame.release(stream=self._stream)


class DeviceSource:
    """The bridge over a GPU channel: :func:`cupy_ipcpool.subscribe` on ``device``.

    Each frame's stream is synchronised on the host before UCX reads the
    slot (UCX copies on its own streams, which do not wait on the channel's
    GPU-side flag).  Non-contiguous arrays are copied to contiguous ones.
    """

    def __init__(
        self,
        address: str | os.PathLike[str],
        *,
        mode: str = "block",
        credit: int | None = None,
        device: DeviceLike | None = None,
        timeout: float = 10.0,
        allowed_uids: Iterable[int] | None = None,
    ) -> None:
        device = optional_device(device)  # before a GPU is looked for
        from .._arrays import cupy_module
        from ..channel import subscribe

        self._cp = cupy_module()
        self._sub = subscribe(
            address,
            mode=mode,
            credit=credit,
            device=device,
            timeout=timeout,
            allowed_uids=allowed_uids,
        )
        self.slot_nbytes = self._sub.peer.slot_nbytes
        self.num_slots = self._sub.peer.num_slots
        self.device = self._sub.peer.device
        self._stream: Any = None

    @overload
    def recv(self, *, timeout: float | None = None) -> _DeviceFrame: ...
    @overload
    @deprecated("pass timeout by keyword: recv(timeout=...)")
    def recv(self, *args: Any, timeout: float | None = None) -> _DeviceFrame: ...
    @keyword_only_signature
    def recv(self, *args: Any, timeout: float | None = None) -> _DeviceFrame:
        """The next frame, its arrays contiguous and their writes finished."""
        if args:
            (timeout,) = moved_to_keywords(DeviceSource.recv, args, timeout=timeout)
        cp = self._cp
        with cp.cuda.Device(self.device):
            if self._stream is None:
                self._stream = cp.cuda.Stream(non_blocking=True)
            stream = self._stream
            frame = self._sub.recv(timeout=timeout, stream=stream)
            with stream:
                arrays = tuple(
                    a if a.flags.c_contiguous else cp.ascontiguousarray(a) for a in frame.arrays
                )
            stream.synchronize()
        return _DeviceFrame(frame, arrays, stream)

    def close(self) -> None:
        """Close the bridge subscription."""
        self._sub.close()


def serve(
    address: str | os.PathLike[str],
    *,
    listen: str = f"127.0.0.1:{wire.DEFAULT_PORT}",
    secret: str | bytes | None = None,
    insecure: bool = False,
    memory: str = "device",
    mode: str = "block",
    credit: int | None = None,
    device: DeviceLike | None = None,
    max_subscribers: int = 16,
    max_pending_per_address: int = MAX_PENDING_PER_ADDRESS,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    send_timeout: float = 5.0,
    timeout: float = 10.0,
    linger: float = 5.0,
) -> RemoteServer:
    """Serve the channel at ``address`` (a local socket path) to remote subscribers.

    Parameters
    ----------
    address:
        The producer's channel: a :class:`cupy_ipcpool.Publisher` socket
        (``memory="device"``) or a :class:`HostChannelPublisher` socket
        (``memory="host"``).
    listen, secret, insecure, max_subscribers, linger:
        See :class:`RemoteServer`.
    max_pending_per_address, handshake_timeout, send_timeout:
        See :class:`RemoteServer`.
    memory:
        ``"device"`` (a GPU channel) or ``"host"`` (a host channel).
    mode, credit:
        How the bridge subscribes locally.  ``"block"`` (default): the bridge
        receives every frame, so remote ``"block"`` subscribers miss none (and
        can slow the producer, as local ones can).  ``"latest"``: the remote
        side never slows the producer; every remote subscriber may miss frames.
    device:
        GPU the bridge maps the producer's pool on, an ordinal or a
        ``cupy.cuda.Device`` (default: the producer's).
    timeout:
        Seconds to connect to the local channel.

    Returns
    -------
    RemoteServer
        Already serving; close it (or use it as a context manager) when done.
    """
    wire.parse_listen(listen)  # before anything is connected: where it would listen
    device = optional_device(device)
    source: Any
    if memory == "device":
        source = DeviceSource(address, mode=mode, credit=credit, device=device, timeout=timeout)
    elif memory == "host":
        from ._host import HostChannelSubscriber

        source = HostChannelSubscriber(
            address, mode=mode, credit=credit, timeout=timeout, writable=True
        )
    else:
        raise UsageError(f"memory must be 'device' or 'host', not {memory!r}")
    try:
        return RemoteServer(
            source,
            listen=listen,
            secret=secret,
            insecure=insecure,
            max_subscribers=max_subscribers,
            max_pending_per_address=max_pending_per_address,
            handshake_timeout=handshake_timeout,
            send_timeout=send_timeout,
            linger=linger,
            own_source=True,
        )
    except BaseException:
        source.close()
        raise


__all__ = ["DeviceSource", "serve"]
