"""The channel's session layer (no GPU) of two versions, alternating on one machine.

Usage::

    python3 scripts/ab_session.py OLD_ROOT NEW_ROOT [--rounds 10] [--frames 5000]

What a round measures: a :class:`PublisherCore` and a :class:`SubscriberCore`
(the socket layer under the GPU channel) in two processes, pinned to CPUs 2
and 4, one frame in flight: the publisher publishes and waits for the
release; the subscriber receives, makes its release's memory operation
(libc's ``fflush(NULL)`` stands in for the driver's ``cuStreamWriteValue32``:
a C function called through the same pointer path, returning 0) and
releases.  p50 of the round trip, timed on the publisher.  A source tree with
``SubscriberCore.release_with_write`` uses it (and ``recv_view``); an older
one makes the same steps the older GPU subscriber made (``recv``,
``connected``, the memory operation, ``release``).  Rounds alternate A B, B A
(ABBA).  This separates what the compiled socket calls
(``cupy_ipcpool/channel/_frameio.c``) change from the GPU's share of a round
trip (docs/performance.md, section 7).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_hot_path import alternate, compare

_ROUND = r"""
import ctypes, multiprocessing as mp, os, statistics, sys, tempfile, time

def consumer(addr, frames):
    os.sched_setaffinity(0, {CONSUMER_CPU})
    from cupy_ipcpool.channel._session import SubscriberCore
    fn = ctypes.cast(ctypes.CDLL(None).fflush, ctypes.c_void_p).value
    sub = SubscriberCore(addr, mode="block", credit=4)
    new = hasattr(sub, "release_with_write")
    if not new:
        from cupy_ipcpool._fastpath import memop
    for _ in range(frames):
        if new:
            seq, slot, _payload = sub.recv_view(10.0)
            sub.release_with_write(seq, slot, fn, 0, 0, 1, 0)
        else:
            f = sub.recv(10.0)
            if sub.connected():
                memop(fn, 0, 0, 1, 0)
            sub.release(f.seq, f.slot)
    sub.close()

if __name__ == "__main__":
    os.sched_setaffinity(0, {PRODUCER_CPU})
    from cupy_ipcpool.channel._session import PublisherCore
    addr = os.path.join(tempfile.mkdtemp(), "s")
    pub = PublisherCore(addr, 8, welcome=lambda info: (b"", []))
    p = mp.get_context("spawn").Process(target=consumer, args=(addr, FRAMES))
    p.start()
    while not pub.subscribers:
        pub.poll(0.05)
    payload = bytes(120)  # about a one-array FRAME's payload
    rts = []
    for i in range(FRAMES):
        t0 = time.perf_counter_ns()
        pub.publish(i % 8, payload)
        while not pub.poll(10.0):
            pass
        rts.append(time.perf_counter_ns() - t0)
    p.join()
    pub.close()
    print(statistics.median(rts[FRAMES // 10:]) / 1000)
"""


def one_round(root: str, frames: int, cpus: tuple[int, int]) -> float:
    code = (
        _ROUND.replace("FRAMES", str(frames))
        .replace("{CONSUMER_CPU}", f"{{{cpus[1]}}}")
        .replace("{PRODUCER_CPU}", f"{{{cpus[0]}}}")
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "round.py")
        with open(path, "w") as f:
            f.write(code)
        env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
        out = subprocess.run(
            [sys.executable, path], env=env, capture_output=True, text=True, timeout=300
        )
    if out.returncode != 0:
        raise RuntimeError(f"round with {root} failed:\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--frames", type=int, default=5000)
    ap.add_argument("--cpus", default="2,4", help="CPUs of the publisher and the subscriber")
    args = ap.parse_args()
    cpus = tuple(int(c) for c in args.cpus.split(","))
    assert len(cpus) == 2, "--cpus takes two CPUs"
    old, new = alternate(
        args.old,
        args.new,
        args.rounds,
        lambda root: one_round(root, args.frames, cpus),  # type: ignore[arg-type]
        "session round trip p50 {:.2f} us",
    )
    print(
        f"== {args.rounds} rounds of {args.frames} frames: session round trip p50 old "
        f"{statistics.median(old):.2f} us, new {statistics.median(new):.2f} us; "
        f"{compare(old, new)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
