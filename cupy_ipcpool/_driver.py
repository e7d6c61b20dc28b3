"""Checked calls into ``cuda.bindings.driver``.

The binding is imported and the driver initialised lazily, on the first GPU
call, so that ``import cupy_ipcpool`` works on machines without a driver.  Every
failure to reach the driver becomes one :class:`CudaUnavailableError` that says
what is missing; every failing driver call becomes a :class:`CudaError` that
carries the call and the driver's enum name.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from ._errors import (
    CudaError,
    CudaUnavailableError,
    UnsupportedDeviceError,
    UsageError,
    UsageTypeError,
    cuda_error,
)

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "mod": the driver module, or "error": why it is unusable

#: Bumped in every child created by ``fork``: objects remember the epoch they were
#: made in and refuse to touch CUDA in another one (cheaper than ``getpid`` per call).
_fork_epoch = 0


def _after_fork_in_child() -> None:
    global _fork_epoch, _lock
    _fork_epoch += 1
    _lock = threading.Lock()  # another thread may have held it at the fork
    _state.clear()
    _primary.clear()
    _infos.clear()
    _uuid_ordinals.clear()


def fork_epoch() -> int:
    """How many ``fork`` calls separate this process from the first one (0 there)."""
    return _fork_epoch


def _load() -> Any:
    """Import the binding and ``cuInit`` once per process; return the module."""
    mod = _state.get("mod")
    if mod is not None:
        return mod
    with _lock:
        if "error" in _state:
            raise CudaUnavailableError(_state["error"])
        if "mod" in _state:
            return _state["mod"]
        try:
            from cuda.bindings import driver
        except Exception as exc:  # ImportError and any binding-load failure
            _state["error"] = (
                f"the cuda-bindings package cannot be imported ({exc}); "
                "install cuda-bindings matching your driver's CUDA major: from the source "
                "tree, python3 -m pip install -e '.[cu13]' (CUDA 13) or -e '.[cu12]' (CUDA 12)"
            )
            raise CudaUnavailableError(_state["error"]) from None
        try:
            (err,) = driver.cuInit(0)
        except Exception as exc:  # libcuda.so missing: raised by the binding's loader
            _state["error"] = (
                f"no NVIDIA driver found ({type(exc).__name__}: {exc}); "
                "a GPU and its driver (libcuda.so) are needed for this call"
            )
            raise CudaUnavailableError(_state["error"]) from None
        if err != driver.CUresult.CUDA_SUCCESS:
            _state["error"] = f"cuInit failed: {_error_name(driver, err)}; no usable CUDA device"
            raise CudaUnavailableError(_state["error"])
        _state["mod"] = driver
        return driver


def driver_module() -> Any:
    """Return ``cuda.bindings.driver`` after a successful ``cuInit``.

    Raises
    ------
    CudaUnavailableError
        When the binding, the driver, or a device is missing.
    """
    return _load()


def _error_name(driver: Any, err: Any) -> str:
    try:
        e2, name = driver.cuGetErrorName(err)
        if e2 == driver.CUresult.CUDA_SUCCESS and name:
            return str(name.decode() if isinstance(name, bytes) else name)
    except Exception:
        pass
    return f"CUresult {int(err)}"


def check(call: str, result: tuple[Any, ...]) -> Any:
    """Unpack a binding result tuple ``(CUresult, *values)``.

    Returns ``None``, the single value, or a tuple of values; raises
    :class:`CudaError` (or :class:`CudaOutOfMemoryError`) when the call failed.
    """
    err = result[0]
    if err:  # CUDA_SUCCESS == 0
        driver = _load()
        raise cuda_error(call, int(err), _error_name(driver, err))
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def call(name: str, *args: Any) -> Any:
    """Call ``driver.<name>(*args)`` and :func:`check` its result."""
    driver = _load()
    return check(name, getattr(driver, name)(*args))


def memop_pointers() -> tuple[int, int]:
    """The driver's ``cuStreamWriteValue32`` and ``cuStreamWaitValue32`` entry points (cached).

    Resolved with ``cuGetProcAddress`` (the default-stream semantics the
    binding's functions have), for :mod:`cupy_ipcpool._fastpath` to call
    without the binding's argument conversion.

    Raises
    ------
    CudaError
        The driver does not know one of them.
    """
    return _proc_address("cuStreamWriteValue32"), _proc_address("cuStreamWaitValue32")


def batch_memop_pointer() -> int:
    """The driver's ``cuStreamBatchMemOp`` entry point (cached), as :func:`memop_pointers`.

    Raises
    ------
    CudaError
        The driver does not know it.
    """
    return _proc_address("cuStreamBatchMemOp")


def _proc_address(symbol: str) -> int:
    """``cuGetProcAddress(symbol)`` at the CUDA 12 API version (cached per symbol)."""
    cache = _state.setdefault("proc_addresses", {})
    pfn = cache.get(symbol)
    if pfn is None:
        driver = _load()
        version = min(driver_version(), 12000)
        res = driver.cuGetProcAddress(symbol.encode(), version, 0)
        check(f"cuGetProcAddress({symbol})", (res[0],))
        pfn = int(res[1])
        if not pfn:
            raise CudaError(f"cuGetProcAddress({symbol})", 500, "CUDA_ERROR_NOT_FOUND")
        cache[symbol] = pfn
    return int(pfn)


def driver_version() -> int:
    """Return the driver's CUDA version as an int (e.g. ``13000``)."""
    return int(call("cuDriverGetVersion"))


def device_count() -> int:
    """Return the number of visible CUDA devices (0 is possible)."""
    return int(call("cuDeviceGetCount"))


def get_device(ordinal: int) -> Any:
    """Return the ``CUdevice`` for ``ordinal``, checking the range first."""
    if not isinstance(ordinal, int) or isinstance(ordinal, bool):
        raise UsageTypeError(f"device must be an int ordinal, not {type(ordinal).__name__}")
    n = device_count()
    if n == 0:
        raise CudaUnavailableError("the CUDA driver sees no device")
    if not 0 <= ordinal < n:
        raise UsageError(f"device {ordinal} does not exist: {n} device(s) visible (0..{n - 1})")
    return call("cuDeviceGet", ordinal)


def _attr(dev: Any, name: str) -> int:
    driver = _load()
    return int(call("cuDeviceGetAttribute", getattr(driver.CUdevice_attribute, name), dev))


def use_device(ordinal: int) -> None:
    """Make the device's primary context (the one CuPy uses) current on this thread."""
    ctx = _primary_context(ordinal)
    current = call("cuCtxGetCurrent")
    if current is None or int(current) != int(ctx):
        call("cuCtxSetCurrent", ctx)


def synchronize_context(ordinal: int) -> None:
    """Wait for every piece of GPU work queued in this process on ``ordinal``'s primary context.

    The primary context is pushed for the call and popped afterwards, so the
    calling thread's current context (and CuPy's current device) is unchanged.

    Raises
    ------
    CudaError
        When the context holds an error (a sticky one, such as an illegal
        address, from any earlier work of this process).
    """
    ctx = _primary_context(ordinal)
    call("cuCtxPushCurrent", ctx)
    try:
        call("cuCtxSynchronize")
    finally:
        call("cuCtxPopCurrent")


_primary: dict[int, Any] = {}


def _primary_context(ordinal: int) -> Any:
    """Retain (once per process) and return the primary context of ``ordinal``."""
    ctx = _primary.get(ordinal)
    if ctx is None:
        with _lock:
            ctx = _primary.get(ordinal)
            if ctx is None:
                ctx = call("cuDevicePrimaryCtxRetain", get_device(ordinal))
                _primary[ordinal] = ctx
    return ctx


def allocation_prop(ordinal: int, *, gpudirect_rdma: bool | None = None) -> Any:
    """A ``CUmemAllocationProp`` for pinned device memory exportable as a POSIX fd.

    ``gpudirect_rdma`` (default: where the device supports it with VMM) asks for
    memory a NIC can register, so UCX can send slots with GPUDirect RDMA.
    """
    driver = _load()
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = (
        driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    )
    if gpudirect_rdma is None:
        gpudirect_rdma = device_info(ordinal).gpudirect_rdma
    if gpudirect_rdma:
        # lets a NIC register the slots (UCX / GPUDirect RDMA for remote subscribers)
        prop.allocFlags.gpuDirectRDMACapable = 1
    return prop


def access_desc(ordinal: int) -> Any:
    """A ``CUmemAccessDesc`` granting read-write access to device ``ordinal``."""
    driver = _load()
    desc = driver.CUmemAccessDesc()
    desc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def granularity(ordinal: int, *, recommended: bool = False) -> int:
    """Allocation granularity in bytes for POSIX-fd-exportable device memory.

    Raises
    ------
    UnsupportedDeviceError
        When the driver reports a granularity of zero.
    """
    driver = _load()
    flag = (
        driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        if recommended
        else driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    )
    gran = int(
        call("cuMemGetAllocationGranularity", allocation_prop(ordinal, gpudirect_rdma=False), flag)
    )
    if gran <= 0:
        raise UnsupportedDeviceError(
            f"device {ordinal}: the driver reports an allocation granularity of {gran}"
        )
    return gran


@dataclass(frozen=True)
class DeviceInfo:
    """What the library needs to know about one device."""

    ordinal: int
    name: str
    uuid: bytes
    compute_capability: tuple[int, int]
    total_memory: int
    vmm: bool
    posix_fd: bool
    fabric: bool
    granularity: int | None
    gpudirect_rdma: bool = False
    #: Whether this process's contexts on the device are shared through the MPS
    #: daemon (``CU_DEVICE_ATTRIBUTE_MPS_ENABLED``); None where the driver does
    #: not say.
    mps: bool | None = None

    @property
    def usable(self) -> bool:
        """True when the device supports VMM with POSIX-fd handles."""
        return self.vmm and self.posix_fd and bool(self.granularity)


_infos: dict[int, DeviceInfo] = {}


def device_info(ordinal: int) -> DeviceInfo:
    """Name, UUID, memory and VMM / handle-type support of a device (cached per process)."""
    info = _infos.get(ordinal)
    if info is None:
        info = _infos[ordinal] = _query_device_info(ordinal)
    return info


def _query_device_info(ordinal: int) -> DeviceInfo:
    dev = get_device(ordinal)
    raw_name = call("cuDeviceGetName", 256, dev)
    name = raw_name.split(b"\0", 1)[0].decode(errors="replace")
    uuid = bytes(call("cuDeviceGetUuid", dev).bytes)
    cc = (
        _attr(dev, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
        _attr(dev, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"),
    )
    total = int(call("cuDeviceTotalMem", dev))
    vmm = bool(_attr(dev, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"))
    posix = bool(_attr(dev, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"))
    try:
        fabric = bool(_attr(dev, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"))
    except (CudaError, AttributeError):
        fabric = False
    try:
        rdma = bool(_attr(dev, "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"))
    except (CudaError, AttributeError):
        rdma = False
    mps: bool | None
    try:
        mps = bool(_attr(dev, "CU_DEVICE_ATTRIBUTE_MPS_ENABLED"))
    except (CudaError, AttributeError):
        mps = None
    gran: int | None = None
    if vmm and posix:
        try:
            gran = granularity(ordinal)
        except (CudaError, UnsupportedDeviceError):
            gran = None
    return DeviceInfo(ordinal, name, uuid, cc, total, vmm, posix, fabric, gran, rdma, mps)


def require_vmm_device(ordinal: int) -> DeviceInfo:
    """Return the device's info, or raise why it cannot host a pool.

    Raises
    ------
    CudaUnavailableError
        No driver or no device.
    UnsupportedDeviceError
        The device lacks VMM, POSIX-fd handles, or a usable granularity.
    """
    info = device_info(ordinal)
    if not info.vmm:
        raise UnsupportedDeviceError(
            f"device {ordinal} ({info.name}) does not support CUDA virtual memory management"
        )
    if not info.posix_fd:
        raise UnsupportedDeviceError(
            f"device {ordinal} ({info.name}) cannot export memory as POSIX file descriptors"
        )
    if not info.granularity:
        raise UnsupportedDeviceError(
            f"device {ordinal} ({info.name}): allocation granularity is unavailable or zero"
        )
    return info


_uuid_ordinals: dict[bytes, int | None] = {}


def ordinal_of_uuid(uuid: bytes) -> int | None:
    """Return the ordinal of the visible device with this UUID, or None (cached)."""
    key = uuid
    if key not in _uuid_ordinals:
        found = None
        for i in range(device_count()):
            if bytes(call("cuDeviceGetUuid", get_device(i)).bytes) == uuid:
                found = i
                break
        _uuid_ordinals[key] = found
    return _uuid_ordinals[key]


def can_access_peer(ordinal: int, peer: int) -> bool:
    """True when device ``ordinal`` can map memory that lives on device ``peer``."""
    if ordinal == peer:
        return True
    return bool(call("cuDeviceCanAccessPeer", get_device(ordinal), get_device(peer)))


def mem_info(ordinal: int) -> tuple[int, int]:
    """``(free, total)`` device memory in bytes."""
    use_device(ordinal)
    free, total = call("cuMemGetInfo")
    return int(free), int(total)


os.register_at_fork(after_in_child=_after_fork_in_child)
