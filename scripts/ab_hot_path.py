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
    results: dict[str, list[float]] = {"old": [], "new": []}
    pairs = (("old", args.old), ("new", args.new))
    for r in range(args.rounds):
        # A B, then B A: neither version always runs first (ABBA)
        for label, root in pairs if r % 2 == 0 else pairs[::-1]:
            p50 = one_round(root, args.frames, args.mib, cpus)  # type: ignore[arg-type]
            results[label].append(p50)
            print(f"round {r + 1} {label}: round trip p50 {p50:.1f} us", flush=True)
    old, new = statistics.median(results["old"]), statistics.median(results["new"])
    ratios = [n / o for o, n in zip(results["old"], results["new"], strict=True)]
    print(
        f"== {args.mib} MiB, {args.rounds} rounds of {args.frames} frames: round trip p50 "
        f"old {old:.1f} us, new {new:.1f} us, new/old {new / old:.3f}; per-round new/old "
        f"median {statistics.median(ratios):.3f}, new faster in "
        f"{sum(r < 1 for r in ratios)} of {len(ratios)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
