"""The compiled per-frame bookkeeping against the Python paths it replaces, hot, on one CPU.

Two pairs, each on identical state in the same process (no GPU, no other
process; CuPy's objects are the stand-ins of ``tests/test_kept_array_cpu``):

* the slot pick: ``SlotTable.take`` + ``release_writer`` of a 4-slot table
  with one lease source, through ``_hotpath.take_slot`` and through the
  Python pick (the same table with the compiled first look switched off);
* the subscriber's assembly of a one-array frame: ``_hotpath.take_frame``
  (with its frame-flag read, the flag already set) and the Python path it
  replaces, ``FRAME_HEAD.unpack_from`` + ``PeerPool.arrays_from_wire``.

These are the calls' *hot* costs.  On the GPU machine, inside the round trip,
each call costs several times more (docs/performance.md, section 9): that
difference, not these figures, is what decides the round trip.

The benchmarks' ``conftest.py`` skips everything on machines without a GPU;
to run this file on a CPU-only machine::

    python3 -m pytest benchmarks/test_bench_hotpath.py --noconftest -o filterwarnings=default
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from cupy_ipcpool import _driver
from cupy_ipcpool._compiled import hotpath
from cupy_ipcpool._handles import ArrayHandle
from cupy_ipcpool._peer import PeerPool, _KeptView
from cupy_ipcpool._slots import SlotTable
from cupy_ipcpool.channel._payload import FRAME_HEAD

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_kept_array_cpu import _CP
from test_per_frame_shortcuts_cpu import _Source

try:  # the shared summary of the benchmark suite, when its conftest is importable
    from conftest import record_value
except ImportError:  # pragma: no cover

    def record_value(name: str, seconds: float) -> None:
        pass


def _record(name: str, benchmark: Any) -> None:
    if benchmark.stats is not None:  # None under --benchmark-disable
        record_value(name, benchmark.stats.stats.median)


def _table(compiled: bool) -> SlotTable:
    table = SlotTable(4)
    table.add_source(_Source([set() for _ in range(4)]))
    if not compiled:
        table._take_slot = lambda *args: None  # the Python pick, every time
    return table


@pytest.mark.parametrize("path", ["compiled", "python"])
def test_slot_pick(benchmark: Any, path: str) -> None:
    table = _table(path == "compiled")

    def take_and_release() -> None:
        slot, _gen = table.take(0)
        table.release_writer(slot)

    benchmark(take_and_release)
    _record(f"slot_pick_{path}", benchmark)


def _peer_state(handle: ArrayHandle) -> PeerPool:
    """A peer pool's per-frame state, without a GPU: what ``arrays_from_wire`` reads."""
    peer = PeerPool.__new__(PeerPool)
    key, _gen, _end = ArrayHandle.peek(handle.pack())
    geometry = (handle.slot, handle.offset, handle.shape, handle.strides, handle.dtype)
    peer._closed = False
    peer._epoch = _driver._fork_epoch
    peer._cp = _CP
    peer._device = 0
    peer._geometry = {key: geometry}
    peer._views = {key: _KeptView(_CP, 0x1000, 1 << 20, 0, key, geometry, None)}
    peer._lent = []
    peer._seen_generation = [0] * 4
    peer._slots = type("Slots", (), {"ptrs": [0x1000] * 4})()
    peer._desc = type("Desc", (), {"slot_nbytes": 1 << 20, "num_slots": 4})()
    return peer


@pytest.mark.parametrize("path", ["compiled", "python"])
def test_frame_assembly(benchmark: Any, path: str) -> None:
    handle = ArrayHandle(1, 5, 0, (256,), (4,), "int32")
    payload = memoryview(FRAME_HEAD.pack(1, 5, 1, 0) + handle.pack())
    peer = _peer_state(handle)
    words = memoryview(bytearray(64)).cast("I")
    words[1] = 5  # the frame flag is set: no wait to enqueue
    ctx = (*peer.wire_state(), words, 0x7000, [0x7000 + 4 * s for s in range(4)], 1, 0)
    take_frame = hotpath().take_frame
    owner = object()

    # as Subscriber.recv: the last frame's owners let go of, then the new frame
    # (which the caller drops before the next call)
    def compiled() -> None:
        peer.drop_idle_owners()
        if take_frame(ctx, payload, 1, owner, 0) is None:
            raise AssertionError("the compiled path declined the steady state")

    def python() -> None:
        peer.drop_idle_owners()
        _flag, _gen, count, _meta = FRAME_HEAD.unpack_from(payload, 0)
        peer.arrays_from_wire(payload, FRAME_HEAD.size, count, owner)

    benchmark(compiled if path == "compiled" else python)
    _record(f"frame_assembly_{path}", benchmark)
