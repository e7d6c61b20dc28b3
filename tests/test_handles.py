"""Tests of cupy_ipcpool._handles: data, wire format, validation, pickling with fds.

CPU tier: no GPU needed.  Multi-process tests use real children (spawn and
forkserver), real fds (memfd_create) and report the child's exception as
(type name, message).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import mmap
import multiprocessing
import os
import pickle
import struct
from collections.abc import Iterator
from typing import Any

import numpy
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cupy_ipcpool._errors import DescriptorError, StaleHandleError
from cupy_ipcpool._handles import (
    FORMAT_VERSION,
    MAX_NDIM,
    MAX_SLOT_NBYTES,
    MAX_SLOTS,
    MAX_SOCKET_PATH,
    ArrayHandle,
    PoolDescriptor,
    _rebuild_descriptor,
    own_pid_namespace,
    validate_dtype,
)
from tests import _fds

JOIN_TIMEOUT = 30.0
HEADER_SIZE = 88  # documented layout: the fd array starts at byte 88

ALL_DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]


def make_desc(**overrides: Any) -> PoolDescriptor:
    fields: dict[str, Any] = dict(
        pool_id=bytes(range(16)),
        exporter_pid=4242,
        exporter_start_time=123456789,
        exporter_uid=1000,
        device_uuid=b"\xab" * 16,
        device_ordinal=1,
        num_slots=3,
        slot_nbytes=1 << 20,
        alloc_nbytes=2 << 20,
        fds=(7, 8, 9),
        socket_path="/tmp/cupy-ipcpool-test.sock",
    )
    fields.update(overrides)
    return PoolDescriptor(**fields)


def handle_of(view: numpy.ndarray, base: numpy.ndarray, slot: int = 0, gen: int = 0) -> ArrayHandle:
    """The handle of ``view``, a view into ``base``'s buffer (which plays the slot)."""
    offset = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    return ArrayHandle(slot, gen, offset, view.shape, view.strides, view.dtype)


def rebuild(handle: ArrayHandle, base: numpy.ndarray) -> numpy.ndarray:
    """Form the array a consumer would form from ``handle`` over the slot ``base``."""
    return numpy.ndarray(
        handle.shape,
        dtype=handle.dtype,
        buffer=base.reshape(-1).view(numpy.uint8),
        offset=handle.offset,
        strides=handle.strides,
    )


# ---------------------------------------------------------------------------
# PoolDescriptor: construction and round trips


@pytest.mark.parametrize(
    "path", [None, "/tmp/x.sock", "/run/user/1000/ünïcode-€.sock", "/" + "a" * 106]
)
def test_descriptor_round_trip(path: str | None) -> None:
    desc = make_desc(socket_path=path)
    data = desc.to_bytes()
    assert data[:4] == b"IPCP"
    assert struct.unpack_from("<H", data, 4)[0] == FORMAT_VERSION
    back = PoolDescriptor.from_bytes(data)
    assert back == desc
    assert back.socket_path == path
    assert back.to_bytes() == data
    assert PoolDescriptor.from_bytes(bytearray(data)) == desc
    assert PoolDescriptor.from_bytes(memoryview(data)) == desc
    assert back.take_local_fds() is None


def test_descriptor_extremes_round_trip() -> None:
    desc = make_desc(
        exporter_pid=2**31 - 1,
        exporter_start_time=2**64 - 1,
        exporter_uid=0,
        device_ordinal=0,
        num_slots=MAX_SLOTS,
        slot_nbytes=MAX_SLOT_NBYTES,
        alloc_nbytes=MAX_SLOT_NBYTES,
        fds=tuple(range(MAX_SLOTS)),
        socket_path=None,
    )
    assert PoolDescriptor.from_bytes(desc.to_bytes()) == desc


def test_descriptor_normalises_list_of_fds_and_is_hashable() -> None:
    desc = make_desc(fds=[7, 8, 9])
    assert desc.fds == (7, 8, 9)
    assert hash(desc) == hash(make_desc())
    assert "_local" not in repr(desc)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"pool_id": b"short"}, "pool_id"),
        ({"pool_id": "x" * 16}, "pool_id"),
        ({"device_uuid": b"\x00" * 17}, "device_uuid"),
        ({"exporter_pid": 0}, "exporter_pid"),
        ({"exporter_pid": -1}, "exporter_pid"),
        ({"exporter_pid": True}, "bool"),
        ({"exporter_pid": 12.0}, "integer"),
        ({"exporter_start_time": -1}, "exporter_start_time"),
        ({"exporter_uid": -1}, "exporter_uid"),
        ({"device_ordinal": -1}, "device_ordinal"),
        ({"num_slots": 0, "fds": ()}, "num_slots"),
        ({"num_slots": MAX_SLOTS + 1}, "num_slots"),
        ({"slot_nbytes": 0}, "slot_nbytes"),
        ({"slot_nbytes": 10, "alloc_nbytes": 9}, "smaller than slot_nbytes"),
        ({"slot_nbytes": MAX_SLOT_NBYTES + 1, "alloc_nbytes": MAX_SLOT_NBYTES + 1}, "nbytes"),
        ({"fds": (1, 2)}, "one per slot"),
        ({"fds": (1, 2, -3)}, r"fds\[2\]"),
        ({"fds": (1, 2, "3")}, "integer"),
        ({"fds": "123"}, "fds"),
        ({"socket_path": ""}, "empty"),
        ({"socket_path": "/tmp/a\x00b"}, "NUL"),
        ({"socket_path": "/tmp/\udcff"}, "UTF-8"),
        ({"socket_path": "/" + "a" * MAX_SOCKET_PATH}, "limit"),
        ({"socket_path": "/" + "é" * 60}, "limit"),
        ({"socket_path": b"/tmp/x"}, "socket_path"),
    ],
)
def test_descriptor_rejects_bad_fields(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(DescriptorError, match=match):
        make_desc(**overrides)


def test_descriptor_carries_the_exporters_pid_namespace() -> None:
    mine = own_pid_namespace()
    assert mine == os.stat("/proc/self/ns/pid").st_ino > 0
    # by default: this process's namespace when it is the exporter, else unknown (0)
    assert make_desc(exporter_pid=os.getpid()).exporter_pid_namespace == mine
    assert make_desc(exporter_pid=4242).exporter_pid_namespace == 0
    for ns in (0, 1, mine, 2**64 - 1):
        desc = make_desc(exporter_pid_namespace=ns)
        data = desc.to_bytes()
        assert struct.unpack_from("<Q", data, 80)[0] == ns  # the documented offset
        back = PoolDescriptor.from_bytes(data)
        assert back.exporter_pid_namespace == ns and back == desc
    # the namespace is part of the identity
    assert make_desc(exporter_pid_namespace=1) != make_desc(exporter_pid_namespace=2)


@pytest.mark.parametrize("value", [-1, 2**64, True, "5", 5.0, b"5"])
def test_descriptor_rejects_bad_pid_namespace(value: Any) -> None:
    with pytest.raises(DescriptorError, match="exporter_pid_namespace"):
        make_desc(exporter_pid_namespace=value)


# ---------------------------------------------------------------------------
# PoolDescriptor.from_bytes: rejection of malformed input


def _with(data: bytes, offset: int, fmt: str, value: Any) -> bytes:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, offset, value)
    return bytes(buf)


