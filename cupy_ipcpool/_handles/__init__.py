"""Plain data that crosses process boundaries, its binary wire format, and validation.

This is the bottom layer of cupy_ipcpool: it needs no GPU and imports nothing from
the library except :mod:`cupy_ipcpool._errors`.

* :class:`PoolDescriptor` (:mod:`._descriptor`) says everything a peer needs to
  import a pool: who exports it, on which device, how many slots of which size,
  and where the file descriptors of the slots can be fetched.
* :class:`ArrayHandle` (:mod:`._array`) names one array inside one slot: slot,
  generation, byte offset, shape, strides and dtype.
* :mod:`._validate` holds the limits, the dtype whitelist and the checks both
  use.

Every byte string that comes from another process is untrusted: decoding
raises only :class:`~cupy_ipcpool._errors.DescriptorError`.  The wire layouts
are in the docstrings of :mod:`._descriptor` and :mod:`._array`.
"""

from __future__ import annotations

# the layouts other modules check themselves against (the compiled parts, the C library)
from ._array import _GENERATION_AT as _GENERATION_AT
from ._array import _HANDLE_HEADER as _HANDLE_HEADER
from ._array import _NDIM_AT as _NDIM_AT
from ._array import _OFFSET_AT as _OFFSET_AT
from ._array import ArrayHandle
from ._descriptor import _DESC_HEADER as _DESC_HEADER
from ._descriptor import _KIND_POOL as _KIND_POOL
from ._descriptor import _MAGIC as _MAGIC
from ._descriptor import FORMAT_VERSION, SUPPORTED_VERSIONS, PoolDescriptor, own_pid_namespace
from ._descriptor import _rebuild_descriptor as _rebuild_descriptor
from ._validate import _DTYPES as _DTYPES
from ._validate import (
    DEVICE_UUID_NBYTES,
    MAX_NDIM,
    MAX_SLOT_NBYTES,
    MAX_SLOTS,
    MAX_SOCKET_PATH,
    POOL_ID_NBYTES,
    validate_dtype,
)

__all__ = [
    "DEVICE_UUID_NBYTES",
    "FORMAT_VERSION",
    "MAX_NDIM",
    "MAX_SLOTS",
    "MAX_SLOT_NBYTES",
    "MAX_SOCKET_PATH",
    "POOL_ID_NBYTES",
    "SUPPORTED_VERSIONS",
    "ArrayHandle",
    "PoolDescriptor",
    "own_pid_namespace",
    "validate_dtype",
]
