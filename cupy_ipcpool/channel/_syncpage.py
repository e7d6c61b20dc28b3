"""Cross-process GPU ordering with stream memory operations on a shared flag page.

A :class:`SyncPage` is one small VMM allocation, shared like a slot (POSIX fd),
that holds 32-bit flags:

* one *frame flag* per slot: the producer's stream writes the slot's
  generation there after the kernels that filled it
  (``cuStreamWriteValue32``); a subscriber's stream waits until the flag has
  reached that generation (``cuStreamWaitValue32`` with ``GEQ``) before its
  work touches the frame;
* one *read flag* per (subscriber index, slot): the subscriber's stream
  writes the generation it read there when it releases the frame; before the
  producer writes the slot again, its stream waits for every reader's flag.

Both operations are executed by the GPU: neither host blocks.  (Interprocess
CUDA events were tried first: on the H200 with driver 580 a kernel launch
on a stream that waits on another process's event blocked the host until the
other process's kernel had finished.)  The comparison is the driver's cyclic
``(int32_t)(*flag - value) >= 0``, so generations may wrap around 2**32.
"""

from __future__ import annotations

from .. import _driver
from .._errors import UsageError
from .._vmm import Allocation, round_up

_FLAG = 4


class SyncPage:
    """Flags for one channel: ``num_slots`` frame flags and read flags per subscriber.

    Parameters
    ----------
    alloc:
        The mapped allocation (created here or imported from a peer).
    num_slots, max_subscribers:
        The layout: frame flags first, then ``max_subscribers`` rows of
        ``num_slots`` read flags, starting 256-byte aligned.
    """

    def __init__(self, alloc: Allocation, num_slots: int, max_subscribers: int) -> None:
        self.alloc = alloc
        self.num_slots = num_slots
        self.max_subscribers = max_subscribers
        self._reads = round_up(num_slots * _FLAG, 256)
        if self._reads + num_slots * max_subscribers * _FLAG > alloc.size:
            raise UsageError("sync page too small for its layout")
        driver = _driver.driver_module()
        self._write = driver.cuStreamWriteValue32
        self._wait = driver.cuStreamWaitValue32
        self._geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self._plain = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        self._reads_base = alloc.ptr + self._reads

    @staticmethod
    def nbytes_for(num_slots: int, max_subscribers: int, granularity: int) -> int:
        """Bytes to allocate for this layout (a multiple of ``granularity``)."""
        need = round_up(num_slots * _FLAG, 256) + num_slots * max_subscribers * _FLAG
        return round_up(need, granularity)

    @classmethod
    def create(cls, num_slots: int, max_subscribers: int, device: int) -> SyncPage:
        """Allocate, export and zero a page on ``device``."""
        import cupy

        size = cls.nbytes_for(num_slots, max_subscribers, _driver.granularity(device))
        alloc = Allocation.create(size, device)
        try:
            with cupy.cuda.Device(device):
                cupy.cuda.runtime.memset(alloc.ptr, 0, size)
                cupy.cuda.runtime.deviceSynchronize()
            return cls(alloc, num_slots, max_subscribers)
        except BaseException:
            alloc.close()
            raise

    @classmethod
    def import_fd(
        cls, fd: int, nbytes: int, num_slots: int, max_subscribers: int, device: int
    ) -> SyncPage:
        """Map a peer's page from ``fd`` (which stays owned by the caller)."""
        alloc = Allocation.import_fd(fd, nbytes, device)
        try:
            return cls(alloc, num_slots, max_subscribers)
        except BaseException:
            alloc.close()
            raise

    @property
    def fd(self) -> int:
        """The exported fd (creator side)."""
        return self.alloc.fd

    def frame_flag(self, slot: int) -> int:
        """Device address of ``slot``'s frame flag."""
        return self.alloc.ptr + slot * _FLAG

    def read_flag(self, index: int, slot: int) -> int:
        """Device address of subscriber ``index``'s read flag for ``slot``."""
        return self._reads_base + (index * self.num_slots + slot) * _FLAG

    def write(self, stream: int, addr: int, value: int) -> None:
        """Enqueue on ``stream``: after prior work, store ``value`` at ``addr``."""
        (err,) = self._write(stream, addr, value & 0xFFFFFFFF, self._plain)
        if err:
            _driver.check("cuStreamWriteValue32", (err,))

    def wait(self, stream: int, addr: int, value: int) -> None:
        """Enqueue on ``stream``: wait until the flag at ``addr`` reaches ``value`` (cyclic)."""
        (err,) = self._wait(stream, addr, value & 0xFFFFFFFF, self._geq)
        if err:
            _driver.check("cuStreamWaitValue32", (err,))

    def close(self) -> None:
        """Unmap and release (idempotent, never raises)."""
        self.alloc.close()