VALID = make_desc().to_bytes()
VALID_NO_PATH = make_desc(socket_path=None).to_bytes()


def test_from_bytes_rejects_bad_magic() -> None:
    with pytest.raises(DescriptorError, match="magic"):
        PoolDescriptor.from_bytes(b"XPCP" + VALID[4:])


def test_from_bytes_rejects_other_version_naming_supported() -> None:
    assert FORMAT_VERSION == 2
    for version in (0, 1, 3, 0xFFFF):
        with pytest.raises(DescriptorError, match=rf"version {version}\b.*supports version 2"):
            PoolDescriptor.from_bytes(_with(VALID, 4, "<H", version))
    with pytest.raises(DescriptorError) as info:
        PoolDescriptor.from_bytes(_with(VALID, 4, "<H", 7))
    assert "version 7" in str(info.value)
    assert f"supports version {FORMAT_VERSION}" in str(info.value)


@pytest.mark.parametrize("data", [VALID, VALID_NO_PATH], ids=["path", "no-path"])
def test_from_bytes_rejects_every_truncation(data: bytes) -> None:
    for n in range(len(data)):
        with pytest.raises(DescriptorError):
            PoolDescriptor.from_bytes(data[:n])


@pytest.mark.parametrize("extra", [b"\x00", b"garbage", b"\x00" * 1000])
def test_from_bytes_rejects_trailing_garbage(extra: bytes) -> None:
    with pytest.raises(DescriptorError, match="trailing"):
        PoolDescriptor.from_bytes(VALID + extra)


def test_from_bytes_rejects_huge_counts_before_reading() -> None:
    # num_slots claims 4 billion slots: rejected from the header, no big read.
    with pytest.raises(DescriptorError, match="num_slots"):
        PoolDescriptor.from_bytes(_with(VALID, 60, "<I", 0xFFFFFFFF))
    with pytest.raises(DescriptorError, match="num_slots"):
        PoolDescriptor.from_bytes(_with(VALID, 60, "<I", 0))
    # A plausible count with too little data behind it.
    with pytest.raises(DescriptorError, match="truncated"):
        PoolDescriptor.from_bytes(_with(VALID, 60, "<I", MAX_SLOTS))
    # Path length over the sun_path limit.
    path_len_at = HEADER_SIZE + 4 * 3
    with pytest.raises(DescriptorError, match="socket path length"):
        PoolDescriptor.from_bytes(_with(VALID, path_len_at, "<H", 0xFFFF))


def test_from_bytes_rejects_invalid_utf8_and_bad_paths() -> None:
    head = VALID_NO_PATH[:-2]
    for raw, match in [
        (b"/tmp/\xff\xfe", "UTF-8"),
        (b"/tmp/\xc3", "UTF-8"),
        (b"/tmp/a\x00b", "NUL"),
        (b"/" + b"a" * MAX_SOCKET_PATH, "limit"),
    ]:
        with pytest.raises(DescriptorError, match=match):
            PoolDescriptor.from_bytes(head + struct.pack("<H", len(raw)) + raw)


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "match"),
    [
        (6, "<B", 2, "kind"),
        (7, "<B", 1, "reserved"),
        (24, "<I", 0, "exporter_pid"),
        (24, "<I", 2**31, "exporter_pid"),
        (28, "<I", 2**32 - 1, "exporter_uid"),
        (56, "<I", 2**31, "device_ordinal"),
        (64, "<Q", 0, "slot_nbytes"),
        (64, "<Q", 2**64 - 1, "slot_nbytes"),
        (72, "<Q", 1, "smaller than slot_nbytes"),
        (72, "<Q", MAX_SLOT_NBYTES + 1, "alloc_nbytes"),
        (HEADER_SIZE, "<I", 2**31, r"fds\[0\]"),
    ],
)
def test_from_bytes_rejects_bad_fields(offset: int, fmt: str, value: int, match: str) -> None:
    with pytest.raises(DescriptorError, match=match):
        PoolDescriptor.from_bytes(_with(VALID, offset, fmt, value))


def test_from_bytes_fd_count_must_match_num_slots() -> None:
    # num_slots says 2 but 3 fds follow: the last fd is read as the path length -> error.
    with pytest.raises(DescriptorError):
        PoolDescriptor.from_bytes(_with(VALID, 60, "<I", 2))
    # num_slots says 4 but only 3 fds follow.
    with pytest.raises(DescriptorError):
        PoolDescriptor.from_bytes(_with(VALID_NO_PATH, 60, "<I", 4))


