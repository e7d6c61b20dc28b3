"""KeptArray's "in use" rule, on CPU: CuPy's three objects stood in for by plain classes.

A kept array (the pool's reusable view, the subscriber's kept arrays) may be
handed out again only while nothing but its keeper refers to the array, its
``MemoryPointer`` or its memory.  The rule is reference counting of Python
objects; the GPU tests check it over real CuPy arrays
(``tests/test_reusable_view_gpu.py``).
"""

from __future__ import annotations

import gc
from types import SimpleNamespace
from typing import Any

from cupy_ipcpool._arrays import KeptArray


class _Memory:
    def __init__(self, ptr: int, size: int, owner: Any, device: int) -> None:
        self.ptr, self.size, self.owner, self.device = ptr, size, owner, device


class _MemoryPointer:
    def __init__(self, mem: _Memory, offset: int) -> None:
        self.mem = mem
        self.ptr = mem.ptr + offset


class _NDArray:
    """Like ``cupy.ndarray``: ``data`` is the same MemoryPointer on every access."""

    def __init__(self, shape: Any, dtype: Any, memptr: _MemoryPointer, strides: Any = None) -> None:
        self.shape, self.dtype, self.data, self.strides = shape, dtype, memptr, strides

    def view(self) -> _NDArray:  # a view refers to the same MemoryPointer
        return _NDArray(self.shape, self.dtype, self.data)


_CP = SimpleNamespace(
    ndarray=_NDArray, cuda=SimpleNamespace(UnownedMemory=_Memory, MemoryPointer=_MemoryPointer)
)


def _kept() -> KeptArray:
    return KeptArray(_CP, 0x1000, 4096, object(), 0, 256, (16,), "int32")


def test_a_new_kept_array_is_not_in_use() -> None:
    kept = _kept()
    assert not kept.in_use()
    assert kept.array.data.ptr == 0x1000 + 256  # offset applied
    assert not kept.in_use()  # looking at it through the keeper does not count


def test_a_reference_to_the_array_makes_it_in_use_until_dropped() -> None:
    kept = _kept()
    held = kept.array
    assert kept.in_use()
    del held
    assert not kept.in_use()


def test_a_view_or_its_memory_pointer_or_memory_counts_as_use() -> None:
    kept = _kept()
    view = kept.array.view()  # a slice/view: holds the MemoryPointer, not the array
    assert kept.in_use()
    del view
    gc.collect()
    assert not kept.in_use()
    memptr = kept.array.data
    assert kept.in_use()
    del memptr
    mem = kept.array.data.mem  # e.g. a DLPack capsule or torch tensor keeps the memory
    assert kept.in_use()
    del mem
    assert not kept.in_use()


def test_in_use_in_a_container_and_back() -> None:
    kept = _kept()
    bag = [kept.array]
    assert kept.in_use()
    bag.clear()
    assert not kept.in_use()
