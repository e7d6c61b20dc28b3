"""cupy_ipcpool: share CuPy arrays between processes on one machine with no copies.

A ring of CUDA VMM buffers exported as POSIX file descriptors; peers map them
once and receive frames as ``cupy.ndarray`` views.  Importing this package
needs no GPU; every GPU call raises :class:`CudaUnavailableError` where there
is none.
"""

from ._allocator import allocating
from ._arrays import dlpack_safe
from ._compat import IPCBufferManager
from ._connect import follow, subscribe
from ._errors import (
    ChannelTimeoutError,
    CompiledPartError,
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
    SlotIndexError,
    StaleHandleError,
    TeardownWarning,
    TransportError,
    TransportTimeoutError,
    UnsupportedDeviceError,
    UsageError,
    UsageTypeError,
)
from ._handles import ArrayHandle, PoolDescriptor
from ._peer import PeerPool, attach
from ._pool import IpcPool, SlotToken
from ._seedpeer import SeedBuffers, import_seed_buffers
from ._slots import LeaseSource
from ._version import __version__
from .channel import Follower, Frame, Publisher, PublishFrame, Subscriber

__all__ = [
    "ArrayHandle",
    "ChannelTimeoutError",
    "CompiledPartError",
    "CudaError",
    "CudaOutOfMemoryError",
    "CudaUnavailableError",
    "DescriptorError",
    "EndOfStream",
    "EvictedError",
    "Follower",
    "ForkedProcessError",
    "Frame",
    "IPCBufferManager",
    "IpcPool",
    "IpcPoolError",
    "LeaseSource",
    "LeaseStateError",
    "NotShareableError",
    "PeerPool",
    "PeerRefusedError",
    "PoolClosedError",
    "PoolDescriptor",
    "ProtocolError",
    "PublishFrame",
    "Publisher",
    "SeedBuffers",
    "SlotBusyError",
    "SlotFullError",
    "SlotIndexError",
    "SlotToken",
    "StaleHandleError",
    "Subscriber",
    "TeardownWarning",
    "TransportError",
    "TransportTimeoutError",
    "UnsupportedDeviceError",
    "UsageError",
    "UsageTypeError",
    "__version__",
    "allocating",
    "attach",
    "dlpack_safe",
    "follow",
    "import_seed_buffers",
    "subscribe",
]
