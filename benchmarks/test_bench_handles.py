"""ArrayHandle on the consumer's per-frame path: decode, encode, bounds check, construction.

CPU only: no GPU is touched.  ``benchmarks/conftest.py`` skips every benchmark on
a machine without a VMM-capable GPU; to run these anywhere, leave it out::

    python -m pytest benchmarks/test_bench_handles.py -p no:cacheprovider --noconftest

The baselines are the bare :mod:`struct` calls on the same bytes, so the ratio of
medians in the ``handles`` group is the price of validation.
"""

from __future__ import annotations

import struct

import numpy
import pytest

from cupy_ipcpool._handles import ArrayHandle

SLOT_NBYTES = 1 << 24
# A 3-D frame (480 x 640 RGB, uint8) at an offset inside its slot.
HANDLE = ArrayHandle.contiguous(3, 17, (480, 640, 3), "uint8", offset=4096)
PACKED = HANDLE.pack()
LAYOUT = struct.Struct("<IQQBB3Q3q")  # the wire layout of a 3-D handle
FIELDS = LAYOUT.unpack(PACKED)


@pytest.mark.benchmark(group="handles")
def test_baseline_struct_unpack(benchmark):
    assert benchmark(LAYOUT.unpack_from, PACKED, 0) == FIELDS


@pytest.mark.benchmark(group="handles")
def test_from_bytes(benchmark):
    assert benchmark(ArrayHandle.from_bytes, PACKED) == HANDLE


@pytest.mark.benchmark(group="handles")
def test_unpack_from(benchmark):
    assert benchmark(ArrayHandle.unpack_from, PACKED, 0) == (HANDLE, len(PACKED))


@pytest.mark.benchmark(group="handles")
def test_baseline_struct_pack(benchmark):
    assert benchmark(LAYOUT.pack, *FIELDS) == PACKED


@pytest.mark.benchmark(group="handles")
def test_pack(benchmark):
    assert benchmark(HANDLE.pack) == PACKED


@pytest.mark.benchmark(group="handles")
def test_check_fits(benchmark):
    benchmark(HANDLE.check_fits, SLOT_NBYTES)


@pytest.mark.benchmark(group="handles")
def test_construct(benchmark):
    dtype = numpy.dtype("uint8")
    args = (3, 17, 4096, HANDLE.shape, HANDLE.strides, dtype)
    assert benchmark(ArrayHandle, *args) == HANDLE
