"""Round trip of two versions of the library, alternating on one machine (GPU machine).

Usage::

    python3 scripts/ab_hot_path.py OLD_ROOT NEW_ROOT [--rounds 3] [--frames 2000] [--mib 1]

Each root is a source tree (``import cupy_ipcpool`` works with it first on
``sys.path``, its ``_fastpath`` extension built).  The round-trip loop of
``scripts/trace_hot_path.py`` (one frame in flight, raw kernels, no timers
inside the library) runs in a fresh producer/consumer pair per round, the two
versions taking turns (A B B A A B ...), so that both see the same machine in the
same minutes, each process pinned to one CPU (``--cpus``): unpinned, rounds of
one version on the H200 machine fell into two groups ~25 us apart.  Prints
each round's p50 and, last, the median over the rounds.  This is how a
change to the per-frame path is measured (docs/performance.md): two runs on
two machines differ by more than most changes do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))


def one_round(root: str, frames: int, mib: int, cpus: tuple[int, int] | None) -> float:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
    code = (
        f"import sys; sys.path.insert(0, {HERE!r}); import trace_hot_path as t; "
        f"print(t._producer({frames}, {mib}, timed=False, cpus={cpus!r})[2])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    if out.returncode != 0:
        raise RuntimeError(f"round with {root} failed:\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def alternate(
    old: str, new: str, rounds: int, measure: Callable[[str], float], shown: str
) -> tuple[list[float], list[float]]:
    """``measure(root)`` of the two trees, round by round in ABBA order; each printed.

    Returns the old and the new tree's figures, round by round.
    """
    results: dict[str, list[float]] = {"old": [], "new": []}
    pairs = (("old", old), ("new", new))
    for r in range(rounds):
        # A B, then B A: neither version always runs first
        for label, root in pairs if r % 2 == 0 else pairs[::-1]:
            value = measure(root)
            results[label].append(value)
            print(f"round {r + 1} {label}: {shown.format(value)}", flush=True)
    return results["old"], results["new"]


def compare(old: list[float], new: list[float]) -> str:
    """The per-round new/old ratio's median and how often the new tree was faster."""
    ratios = [n / o for o, n in zip(old, new, strict=True)]
    return (
        f"per-round new/old median {statistics.median(ratios):.3f}, new faster in "
        f"{sum(r < 1 for r in ratios)} of {len(ratios)}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--frames", type=int, default=2000)
    ap.add_argument("--mib", type=int, default=1)
    ap.add_argument(
        "--cpus",
        default="2,4",
        help="CPUs for the producer and the consumer, pinned ('none': unpinned; default 2,4)",
    )
    args = ap.parse_args()
    cpus = None if args.cpus == "none" else tuple(int(c) for c in args.cpus.split(","))
    assert cpus is None or len(cpus) == 2, "--cpus takes two CPUs"
    old, new = alternate(
        args.old,
        args.new,
        args.rounds,
        lambda root: one_round(root, args.frames, args.mib, cpus),  # type: ignore[arg-type]
        "round trip p50 {:.1f} us",
    )
    print(
        f"== {args.mib} MiB, {args.rounds} rounds of {args.frames} frames: round trip p50 "
        f"old {statistics.median(old):.1f} us, new {statistics.median(new):.1f} us, "
        f"new/old {statistics.median(new) / statistics.median(old):.3f}; {compare(old, new)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
