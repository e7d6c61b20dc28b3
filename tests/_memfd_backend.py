"""A GPU-free stand-in for the slot pool: each slot is a memfd mapped with mmap.

The producer writes a pattern derived from the frame's seq into the slot
before publishing; the consumer maps the same fds and checks the pattern when
the frame arrives and again just before releasing it, so any overwrite of a
slot while a lease is held is caught.
"""

from __future__ import annotations

import mmap
import os
import struct

from cupy_ipcpool.channel._handshake import Welcome
from cupy_ipcpool.channel._protocol import Frame
from cupy_ipcpool.channel._publisher_core import PublisherCore
from cupy_ipcpool.channel._subscriber_core import SubscriberCore

_SIZE = struct.Struct("<Q")


def pattern(seq: int, size: int) -> bytes:
    """Return the bytes frame ``seq`` puts in a slot of ``size`` bytes."""
    return seq.to_bytes(8, "little") * (size // 8)


class MemfdSlots:
    """``num_slots`` memfds of ``slot_size`` bytes, each mapped read-write."""

    def __init__(self, num_slots: int, slot_size: int = 4096) -> None:
        self.slot_size = slot_size
        self.fds: list[int] = []
        self.maps: list[mmap.mmap] = []
        try:
            for i in range(num_slots):
                fd = os.memfd_create(f"ipcpool-slot{i}", os.MFD_CLOEXEC)
                self.fds.append(fd)
                os.ftruncate(fd, slot_size)
                self.maps.append(mmap.mmap(fd, slot_size))
        except BaseException:
            self.close()
            raise

    def welcome(self, *more_fds: int) -> Welcome:
        """What a subscriber is welcomed with: payload = slot size, fds = the memfds (and
        ``more_fds`` after them)."""
        return Welcome(_SIZE.pack(self.slot_size), (*self.fds, *more_fds))

    def write(self, slot: int, seq: int) -> None:
        """Fill ``slot`` with frame ``seq``'s pattern."""
        self.maps[slot][:] = pattern(seq, self.slot_size)

    def close(self) -> None:
        for m in self.maps:
            m.close()
        for fd in self.fds:
            os.close(fd)
        self.maps.clear()
        self.fds.clear()


class MemfdProducer:
    """A :class:`PublisherCore` over :class:`MemfdSlots`."""

    def __init__(self, address: str, num_slots: int, slot_size: int = 4096, **kwargs: object):
        self.slots = MemfdSlots(num_slots, slot_size)
        try:
            self.core = PublisherCore(
                address,
                num_slots,
                welcome=self.slots.welcome(),
                **kwargs,  # type: ignore[arg-type]
            )
        except BaseException:
            self.slots.close()
            raise

    def publish_next(self, timeout: float | None = 5.0, payload: bytes = b"") -> int:
        """Acquire a slot, write the next seq's pattern, publish; return the seq."""
        slot, _readers = self.core.acquire(timeout)
        seq = self.core.next_seq
        self.slots.write(slot, seq)
        got = self.core.publish(slot, payload)
        assert got == seq
        return seq

    def wait_subscribers(self, n: int, timeout: float = 10.0) -> None:
        """Poll until at least ``n`` subscribers are adopted."""
        import time

        deadline = time.monotonic() + timeout
        while len(self.core.subscribers) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.core.subscribers)} of {n} subscribers joined")
            self.core.poll(0.01)

    def close(self) -> None:
        self.core.close()
        self.slots.close()

    def __enter__(self) -> MemfdProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OverwriteDetected(AssertionError):
    """A slot changed while the consumer held a lease on it."""


class MemfdConsumer:
    """A :class:`SubscriberCore` that maps the memfd slots and verifies every frame."""

    def __init__(self, address: str, **kwargs: object) -> None:
        self.core = SubscriberCore(address, **kwargs)  # type: ignore[arg-type]
        try:
            (self.slot_size,) = _SIZE.unpack_from(self.core.welcome_payload)  # a row may follow
            fds = self.core.take_fds()
            self.maps: list[mmap.mmap] = []
            try:
                for fd in fds:
                    self.maps.append(mmap.mmap(fd, self.slot_size, prot=mmap.PROT_READ))
            finally:
                for fd in fds:
                    os.close(fd)  # the mapping keeps the memory alive
        except BaseException:
            self.core.close()
            raise

    def check(self, frame: Frame) -> None:
        """Raise :class:`OverwriteDetected` unless the slot holds ``frame``'s pattern."""
        got = self.maps[frame.slot][:]
        if got != pattern(frame.seq, self.slot_size):
            found = int.from_bytes(got[:8], "little")
            raise OverwriteDetected(
                f"slot {frame.slot} should hold frame {frame.seq} but holds frame {found}"
            )

    def recv(self, timeout: float | None = 10.0) -> Frame:
        """Receive a frame and verify it."""
        frame = self.core.recv(timeout)
        self.check(frame)
        return frame

    def release(self, frame: Frame) -> None:
        """Verify the frame once more, then release it."""
        self.check(frame)
        self.core.release(frame.seq, frame.slot)

    def close(self) -> None:
        self.core.close()
        for m in self.maps:
            m.close()
        self.maps.clear()

    def __enter__(self) -> MemfdConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
