"""How fast is each CPU of this machine at plain Python?  (Are some cores slower than others?)

The round trip moves between two levels about 1.5x apart from run to run, and
within a slow run every host step is slower, the user's kernel launch and pure
Python alike (docs/performance.md, section 6).  A uniform slowdown of the
whole process points at the core it runs on: on a virtual machine a vCPU may
share a physical core with a busy neighbour, or run at another clock.

For each CPU this process may use, pin to it and time a fixed pure-Python
workload (best of a few repetitions, so a single interruption does not count),
in several rounds, and print the table and the SMT siblings the guest sees::

    python3 scripts/vcpu_speed.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def workload() -> int:
    """A fixed amount of interpreter work (loops, calls, dict and tuple traffic)."""
    d: dict[int, tuple[int, int]] = {}
    total = 0
    for i in range(20_000):
        d[i & 255] = (i, i * 3)
        total += d[i & 255][1] - i
    return total


def time_on(cpu: int, reps: int) -> tuple[float, float]:
    """Best time of ``workload`` on ``cpu`` in microseconds, and the share of the
    time that the hypervisor's steal counter says the CPU did not run us."""
    os.sched_setaffinity(0, {cpu})
    best = float("inf")
    s0, w0 = steal_ticks().get(cpu, 0), time.perf_counter_ns()
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        workload()
        best = min(best, (time.perf_counter_ns() - t0) / 1e3)
    wall = (time.perf_counter_ns() - w0) / 1e9
    stolen = (steal_ticks().get(cpu, 0) - s0) / os.sysconf("SC_CLK_TCK")
    return best, stolen / wall if wall > 0 else 0.0


def siblings(cpu: int) -> str:
    path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return "?"


def steal_ticks() -> dict[int, int]:
    """Per-CPU steal time from ``/proc/stat`` (clock ticks the hypervisor ran something else)."""
    out = {}
    with open("/proc/stat") as fh:
        for line in fh:
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu" and len(fields) >= 8:
                out[int(name[3:])] = int(fields[7])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    results: dict[int, list[float]] = {c: [] for c in cpus}
    steal: dict[int, list[float]] = {c: [] for c in cpus}
    for _ in range(args.rounds):
        for cpu in cpus:
            best, stolen = time_on(cpu, args.reps)
            results[cpu].append(best)
            steal[cpu].append(stolen)
    os.sched_setaffinity(0, set(cpus))
    fastest = min(min(v) for v in results.values())
    print("cpu  siblings  best-of-reps per round (us)  median/fastest  steal % per round")
    for cpu in cpus:
        runs = results[cpu]
        cells = " ".join(f"{t:8.1f}" for t in runs)
        stolen_pct = " ".join(f"{100 * f:4.0f}" for f in steal[cpu])
        ratio = statistics.median(runs) / fastest
        print(f"{cpu:3d}  {siblings(cpu):8s}  {cells}   {ratio:5.2f}  {stolen_pct}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
