"""cupy_ipcpool: share CuPy arrays between processes on one machine with no copies.

A ring of CUDA VMM buffers exported as POSIX file descriptors; peers map them
once and receive frames as ``cupy.ndarray`` views.  Importing this package
needs no GPU; every GPU call raises :class:`CudaUnavailableError` where there
is none.
"""

from ._allocator import AllocationScope, SlotArena, allocating
from ._channel import Frame, Publisher, PublishFrame, Subscriber, subscribe
from ._compat import IPCBufferManager
from ._errors import (
    ChannelTimeoutError,
    CudaError,
    CudaOutOfMemoryError,
    CudaUnavailableError,
    DescriptorError,
    EndOfStream,
    EvictedError,
    ForkedProcessError,
    IpcPoolError,
    LeaseStateError,
    NotShareableError,
    PeerRefusedError,
    PoolClosedError,
    ProtocolError,
    SlotBusyError,
    SlotFullError,
    StaleHandleError,
    TeardownWarning,
    TransportError,
    UnsupportedDeviceError,
)
from ._handles import ArrayHandle, PoolDescriptor
from ._peer import PeerPool, attach
from ._pool import IpcPool
from ._version import __version__

__all__ = [
    "AllocationScope",
    "ArrayHandle",
    "ChannelTimeoutError",
    "CudaError",
    "CudaOutOfMemoryError",
    "CudaUnavailableError",
    "DescriptorError",
    "EndOfStream",
    "EvictedError",
    "ForkedProcessError",
    "Frame",
    "IPCBufferManager",
    "IpcPool",
    "IpcPoolError",
    "LeaseStateError",
    "NotShareableError",
    "PeerPool",
    "PeerRefusedError",
    "PoolClosedError",
    "PoolDescriptor",
    "ProtocolError",
    "PublishFrame",
    "Publisher",
    "SlotArena",
    "SlotBusyError",
    "SlotFullError",
    "StaleHandleError",
    "Subscriber",
    "TeardownWarning",
    "TransportError",
    "UnsupportedDeviceError",
    "__version__",
    "allocating",
    "attach",
    "subscribe",
]
