"""The compiled ``_fastpath`` trampolines: arguments in, result out, bad input refused.

It calls whatever function pointer it is given; on the GPU machine that is
the driver's ``cuStreamWriteValue32`` / ``cuStreamWaitValue32``
(``tests/test_syncpage_gpu.py``).  Here it calls a C-callable made with
``ctypes`` that records its arguments, which checks the conversion and the
calling convention, not the driver.
"""

from __future__ import annotations

import ctypes

import pytest
from _gil import assert_gil_released
from _memop_recorder import MemopRecorder as _Recorder

from cupy_ipcpool._fastpath import memop, wait_all


def test_arguments_reach_the_function_and_its_result_comes_back() -> None:
    rec = _Recorder(result=700)
    assert memop(rec.address, 0x7F00_1234_5678, (1 << 63) + 8, 41, 1) == 700
    assert rec.calls == [(0x7F00_1234_5678, (1 << 63) + 8, 41, 1)]


def test_value_is_taken_modulo_2_32_and_stream_0_is_allowed() -> None:
    rec = _Recorder()
    assert memop(rec.address, 0, 16, (5 << 32) | 3, 0) == 0
    assert memop(rec.address, 0, 16, -1, 0) == 0
    assert rec.calls == [(None, 16, 3, 0), (None, 16, 0xFFFFFFFF, 0)]


def test_other_threads_run_during_the_call() -> None:
    """The GIL is released around the call (the driver may block while a stream's queue is full).

    The function called is libc's ``usleep``, which takes the "stream" as its
    microseconds and never touches Python: a thread that counts meanwhile can
    only make progress if the GIL was let go.
    """
    usleep = ctypes.CDLL(None).usleep
    address = ctypes.cast(usleep, ctypes.c_void_p).value
    # usleep(300 ms)
    assert_gil_released(lambda: memop(address, 300_000, 0, 0, 0), ("nanosleep", "clock_nanosleep"))


FN = "the recorder's address"


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((FN, 2, 3, 4), TypeError),  # too few
        ((FN, 2, 3, 4, 5, 6), TypeError),  # too many
        ((0, 1, 2, 3, 0), ValueError),  # NULL function pointer
        ((None, 1, 2, 3, 0), TypeError),
        ((FN, "s", 2, 3, 0), TypeError),  # stream
        ((FN, 1, -1, 3, 0), OverflowError),  # a negative address
        ((FN, 1, 1 << 64, 3, 0), OverflowError),
        ((FN, 1, 2, "3", 0), TypeError),  # value
        ((FN, 1, 2, 3.0, 0), TypeError),
        ((FN, 1, 2, 3, 1 << 32), OverflowError),  # flags wider than 32 bits
        ((FN, 1, 2, 3, -1), OverflowError),
    ],
)
def test_bad_arguments_raise_and_call_nothing(args: tuple, error: type) -> None:  # type: ignore[type-arg]
    rec = _Recorder()
    args = tuple(rec.address if a is FN else a for a in args)
    with pytest.raises(error):
        memop(*args)
    assert rec.calls == []


# ------------------------------------------------ wait_all: cuStreamBatchMemOp's calling form
class _BatchOp(ctypes.Structure):
    """CUstreamBatchMemOpParams as a 32-bit wait sees it (48 bytes)."""

    _fields_ = [
        ("operation", ctypes.c_uint32),
        ("pad0", ctypes.c_uint32),
        ("address", ctypes.c_uint64),
        ("value", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("pad1", ctypes.c_uint32),
        ("alias", ctypes.c_uint64),
        ("pad2", ctypes.c_uint64),
    ]


_BATCH = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(_BatchOp), ctypes.c_uint
)


class _BatchRecorder:
    """Records (stream, call flags, [(operation, address, 32-bit value, flags, rest)])."""

    def __init__(self, result: int = 0) -> None:
        self.calls: list[tuple[int | None, int, list[tuple[int, ...]]]] = []
        self.result = result
        self.fn = _BATCH(self._call)
        self.address = ctypes.cast(self.fn, ctypes.c_void_p).value or 0

    def _call(self, stream: int | None, count: int, ops: ctypes.Array, flags: int) -> int:  # type: ignore[type-arg]
        got = []
        for i in range(count):
            op = ops[i]
            raw = bytes(memoryview(op).cast("B"))
            value32 = int.from_bytes(raw[16:20], "little")  # the union's 32-bit member
            rest = (op.value >> 32, op.pad0, op.pad1, op.alias, op.pad2)
            got.append((op.operation, op.address, value32, op.flags, rest))
        self.calls.append((stream, flags, got))
        return self.result


def test_wait_all_builds_one_wait_per_address_in_order() -> None:
    rec = _BatchRecorder(result=0)
    addrs = [0x7F00_0000_1000 + 4 * i for i in range(8)]
    assert wait_all(rec.address, 0xABC, addrs, (7 << 32) | 41, 1) == 0
    ((stream, call_flags, ops),) = rec.calls
    assert stream == 0xABC and call_flags == 0  # the batch call's own flags are reserved: 0
    assert ops == [(1, a, 41, 1, (0, 0, 0, 0, 0)) for a in addrs]  # WAIT_VALUE_32 = 1


def test_wait_all_takes_a_tuple_and_returns_the_drivers_result() -> None:
    rec = _BatchRecorder(result=999)
    assert wait_all(rec.address, 0, (16, 32), -1, 0) == 999
    assert rec.calls == [
        (None, 0, [(1, 16, 0xFFFFFFFF, 0, (0,) * 5), (1, 32, 0xFFFFFFFF, 0, (0,) * 5)])
    ]


def test_wait_all_takes_up_to_255_addresses() -> None:
    rec = _BatchRecorder()
    assert wait_all(rec.address, 1, list(range(8, 8 + 4 * 255, 4)), 3, 1) == 0
    assert len(rec.calls[0][2]) == 255


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((FN, 1, [8]), TypeError),  # too few
        ((0, 1, [8], 3, 1), ValueError),  # NULL function pointer
        ((FN, 1, [], 3, 1), ValueError),  # nothing to wait for
        ((FN, 1, list(range(256)), 3, 1), ValueError),  # more than one call takes
        ((FN, 1, iter([8]), 3, 1), TypeError),  # neither tuple nor list
        ((FN, 1, [8, "16"], 3, 1), TypeError),  # an address that is no int
        ((FN, 1, [8, -16], 3, 1), OverflowError),
        ((FN, 1, [8], 3.0, 1), TypeError),  # value
        ((FN, 1, [8], 3, 1 << 32), OverflowError),  # flags wider than 32 bits
    ],
)
def test_wait_all_bad_arguments_raise_and_call_nothing(args: tuple, error: type) -> None:  # type: ignore[type-arg]
    rec = _BatchRecorder()
    args = tuple(rec.address if a is FN else a for a in args)
    with pytest.raises(error):
        wait_all(*args)
    assert rec.calls == []
