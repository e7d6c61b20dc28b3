"""Device frames between processes of one machine: through buffers UCX's ``cuda_ipc`` takes.

Between two processes of one machine UCX moves device memory with its
``cuda_ipc`` transport, one copy on the GPU, only when it can export the
memory to the peer: ``cudaMalloc`` memory (a legacy IPC handle) or VMM memory
made with fabric handles.  The slots of an :class:`~cupy_ipcpool.IpcPool` are
VMM memory exported as POSIX fds, which ``cuda_ipc`` cannot export: UCX then
falls back to its copy pipeline through host memory over TCP.  Measured on
an H100 with UCX 1.21 (raw UCXX, 64 MiB): 0.53 GB/s for slots against 240 GB/s
between ``cudaMalloc`` buffers.

So where ``cuda_ipc`` may carry a subscriber's frames (the peer is on this
machine and the configured transports include it) and the slot memory is not
exportable by it, each side stages: the server copies a frame's arrays into a
``cudaMalloc`` buffer on the GPU (once per frame, whatever the number of such
subscribers) and sends from there; the subscriber receives into a
``cudaMalloc`` buffer of its receive slot and copies the frame into the slot
before handing it out.  A copy costs about 50 µs per 64 MiB on an H100.
Between machines (TCP, or RDMA with GPUDirect, which registers the slots
themselves: they are allocated GPUDirect-RDMA capable) and with transports
that exclude ``cuda_ipc`` the slots go on the wire as they are.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

from . import _wire as wire

#: ``UCX_TLS`` names whose transport set includes ``cuda_ipc`` (``cuda`` is the alias
#: of every CUDA transport)
_CUDA_IPC_NAMES = frozenset({"all", "cuda", "cuda_ipc"})


def transports_include_cuda_ipc(tls: str) -> bool:
    """Whether UCX's ``TLS`` setting (``UCX_TLS``: ``all``, a list, ``^`` a list excluded)
    lets UCX pick ``cuda_ipc``."""
    text = tls.strip().lower()
    if not text:
        return True  # unset: UCX's default, all
    if text.startswith("^"):
        excluded = {name.strip() for name in text[1:].split(",")}
        return not excluded & {"cuda", "cuda_ipc"}
    names = {name.strip().lstrip("\\") for name in text.split(",")}
    return bool(names & _CUDA_IPC_NAMES)


def same_machine(sock: socket.socket) -> bool:
    """Whether the peer of the connected TCP socket ``sock`` is this machine.

    A loopback peer, or one whose address is the socket's own local address
    (a connection to one of this machine's interfaces).  Processes of one
    machine in separate network namespaces look like two machines here.
    """
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        peer = sock.getpeername()[0]
        local = sock.getsockname()[0]
    except OSError:
        return False
    try:
        if ipaddress.ip_address(peer.split("%")[0]).is_loopback:
            return True
    except ValueError:
        return False
    return bool(peer == local)


def cuda_ipc_exports(ptr: int) -> bool:
    """Whether UCX's ``cuda_ipc`` can export the device memory at ``ptr`` to a peer process.

    It exports ``cudaMalloc`` memory (legacy IPC capable) and VMM memory whose
    allocation allows fabric handles; an IpcPool slot is neither.
    """
    from .._driver import call, driver_module

    driver = driver_module()
    attr = driver.CUpointer_attribute
    if call("cuPointerGetAttribute", attr.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr):
        return True
    types = int(call("cuPointerGetAttribute", attr.CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, ptr))
    fabric = int(driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC)
    return bool(types & fabric)


def cuda_ipc_may_carry(sock: socket.socket, tls: str) -> bool:
    """Whether UCX may pick ``cuda_ipc`` for device frames to or from the peer of ``sock``:
    it is on this machine and the worker's ``TLS`` setting ``tls`` leaves it in."""
    return same_machine(sock) and transports_include_cuda_ipc(tls)


def needs_staging(sock: socket.socket, tls: str, ptr: int) -> bool:
    """Whether a device frame to or from the peer of ``sock`` goes through a staging buffer.

    ``tls``: the worker's ``TLS`` setting; ``ptr``: device memory of the slots.
    """
    return cuda_ipc_may_carry(sock, tls) and not cuda_ipc_exports(ptr)


class StagingBuffers:
    """``cudaMalloc`` buffers of ``nbytes`` on ``device``, made when first needed and reused.

    Made with ``cupy.cuda.Memory`` (``cudaMalloc``), not CuPy's allocator, which
    may be hooked to hand out IpcPool slots.  Copies run on one stream of
    their own and are waited for on the host before a send starts or a frame
    is handed out.
    """

    def __init__(self, nbytes: int, device: int) -> None:
        from .._arrays import cupy_module

        self._cp = cupy_module()
        self.nbytes = int(nbytes)
        self.device = int(device)
        self._free: list[Any] = []
        self._made = 0
        with self._cp.cuda.Device(self.device):
            self._stream = self._cp.cuda.Stream(non_blocking=True)

    @property
    def made(self) -> int:
        """How many buffers were allocated (the most in use at once)."""
        return self._made

    def take(self) -> Any:
        """A free buffer (a ``cupy.cuda.Memory``), allocated if none is free."""
        if self._free:
            return self._free.pop()
        with self._cp.cuda.Device(self.device):
            memory = self._cp.cuda.Memory(self.nbytes)
        self._made += 1
        return memory

    def give(self, memory: Any) -> None:
        """Return a buffer from :meth:`take`."""
        self._free.append(memory)

    def views(self, memory: Any, specs: tuple[wire.ArraySpec, ...]) -> list[Any]:
        """``specs`` laid out in ``memory`` as :func:`wire.layout` lays them out in a slot."""
        import numpy

        cp = self._cp
        offsets = wire.layout(specs, self.nbytes)
        return [
            cp.ndarray(spec.shape, numpy.dtype(spec.typestr), cp.cuda.MemoryPointer(memory, off))
            for off, spec in zip(offsets, specs, strict=True)
        ]

    def copy(self, sources: list[Any], targets: list[Any]) -> None:
        """Copy each source array into its target (same size, contiguous); wait for it."""
        cp = self._cp
        with cp.cuda.Device(self.device):
            stream = self._stream
            for src, dst in zip(sources, targets, strict=True):
                if src.nbytes:
                    cp.cuda.runtime.memcpyAsync(
                        dst.data.ptr, src.data.ptr, src.nbytes,
                        cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr,
                    )  # fmt: skip
            stream.synchronize()

    def close(self) -> None:
        """Free the buffers not in use (those in use go with their last reference)."""
        self._free.clear()


__all__ = [
    "StagingBuffers",
    "cuda_ipc_exports",
    "cuda_ipc_may_carry",
    "needs_staging",
    "same_machine",
    "transports_include_cuda_ipc",
]
