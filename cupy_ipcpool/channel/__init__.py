"""The channel layer: publish / subscribe frames between processes.

Modules, bottom first: :mod:`._protocol` (the wire format, pure),
:mod:`._leases` (the lease book, pure), :mod:`._session` (sockets,
handshakes, credit; no GPU) with its compiled per-frame socket calls
(``_frameio``, from ``_frameio.c``), :mod:`._syncpage` (the GPU flags),
:mod:`._payload` (limits and payload heads), :mod:`._publisher` and
:mod:`._subscriber` (the GPU-level API re-exported by :mod:`cupy_ipcpool`), and
:mod:`._follow` (waiting for a publisher and following it across restarts).
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
