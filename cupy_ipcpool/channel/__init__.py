"""The channel layer: publish / subscribe frames between processes.

Modules, bottom first: :mod:`._protocol` (the wire format, pure),
:mod:`._leases` (the lease book, pure), :mod:`._ctlring` (a shared-memory
control ring, not yet on the per-frame path), :mod:`._session` (sockets,
handshakes, credit; no GPU) with its compiled per-frame socket calls
(``_frameio``, from ``_frameio.c``), :mod:`._syncpage` (the GPU flags),
:mod:`._payload` (limits and payload heads), :mod:`._publisher` and
:mod:`._subscriber` (the GPU-level API re-exported by :mod:`cupy_ipcpool`).
"""

from ._payload import MAX_ARRAYS, MAX_CHANNEL_SLOTS, MAX_METADATA
from ._publisher import Publisher, PublishFrame
from ._subscriber import Frame, Subscriber, subscribe

__all__ = [
    "MAX_ARRAYS",
    "MAX_CHANNEL_SLOTS",
    "MAX_METADATA",
    "Frame",
    "PublishFrame",
    "Publisher",
    "Subscriber",
    "subscribe",
]