@pytest.mark.parametrize("data", ["IPCP", None, 42, [1, 2, 3]])
def test_from_bytes_rejects_non_bytes(data: Any) -> None:
    with pytest.raises(DescriptorError):
        PoolDescriptor.from_bytes(data)
    with pytest.raises(DescriptorError):
        ArrayHandle.unpack_from(data)


# ---------------------------------------------------------------------------
# ArrayHandle: construction, geometry, round trips


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_validate_dtype_whitelist(name: str) -> None:
    dt = validate_dtype(name)
    assert dt == numpy.dtype(name)
    assert validate_dtype(numpy.dtype(name)) is dt


@pytest.mark.parametrize(
    "obj",
    [
        None,
        object,
        "O",
        "U4",
        "S4",
        "V8",
        "M8[ns]",
        "m8[s]",
        ">i4",
        ">f8",
        "(2,)i4",
        [("a", "i4"), ("b", "f4")],
        "float128" if hasattr(numpy, "float128") else "clongdouble",
        "not-a-dtype",
        12.5,
    ],
)
def test_validate_dtype_rejects(obj: Any) -> None:
    with pytest.raises(DescriptorError):
        validate_dtype(obj)


def test_handle_cases_round_trip_and_fit() -> None:
    base = numpy.arange(6 * 8 * 2, dtype=numpy.float32).reshape(6, 8, 2)
    views = {
        "c": base,
        "f": base.T,  # Fortran-contiguous view of the same memory
        "sliced": base[1:5:2, 2:7:3],
        "negative": base[::-1, ::-2, 1],
        "zero-size": base[3:3],
        "zero-size-tail": base[:, 8:],
        "scalar": base[2, 3, 1:2].reshape(()),  # a 0-d view
        "broadcast": numpy.broadcast_to(base[0, 0], (4, 2)),
        "transposed": base.transpose(2, 0, 1),
    }
    assert handle_of(views["f"], base) == ArrayHandle.contiguous(0, 0, (2, 8, 6), "f4", order="F")
    assert handle_of(base, base) == ArrayHandle.contiguous(0, 0, (6, 8, 2), "f4")
    assert views["scalar"].ndim == 0 and views["scalar"].base is not None
    for name, view in views.items():
        handle = handle_of(view, base, slot=5, gen=2**64 - 1)
        handle.check_fits(base.nbytes)
        packed = handle.pack()
        assert len(packed) == 22 + 16 * handle.ndim
        assert ArrayHandle.from_bytes(packed) == handle, name
        assert handle.to_bytes() == packed
        numpy.testing.assert_array_equal(rebuild(handle, base), view, err_msg=name)
        if view.size:
            lo, hi = numpy.lib.array_utils.byte_bounds(view)
            start = base.__array_interface__["data"][0]
            assert handle.extent() == (lo - start, hi - start), name


def test_contiguous_matches_numpy() -> None:
    for shape in [(), (0,), (5,), (3, 4), (2, 0, 3), (2, 3, 4, 1)]:
        for order in ("C", "F"):
            for dt in ("int8", "float64", "complex128"):
                ref = numpy.empty(shape, dtype=dt, order=order)
                h = ArrayHandle.contiguous(1, 0, shape, dt, offset=64, order=order)
                if ref.size:
                    assert h.strides == ref.strides, (shape, order, dt)
                assert h.extent() == ((64, 64 + ref.nbytes) if ref.size else (64, 64))
                assert h.nbytes == ref.nbytes and h.size == ref.size and h.ndim == ref.ndim
    with pytest.raises(DescriptorError, match="order"):
        ArrayHandle.contiguous(0, 0, (2,), "f4", order="K")  # type: ignore[arg-type]


def test_extent_zero_size_and_scalar() -> None:
    assert ArrayHandle(0, 0, 40, (0, 7), (-8, 1000), "int8").extent() == (40, 40)
    assert ArrayHandle(0, 0, 40, (), (), "float64").extent() == (40, 48)
    h = ArrayHandle(0, 0, 40, (3,), (-8,), "float64")
    assert h.extent() == (24, 48)
    h.check_fits(48)
    with pytest.raises(DescriptorError, match="do not fit"):
        h.check_fits(47)
    with pytest.raises(DescriptorError, match="do not fit"):
        ArrayHandle(0, 0, 8, (3,), (-8,), "float64").check_fits(100)
    # A zero-size array at the very end of a slot fits; one past the end does not.
    ArrayHandle(0, 0, 48, (0,), (8,), "float64").check_fits(48)
    with pytest.raises(DescriptorError):
        ArrayHandle(0, 0, 56, (0,), (8,), "float64").check_fits(48)


def test_check_fits_alignment() -> None:
    with pytest.raises(DescriptorError, match="multiple of the item size"):
        ArrayHandle(0, 0, 2, (2,), (4,), "float32").check_fits(100)
    with pytest.raises(DescriptorError, match="multiple of the item size"):
        ArrayHandle(0, 0, 0, (2,), (6,), "float32").check_fits(100)
    # The stride of a length-1 axis is never used, so it need not be aligned.
    ArrayHandle(0, 0, 0, (1, 2), (3, 4), "float32").check_fits(100)


