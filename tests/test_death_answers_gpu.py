"""GPU tier: after a producer's SIGKILL, ``Frame.complete`` agrees with the GPU, frame by frame.

The case seen on the H200: block mode, 8 slots of 1 MiB, a consumer whose GPU
check is slower than the producer's fill, releasing each frame right after
queuing its check; the producer SIGKILLed after ~1,500 frames.  Both hosts
run ahead of their GPUs, so hundreds of received frames are still unwritten
at the death; the subscriber forces their flags, the consumer's checks run
on old data and say so.  Every frame's ``complete`` (asked after the end,
after release, and again after ``close()``) must be what its check saw, and
``EndOfStream.incomplete`` must be exactly the frames whose check failed.
The CPU version (memfd slots, host "streams") is
``tests/test_death_answers_cpu.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import struct
import time
from typing import Any

import pytest

import cupy_ipcpool as cip
from tests.gpu_helpers import (
    DEATH_CAP,
    DEATH_KILL_AT,
    DEATH_N,
    PipeQueue,
    death_producer,
    slow_check_kernel,
)

pytestmark = [pytest.mark.gpu]

SPAWN = mp.get_context("spawn")
# the death case of gpu_helpers.py: block mode, 8 slots of 1 MiB, a slow check
N, KILL_AT, CAP = DEATH_N, DEATH_KILL_AT, DEATH_CAP
SEED = struct.Struct("<I")


def _expect(conn: Any, timeout: float = 120.0) -> Any:
    assert conn.poll(timeout), f"the producer sent nothing within {timeout} s"
    msg = conn.recv()
    if msg[0] == "error":
        pytest.fail(f"the producer raised {msg[1]}: {msg[2]}\n{msg[3]}")
    return msg


@pytest.mark.timeout(300)
def test_complete_matches_the_gpu_check_of_every_frame_after_a_sigkill(tmp_path: Any) -> None:
    import cupy as cp

    address = str(tmp_path / "chan.sock")
    dev = cp.cuda.Device()
    check, grid, cycles, result = slow_check_kernel(dev)
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=death_producer, args=(address, PipeQueue(child)), daemon=True)
    proc.start()
    child.close()
    assert proc.pid is not None
    pid = proc.pid
    stream = cp.cuda.Stream(non_blocking=True)
    frames: list[cip.Frame] = []
    at_release: dict[int, bool | None] = {}
    sub: cip.Subscriber | None = None
    try:
        assert _expect(parent) == ("ready",)
        sub = cip.Subscriber(address, mode="block")
        killed_at = None
        with stream:
            while True:
                try:
                    frame = sub.recv(timeout=60, stream=stream)
                except cip.EndOfStream as exc:
                    end = exc
                    break
                (seed,) = SEED.unpack(frame.metadata)
                assert frame.seq < CAP
                check(
                    (grid,),
                    (256,),
                    (
                        frame.array,
                        cp.uint64(N),
                        cp.uint32(seed),
                        cp.int64(cycles),
                        result,
                        cp.uint64(frame.seq),
                        cp.uint64(CAP),
                    ),
                )
                frame.release(stream=stream)  # at once: the read flag is written after the check
                at_release[frame.seq] = frame.complete
                frames.append(frame)
                if len(frames) == KILL_AT:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = len(frames)
        assert killed_at == KILL_AT, f"the stream ended after {len(frames)} frames: {end}"
        assert not end.clean, end
        proc.join(30)
        assert not proc.is_alive()
        # every wait of ours ends (the flags the producer never set were forced)
        deadline = time.monotonic() + 60
        while not stream.done:
            assert time.monotonic() < deadline, (
                f"the consumer's stream still waits; pending at the end: {end.pending[:8]}"
            )
            time.sleep(0.01)
        got = cp.asnumpy(result)
        seqs = [f.seq for f in frames]
        assert seqs == list(range(len(frames))), "block mode: every frame, in order"
        ran = [int(got[s]) & 1 for s in seqs]
        assert all(ran), f"{ran.count(0)} checks never ran"
        bad = [s for s in seqs if got[s] & 2]
        good = set(seqs) - set(bad)
        complete = {f.seq: f.complete for f in frames}  # all released already
        assert None not in complete.values(), "a frame left unanswered after the death"
        called_incomplete = [s for s in seqs if complete[s] is False]
        # The one frame the producer's GPU was on when it died may have been filled
        # completely with its flag write not yet run: its data is right, and it is
        # (conservatively) called incomplete.  Any other disagreement is wrong.
        in_flight = called_incomplete[:1]
        # frame by frame: none called complete that was bad, none incomplete that was good
        wrong = [
            (s, complete[s], s in good)
            for s in seqs
            if complete[s] is not (s in good) and s not in in_flight
        ]
        assert not wrong, f"{len(wrong)} frames answered wrongly, e.g. {wrong[:10]}"
        assert all(complete[s] is False for s in bad)
        assert bad, (
            "no frame was unwritten at the death: the hosts did not run ahead of the GPUs, "
            "so this test proves nothing (make the check slower)"
        )
        assert called_incomplete in (bad, in_flight + bad)
        # answered at release: None or True (the producer alive), and True only if good
        assert all(at_release[s] is not False for s in seqs if s < KILL_AT)  # before the kill
        assert all(s in good for s in seqs if at_release[s] is True)
        assert end.pending == (), f"{len(end.pending)} frames not known at the EndOfStream"
        assert list(end.incomplete) == called_incomplete and end.untracked == 0
        assert list(sub.incomplete_frames) == called_incomplete
        # frames written before the death in slots that were forced (the old rule
        # called them incomplete): there are some, and they are complete
        unwritten = set(bad)
        forced = {f.slot for f in frames if f.seq in unwritten}
        assert any(f.seq in good and f.slot in forced for f in frames)
        sub.close()
        assert {f.seq: f.complete for f in frames} == complete  # frozen: the same answers
        assert list(sub.incomplete_frames) == called_incomplete
        print(
            f"{len(frames)} frames received, {len(bad)} unwritten at the death "
            f"(kill at {KILL_AT}), {len(called_incomplete)} called incomplete; "
            f"{sub.forced_flags} flags forced"
        )
    finally:
        if sub is not None:
            sub.close()
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        parent.close()
