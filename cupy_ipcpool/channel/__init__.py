"""The channel layer: publish / subscribe frames between processes.

Modules, bottom first: :mod:`._protocol` (the wire format; the engine decodes),
:mod:`._leases` (the lease book, pure), the GPU-free session core --
:mod:`._sockets` (the engine's per-frame socket calls, ``c/python/frameio.c``,
limits, how a connection ends), :mod:`._handshake` (the accept thread and
admission), :mod:`._publisher_core` and :mod:`._subscriber_core` --, then
:mod:`._syncpage` (the GPU flags), :mod:`._payload` (limits and payload
heads), :mod:`._settle` (ending a session with nothing left waiting),
:mod:`._publisher` and :mod:`._subscriber` (the GPU-level API re-exported by
:mod:`cupy_ipcpool`), :mod:`._waiting` (waiting for a publisher) and
:mod:`._follow` (following one across restarts).
"""

from ._follow import Follower, follow
from ._payload import MAX_ARRAYS, MAX_CHANNEL_SLOTS, MAX_METADATA
from ._publisher import Publisher, PublishFrame
from ._subscriber import Frame, Subscriber, subscribe

__all__ = [
    "MAX_ARRAYS",
    "MAX_CHANNEL_SLOTS",
    "MAX_METADATA",
    "Follower",
    "Frame",
    "PublishFrame",
    "Publisher",
    "Subscriber",
    "follow",
    "subscribe",
]