def test_check_generation() -> None:
    h = ArrayHandle(3, 7, 0, (1,), (1,), "uint8")
    h.check_generation(7)
    with pytest.raises(StaleHandleError, match=r"generation 7.*generation 8"):
        h.check_generation(8)
    assert issubclass(StaleHandleError, DescriptorError)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((MAX_SLOTS, 0, 0, (1,), (1,), "u1"), "slot"),
        ((-1, 0, 0, (1,), (1,), "u1"), "slot"),
        ((0, -1, 0, (1,), (1,), "u1"), "generation"),
        ((0, 2**64, 0, (1,), (1,), "u1"), "generation"),
        ((0, 0, -1, (1,), (1,), "u1"), "offset"),
        ((0, 0, 2**64, (1,), (1,), "u1"), "offset"),
        ((0, 0, 0, (-1,), (1,), "u1"), r"shape\[0\]"),
        ((0, 0, 0, (1,), (2**63,), "u1"), r"strides\[0\]"),
        ((0, 0, 0, (1,), (-(2**63) - 1,), "u1"), r"strides\[0\]"),
        ((0, 0, 0, (1, 2), (1,), "u1"), "one per dimension"),
        ((0, 0, 0, (1,) * (MAX_NDIM + 1), (1,) * (MAX_NDIM + 1), "u1"), "limit"),
        ((0, 0, 0, (2**62, 2), (16, 8), "f8"), "too large"),
        ((0, 0, 0, (2**62, 0, 4), (0, 0, 0), "f8"), "too large"),
        ((0, 0, 0, (1,), (1,), "O"), "dtype"),
        ((0, 0, 0, 5, (1,), "u1"), "shape"),
        ((0, 0, 0, (1.0,), (1,), "u1"), "integer"),
    ],
)
def test_handle_rejects_bad_fields(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(DescriptorError, match=match):
        ArrayHandle(*args)


def test_handle_accepts_numpy_integers() -> None:
    h = ArrayHandle(numpy.int64(1), numpy.uint64(2), numpy.int32(8), [numpy.int64(3)], [8], "f8")
    assert type(h.slot) is int and h.shape == (3,) and type(h.shape[0]) is int
    assert h == ArrayHandle(1, 2, 8, (3,), (8,), numpy.float64)


def test_unpack_from_positions_and_rejections() -> None:
    a = ArrayHandle.contiguous(1, 2, (3, 4), "f4")
    b = ArrayHandle(2, 3, 8, (), (), "c16")
    buf = b"xx" + a.pack() + b.pack()
    h1, pos = ArrayHandle.unpack_from(buf, 2)
    h2, end = ArrayHandle.unpack_from(memoryview(buf), pos)
    assert (h1, h2, end) == (a, b, len(buf))
    packed = a.pack()
    for n in range(len(packed)):
        with pytest.raises(DescriptorError):
            ArrayHandle.unpack_from(packed[:n])
    with pytest.raises(DescriptorError, match="trailing"):
        ArrayHandle.from_bytes(packed + b"\x00")
    for pos in (-1, len(packed) + 1, 1.5, True):
        with pytest.raises(DescriptorError, match="position"):
            ArrayHandle.unpack_from(packed, pos)
    with pytest.raises(DescriptorError, match="ndim"):
        ArrayHandle.from_bytes(_with(packed, 20, "<B", 255))
    with pytest.raises(DescriptorError, match="dtype code"):
        ArrayHandle.from_bytes(_with(packed, 21, "<B", 14))
    with pytest.raises(DescriptorError, match="slot"):
        ArrayHandle.from_bytes(_with(packed, 0, "<I", MAX_SLOTS))
    with pytest.raises(DescriptorError, match=r"shape\[0\]"):
        ArrayHandle.from_bytes(_with(packed, 22, "<Q", 2**63))


def test_decoded_handle_is_canonical() -> None:
    """The decoder's shortcut builds the same object the constructor would."""
    h = ArrayHandle(5, 2**64 - 1, 64, (2, 3, 4), (-96, 32, 8), "f8")
    back = ArrayHandle.from_bytes(bytearray(h.pack()))
    assert back == h and hash(back) == hash(h) and repr(back) == repr(h)
    assert back.dtype is validate_dtype("f8")
    assert {type(v) for v in (back.slot, back.generation, back.offset)} == {int}
    assert type(back.shape) is tuple and type(back.strides) is tuple
    assert all(type(v) is int for v in back.shape + back.strides)
    assert pickle.loads(pickle.dumps(back)) == h


@pytest.mark.parametrize(
    "dtype",
    [numpy.dtype("=f4"), numpy.dtype("<f4"), numpy.dtype("f4", metadata={"k": 1}), "f4"],
)
def test_construction_stores_the_canonical_dtype(dtype: Any) -> None:
    h = ArrayHandle(0, 0, 0, (2,), (4,), dtype)
    assert h.dtype is validate_dtype("float32")
    assert h.pack() == ArrayHandle(0, 0, 0, (2,), (4,), numpy.float32).pack()


def test_check_fits_names_the_first_misaligned_axis() -> None:
    h = ArrayHandle(0, 0, 0, (2, 1, 3, 2), (64, 3, 6, 2), "f4")
    with pytest.raises(DescriptorError, match="stride 6 of axis 2 "):
        h.check_fits(1000)
    with pytest.raises(DescriptorError, match="offset 2 "):  # the offset is checked first
        ArrayHandle(0, 0, 2, (2,), (6,), "f4").check_fits(1000)
    # an empty array touches nothing: its strides need not be aligned
    ArrayHandle(0, 0, 4, (2, 0), (6, 6), "f4").check_fits(4)


def test_unpack_rejections_come_in_field_order() -> None:
    packed = ArrayHandle.contiguous(1, 2, (3, 4), "f8").pack()
    bad_slot = _with(packed, 0, "<I", MAX_SLOTS)
    with pytest.raises(DescriptorError, match="slot"):
        ArrayHandle.from_bytes(_with(bad_slot, 30, "<Q", 2**64 - 1))
    # shape[1] out of range is reported before the (also too large) size
    with pytest.raises(DescriptorError, match=r"shape\[1\]=18446744073709551615"):
        ArrayHandle.from_bytes(_with(_with(packed, 22, "<Q", 2**62), 30, "<Q", 2**64 - 1))
    with pytest.raises(DescriptorError, match="too large"):
        ArrayHandle.from_bytes(_with(_with(packed, 22, "<Q", 2**62), 30, "<Q", 2))
    zero_size = ArrayHandle.from_bytes(_with(_with(packed, 22, "<Q", 0), 30, "<Q", 2**59))
    assert zero_size.shape == (0, 2**59) and zero_size.size == 0


class _CheckedHandle(ArrayHandle):
    """A subclass with its own validation, which decoding must still run."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.slot == 7:
            raise DescriptorError("slot 7 is reserved")


def test_unpack_from_runs_a_subclass_post_init() -> None:
    h = _CheckedHandle.from_bytes(ArrayHandle(1, 0, 0, (), (), "u1").pack())
    assert type(h) is _CheckedHandle
    with pytest.raises(DescriptorError, match="reserved"):
        _CheckedHandle.unpack_from(ArrayHandle(7, 0, 0, (), (), "u1").pack())


# ---------------------------------------------------------------------------
# Hypothesis: untrusted input raises only DescriptorError; valid data round-trips


def _mutate(data: bytes, draw: Any) -> bytes:
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if op in ("flip", "set", "delete") and not buf:
            continue
        if op == "flip":
            i = draw(st.integers(0, len(buf) - 1))
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            i = draw(st.integers(0, len(buf) - 1))
            buf[i] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF]))
        elif op == "insert":
            i = draw(st.integers(0, len(buf)))
            buf[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            i = draw(st.integers(0, len(buf) - 1))
            del buf[i : i + draw(st.integers(1, 8))]
        else:
            del buf[draw(st.integers(0, len(buf))) :]
    return bytes(buf)


def _decode_descriptor_or_error(data: bytes) -> None:
    try:
        desc = PoolDescriptor.from_bytes(data)
    except DescriptorError:
        return
    assert desc.to_bytes() == data  # the encoding is canonical
    assert PoolDescriptor.from_bytes(desc.to_bytes()) == desc


def _decode_handle_or_error(data: bytes, pos: int) -> None:
    try:
        handle, end = ArrayHandle.unpack_from(data, pos)
    except DescriptorError:
        return
    assert pos < end <= len(data)
    assert handle.pack() == data[pos:end]
    assert ArrayHandle.from_bytes(handle.pack()) == handle


@given(st.binary(max_size=200))
def test_fuzz_descriptor_random_bytes(data: bytes) -> None:
    _decode_descriptor_or_error(data)
    _decode_descriptor_or_error(b"IPCP\x01\x00" + data)


@given(st.data())
def test_fuzz_descriptor_mutations(data: st.DataObject) -> None:
    base = data.draw(st.sampled_from([VALID, VALID_NO_PATH]))
    _decode_descriptor_or_error(_mutate(base, data.draw))


@given(st.binary(max_size=200), st.integers(-2, 210))
def test_fuzz_handle_random_bytes(data: bytes, pos: int) -> None:
    _decode_handle_or_error(data, pos)


dtypes = st.sampled_from(ALL_DTYPES).map(numpy.dtype)
shapes = st.one_of(
    st.lists(st.integers(0, 3), max_size=MAX_NDIM),
    st.lists(st.integers(0, 2**40), max_size=2),
)


@st.composite
def handles(draw: Any) -> ArrayHandle:
    shape = draw(shapes)
    strides = draw(
        st.lists(st.integers(-(2**63), 2**63 - 1), min_size=len(shape), max_size=len(shape))
    )
    dt = draw(dtypes)
    nbytes = dt.itemsize
    for n in shape:
        nbytes *= max(n, 1)
    assume(nbytes < 2**63)
    return ArrayHandle(
        draw(st.integers(0, MAX_SLOTS - 1)),
        draw(st.integers(0, 2**64 - 1)),
        draw(st.integers(0, 2**64 - 1)),
        tuple(shape),
        tuple(strides),
        dt,
    )


@given(handles())
def test_handles_round_trip(handle: ArrayHandle) -> None:
    packed = handle.pack()
    assert ArrayHandle.from_bytes(packed) == handle
    assert ArrayHandle.unpack_from(b"\x00" * 3 + packed + b"\xff", 3) == (handle, 3 + len(packed))


@given(handles(), st.data())
def test_fuzz_handle_mutations(handle: ArrayHandle, data: st.DataObject) -> None:
    _decode_handle_or_error(_mutate(handle.pack(), data.draw), 0)


@st.composite
def small_geometries(draw: Any) -> tuple[ArrayHandle, int]:
    dt = draw(dtypes)
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=4)))
    aligned = draw(st.booleans())
    unit = dt.itemsize if aligned else 1
    strides = tuple(draw(st.integers(-12, 12)) * unit for _ in shape)
    offset = draw(st.integers(0, 160)) * unit
    slot_nbytes = draw(st.integers(1, 400))
    return ArrayHandle(0, 0, offset, shape, strides, dt), slot_nbytes


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(small_geometries())
def test_check_fits_agrees_with_brute_force(geometry: tuple[ArrayHandle, int]) -> None:
    handle, slot_nbytes = geometry
    itemsize = handle.dtype.itemsize
    # Brute force: enumerate every element's byte offset.
    if handle.size == 0:
        expected_extent = (handle.offset, handle.offset)
    else:
        starts = [
            handle.offset + sum(i * s for i, s in zip(index, handle.strides, strict=True))
            for index in itertools.product(*(range(n) for n in handle.shape))
        ]
        expected_extent = (min(starts), max(starts) + itemsize)
    assert handle.extent() == expected_extent
    # numpy as the bounds oracle: ndarray() refuses views that leave the buffer.
    try:
        numpy.ndarray(
            handle.shape,
            dtype=handle.dtype,
            buffer=bytearray(slot_nbytes),
            offset=handle.offset,
            strides=handle.strides,
        )
        numpy_in_bounds = True
    except ValueError:
        numpy_in_bounds = False
    lo, hi = expected_extent
    assert numpy_in_bounds == (lo >= 0 and hi <= slot_nbytes)
    aligned = handle.offset % itemsize == 0 and (
        handle.size == 0
        or all(
            s % itemsize == 0 for n, s in zip(handle.shape, handle.strides, strict=True) if n > 1
        )
    )
    try:
        handle.check_fits(slot_nbytes)
        fits = True
    except DescriptorError:
        fits = False
    assert fits == (numpy_in_bounds and aligned)


# ---------------------------------------------------------------------------
# Pickling through real processes: the descriptor carries its fds


def _report(exc: BaseException) -> tuple[str, str, str]:
    return ("err", type(exc).__name__, str(exc))


def _read_descriptor(desc: PoolDescriptor, nbytes: int) -> tuple[Any, ...]:
    """Child side: take the fds, read each memfd, report what was found."""
    fds = desc.take_local_fds()
    if fds is None:
        return ("ok", None, None, None)
    try:
        contents = [os.pread(fd, nbytes, 0) for fd in fds]
        with mmap.mmap(fds[0], nbytes, prot=mmap.PROT_READ) as m:
            mapped = bytes(m[:nbytes])
        second_take = desc.take_local_fds()
    finally:
        for fd in fds:
            os.close(fd)
    return ("ok", contents, mapped, second_take)


def child_read_arg(desc: PoolDescriptor, nbytes: int, out_q: Any) -> None:
    try:
        out_q.put(_read_descriptor(desc, nbytes))
    except BaseException as exc:
        out_q.put(_report(exc))


def child_read_queue(in_q: Any, out_q: Any, nbytes: int) -> None:
    try:
        desc = in_q.get(timeout=JOIN_TIMEOUT)
        out_q.put(_read_descriptor(desc, nbytes))
    except BaseException as exc:
        out_q.put(_report(exc))


def child_echo(in_q: Any, out_q: Any) -> None:
    """Receive a descriptor and send it back without taking its fds."""
    try:
        desc = in_q.get(timeout=JOIN_TIMEOUT)
        out_q.put(("desc", desc))
        in_q.get(timeout=JOIN_TIMEOUT)  # stay alive until the parent has the fds
    except BaseException as exc:
        out_q.put(_report(exc))


def child_count_fds(in_q: Any, out_q: Any) -> None:
    """Receive a descriptor, drop it untaken, report how many fds that closed."""
    try:
        desc = in_q.get(timeout=JOIN_TIMEOUT)
        before = _fds.fd_count()
        del desc
        gc.collect()
        after = _fds.fd_count()
        out_q.put(("ok", before - after))
    except BaseException as exc:
        out_q.put(_report(exc))


NBYTES = 4096


@pytest.fixture
def memfds() -> Iterator[list[tuple[int, bytes]]]:
    """Three memfds of NBYTES bytes with distinct known content."""
    made: list[tuple[int, bytes]] = []
    try:
        for i in range(3):
            fd = os.memfd_create(f"cupy-ipcpool-test-{i}")
            content = bytes((i * 37 + k) % 251 for k in range(NBYTES))
            os.write(fd, content)
            made.append((fd, content))
        yield made
    finally:
        for fd, _ in made:
            os.close(fd)


def exporter_desc(memfds: list[tuple[int, bytes]]) -> PoolDescriptor:
    return make_desc(
        exporter_pid=os.getpid(),
        num_slots=len(memfds),
        fds=tuple(fd for fd, _ in memfds),
        socket_path=None,
    )


def _get(q: Any) -> Any:
    result = q.get(timeout=JOIN_TIMEOUT)
    if result[0] == "err":
        pytest.fail(f"child raised {result[1]}: {result[2]}")
    return result


def _finish(proc: Any) -> None:
    proc.join(JOIN_TIMEOUT)
    if proc.is_alive():
        proc.kill()
        proc.join(JOIN_TIMEOUT)
        pytest.fail("child did not exit in time")
    assert proc.exitcode == 0


@contextlib.contextmanager
def _queue_child(target: Any, *args: Any, method: str = "spawn") -> Iterator[tuple[Any, Any]]:
    """Start ``target(in_q, out_q, *args)``; yield ``(in_q, out_q)``; then the child must exit 0."""
    ctx = multiprocessing.get_context(method)
    in_q, out_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=target, args=(in_q, out_q, *args))
    proc.start()
    try:
        yield in_q, out_q
    finally:
        _finish(proc)
        for q in (in_q, out_q):
            q.close()
            q.join_thread()


def _check_read(result: tuple[Any, ...], memfds: list[tuple[int, bytes]]) -> None:
    _, contents, mapped, second_take = result
    assert contents is not None, "the child received no fds"
    assert contents == [content for _, content in memfds]
    assert mapped == memfds[0][1]
    assert second_take is None


@pytest.mark.timeout(60)
def test_pickle_as_spawn_process_argument(memfds: list[tuple[int, bytes]]) -> None:
    ctx = multiprocessing.get_context("spawn")
    out_q = ctx.Queue()
    proc = ctx.Process(target=child_read_arg, args=(exporter_desc(memfds), NBYTES, out_q))
    proc.start()
    try:
        _check_read(_get(out_q), memfds)
    finally:
        _finish(proc)
        out_q.close()
        out_q.join_thread()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_pickle_through_queue(method: str, memfds: list[tuple[int, bytes]]) -> None:
    with _queue_child(child_read_queue, NBYTES, method=method) as (in_q, out_q):
        in_q.put(exporter_desc(memfds))
        _check_read(_get(out_q), memfds)


@pytest.mark.timeout(60)
def test_unpickled_descriptor_forwards_its_local_fds(memfds: list[tuple[int, bytes]]) -> None:
    """A non-exporter that holds untaken fds passes them on when it re-pickles."""
    with _queue_child(child_echo) as (in_q, out_q):
        desc = exporter_desc(memfds)
        in_q.put(desc)
        _, back = _get(out_q)
        assert back == desc
        fds = back.take_local_fds()
        assert fds is not None and len(fds) == len(memfds)
        try:
            exported = {fd for fd, _ in memfds}
            assert not exported & set(fds)  # fresh fds, not the exporter's own
            assert [os.pread(fd, NBYTES, 0) for fd in fds] == [c for _, c in memfds]
        finally:
            for fd in fds:
                os.close(fd)
        in_q.put("done")


@pytest.mark.timeout(60)
def test_untaken_fds_closed_in_child(memfds: list[tuple[int, bytes]]) -> None:
    with _queue_child(child_count_fds) as (in_q, out_q):
        in_q.put(exporter_desc(memfds))
        assert _get(out_q) == ("ok", len(memfds))


def test_same_pid_in_another_pid_namespace_is_not_the_exporter(
    memfds: list[tuple[int, bytes]], fd_count: Any
) -> None:
    """A process whose pid equals the exporter's in another namespace sends no fds of its own.

    Two containers both have a pid 1, say: the descriptor's fd numbers are the
    exporter's, and this process's fds of those numbers are something else.
    """
    from multiprocessing.reduction import ForkingPickler

    fds = tuple(fd for fd, _ in memfds)
    mine = own_pid_namespace()
    foreign = make_desc(
        exporter_pid=os.getpid(), exporter_pid_namespace=mine + 1, num_slots=3, fds=fds
    )
    gc.collect()
    before = fd_count()
    back = pickle.loads(ForkingPickler.dumps(foreign))
    assert back == foreign and back.take_local_fds() is None
    assert fd_count() == before
    # the control: the same descriptor in this process's namespace carries the fds
    ours = make_desc(exporter_pid=os.getpid(), exporter_pid_namespace=mine, num_slots=3, fds=fds)
    got = pickle.loads(ForkingPickler.dumps(ours)).take_local_fds()
    assert got is not None
    try:
        assert [os.pread(fd, NBYTES, 0) for fd in got] == [c for _, c in memfds]
    finally:
        for fd in got:
            os.close(fd)


def test_pickle_without_owned_fds_carries_none() -> None:
    desc = make_desc()  # exporter_pid is not us, and no local fds
    func, (data, carriers) = desc.__reduce__()
    assert carriers is None
    back = pickle.loads(pickle.dumps(desc))
    assert back == desc and back.take_local_fds() is None
    assert func(data, carriers) == desc


# ---------------------------------------------------------------------------
# fd hygiene in this process


class _DupCarrier:
    """A stand-in for multiprocessing's DupFd: hands over a dup of an fd."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def detach(self) -> int:
        return os.dup(self.fd)


def test_untaken_local_fds_closed_on_gc(memfds: list[tuple[int, bytes]], fd_count: Any) -> None:
    desc = exporter_desc(memfds)
    carriers = tuple(_DupCarrier(fd) for fd, _ in memfds)
    gc.collect()
    before = fd_count()
    rebuilt = _rebuild_descriptor(desc.to_bytes(), carriers)
    assert rebuilt == desc
    assert fd_count() == before + len(memfds)
    del rebuilt
    gc.collect()
    assert fd_count() == before


def test_take_local_fds_once(memfds: list[tuple[int, bytes]], fd_count: Any) -> None:
    desc = exporter_desc(memfds)
    before = fd_count()
    rebuilt = _rebuild_descriptor(desc.to_bytes(), tuple(_DupCarrier(fd) for fd, _ in memfds))
    fds = rebuilt.take_local_fds()
    assert fds is not None and len(fds) == len(memfds)
    assert rebuilt.take_local_fds() is None
    del rebuilt
    gc.collect()
    assert fd_count() == before + len(memfds)  # taken fds belong to the caller now
    assert [os.pread(fd, NBYTES, 0) for fd in fds] == [c for _, c in memfds]
    for fd in fds:
        os.close(fd)
    assert fd_count() == before


def test_rebuild_closes_fds_on_bad_data(memfds: list[tuple[int, bytes]], fd_count: Any) -> None:
    desc = exporter_desc(memfds)
    before = fd_count()
    carriers = tuple(_DupCarrier(fd) for fd, _ in memfds)
    with pytest.raises(DescriptorError):
        _rebuild_descriptor(desc.to_bytes()[:-1], carriers)
    with pytest.raises(DescriptorError, match="carries 2 fds for 3 slots"):
        _rebuild_descriptor(desc.to_bytes(), carriers[:2])
    assert fd_count() == before


# ---------------------------------------------------------------------------
# _rebuild_descriptor: what unpickling a hostile descriptor runs


class _Fixed:
    """A carrier whose detach() returns a fixed value."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def detach(self) -> Any:
        return self.value


class _Raising:
    """A carrier whose detach() raises."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def detach(self) -> int:
        raise self.exc


class _BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


class _NoDetach:
    def __getattr__(self, name: str) -> Any:
        raise AttributeError(name)


class _TupleSubclass(tuple):  # type: ignore[type-arg]
    pass


class _ClosedFd:
    """A carrier whose detach() returns an fd number that is not open."""

    def detach(self) -> int:
        used = {int(n) for n in os.listdir("/proc/self/fd")}
        return next(n for n in range(900, 1000) if n not in used)


#: Hostile carriers, each standing for one of the three slots (the others are honest).
HOSTILE_CARRIERS: dict[str, Any] = {
    "no-detach-object": object(),
    "no-detach-int": 5,
    "no-detach-str": "7",
    "no-detach-none": None,
    "getattr-raises": _NoDetach(),
    "detach-not-callable": type("C", (), {"detach": 3})(),
    "detach-returns-str": _Fixed("3"),
    "detach-returns-bytes": _Fixed(b"3"),
    "detach-returns-none": _Fixed(None),
    "detach-returns-float": _Fixed(3.0),
    "detach-returns-bool": _Fixed(True),
    "detach-returns-negative": _Fixed(-1),
    "detach-returns-huge": _Fixed(2**64),
    "detach-returns-2**31": _Fixed(2**31),
    "detach-returns-numpy-int": _Fixed(numpy.int64(3)),
    "detach-returns-closed-fd": _ClosedFd(),
    "detach-raises-oserror": _Raising(OSError(9, "Bad file descriptor")),
    "detach-raises-valueerror": _Raising(ValueError("nope")),
    "detach-raises-attributeerror": _Raising(AttributeError("detach")),
    "detach-raises-unprintable": _Raising(_BadStr()),
    "detach-raises-connection": _Raising(ConnectionRefusedError(111, "refused")),
}


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """What exists before the test is left out of ``gc.collect()`` while it runs
    (``gc.freeze``): a collection per example then scans only what the example made,
    not the whole test session's heap."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.fixture
def unraisable(frozen_heap: None) -> Iterator[list[Any]]:
    """What reaches ``sys.unraisablehook`` (a finalizer's "Exception ignored") meanwhile.

    Its tests collect garbage before and after each call they check: with the heap as it
    was frozen (``frozen_heap``), a collection scans only what the test made."""
    import sys

    seen: list[Any] = []
    old = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        yield seen
    finally:
        gc.collect()
        sys.unraisablehook = old


def _honest(memfds: list[tuple[int, bytes]]) -> list[Any]:
    return [_DupCarrier(fd) for fd, _ in memfds]


def _expect_refused(data: Any, carriers: Any, fd_count: Any, unraisable: list[Any]) -> None:
    gc.collect()
    before = fd_count()
    with pytest.raises(DescriptorError):
        _rebuild_descriptor(data, carriers)
    gc.collect()
    assert fd_count() == before, "the fds that arrived were not all closed"
    assert unraisable == []


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(HOSTILE_CARRIERS))
def test_rebuild_refuses_every_hostile_carrier(
    name: str,
    position: int,
    memfds: list[tuple[int, bytes]],
    fd_count: Any,
    unraisable: list[Any],
    capfd: Any,
) -> None:
    carriers = _honest(memfds)
    carriers[position] = HOSTILE_CARRIERS[name]
    _expect_refused(exporter_desc(memfds).to_bytes(), tuple(carriers), fd_count, unraisable)
    out, err = capfd.readouterr()
    assert out == err == ""  # nothing printed ("Exception ignored ...")


@pytest.mark.parametrize(
    "shape",
    [
        "list",
        "tuple-subclass",
        "dict",
        "generator",
        "str",
        "int",
        "too-few",
        "too-many",
        "empty",
        "same-fd-twice",
        "way-too-many",
    ],
)
def test_rebuild_refuses_malformed_carrier_tuples(
    shape: str, memfds: list[tuple[int, bytes]], fd_count: Any, unraisable: list[Any]
) -> None:
    data = exporter_desc(memfds).to_bytes()
    honest = _honest(memfds)
    carriers: Any = {
        "list": honest,
        "tuple-subclass": _TupleSubclass(honest),
        "dict": dict(enumerate(honest)),
        "generator": (c for c in honest),
        "str": "abc",
        "int": 3,
        "too-few": tuple(honest[:2]),
        "too-many": (*honest, _DupCarrier(memfds[0][0])),
        "empty": (),
        "same-fd-twice": (honest[0], _Fixed(None), honest[2]),
        "way-too-many": (_Fixed(0),) * (MAX_SLOTS + 1),
    }[shape]
    if shape == "same-fd-twice":
        first = os.dup(memfds[0][0])
        carriers = (_Fixed(first), _Fixed(first), honest[2])
        # the one fd that arrived (twice) is closed once, with the honest one
        gc.collect()
        before = fd_count() - 1  # ``first`` counts as arrived
        with pytest.raises(DescriptorError, match="again"):
            _rebuild_descriptor(data, carriers)
        assert fd_count() == before and unraisable == []
        with pytest.raises(OSError):
            os.fstat(first)
        return
    _expect_refused(data, carriers, fd_count, unraisable)


@pytest.mark.parametrize("data", [b"", b"IPCP", None, "IPCP", 42, VALID])
def test_rebuild_closes_honest_fds_when_the_data_is_bad(
    data: Any, memfds: list[tuple[int, bytes]], fd_count: Any, unraisable: list[Any]
) -> None:
    # VALID describes 3 slots with other geometry: still 3 fds, so it must pass
    carriers = tuple(_honest(memfds))
    if data is VALID:
        gc.collect()
        before = fd_count()
        desc = _rebuild_descriptor(data, carriers)
        assert fd_count() == before + 3
        del desc
        gc.collect()
        assert fd_count() == before and unraisable == []
        return
    _expect_refused(data, carriers, fd_count, unraisable)


def test_rebuild_lets_keyboard_interrupt_through_and_closes(
    memfds: list[tuple[int, bytes]], fd_count: Any, unraisable: list[Any]
) -> None:
    carriers = (*_honest(memfds)[:2], _Raising(KeyboardInterrupt()))
    before = fd_count()
    with pytest.raises(KeyboardInterrupt):
        _rebuild_descriptor(exporter_desc(memfds).to_bytes(), carriers)
    assert fd_count() == before and unraisable == []


_carrier_kind = st.sampled_from(["honest", *sorted(HOSTILE_CARRIERS)])


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(kinds=st.lists(_carrier_kind, min_size=0, max_size=5), as_tuple=st.booleans())
def test_rebuild_any_mix_of_carriers_either_succeeds_exactly_or_refuses_cleanly(
    kinds: list[str],
    as_tuple: bool,
    memfds: list[tuple[int, bytes]],
    fd_count: Any,
    unraisable: list[Any],
    frozen_heap: None,
) -> None:
    data = exporter_desc(memfds).to_bytes()
    carriers = [
        _DupCarrier(memfds[i % 3][0]) if k == "honest" else HOSTILE_CARRIERS[k]
        for i, k in enumerate(kinds)
    ]
    ok = as_tuple and kinds == ["honest"] * 3
    gc.collect()
    before = fd_count()
    try:
        desc = _rebuild_descriptor(data, tuple(carriers) if as_tuple else carriers)
    except DescriptorError:
        assert not ok
    else:
        assert ok
        fds = desc.take_local_fds()
        assert fds is not None
        assert [os.pread(fd, NBYTES, 0) for fd in fds] == [c for _, c in memfds]
        for fd in fds:
            os.close(fd)
        del desc
    gc.collect()
    assert fd_count() == before
    assert unraisable == []
