"""Does the CPU's idle state set the round trip's level?  (A GPU-machine experiment.)

The round trip has two levels about 30 µs apart, and at 256 MiB and 1 GiB every
function on the per-frame path, pure Python included, runs 1.4-1.5x slower
(docs/performance.md, section 6).  A uniform slowdown of code that touches no
GPU points at the CPU, not the driver: a core that slept long enough to enter
a deep idle state (or, in a virtual machine, a vCPU that halted and exited to
the hypervisor) wakes late and with cold caches.

This script prints what the machine's idle handling is (cpuidle driver and
states, halt polling, virtualisation), then runs the comparison's
``cupy_ipcpool`` and ``socket_gpu_floor`` lanes at 1 MiB and 1 GiB, and the
channel with ``spin_us``, alternating three conditions:

* ``default``: the machine as it is;
* ``qos0``: ``/dev/cpu_dma_latency`` held at 0 by this process (the kernel's
  PM QoS request: no idle state with an exit latency above 0 µs, so cores
  poll instead of sleeping deeply) -- a machine setting, not the library's;
* the channel's own answer, ``spin_us`` on both sides (busy-poll before blocking).

Run as root on the GPU machine::

    python3 scripts/cpu_idle_experiment.py --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError as exc:
        return f"({exc.strerror})"


def describe() -> str:
    """The machine's idle handling, one fact a line."""
    lines = [
        f"cpuidle driver: {_read('/sys/devices/system/cpu/cpuidle/current_driver')}",
        f"cpuidle governor: {_read('/sys/devices/system/cpu/cpuidle/current_governor')}",
        f"cpufreq governor (cpu0): "
        f"{_read('/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor')}",
        f"haltpoll guest_halt_poll_ns: "
        f"{_read('/sys/module/haltpoll/parameters/guest_halt_poll_ns')}",
        f"cpuidle_haltpoll force: {_read('/sys/module/cpuidle_haltpoll/parameters/force')}",
    ]
    for state in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cpuidle/state*")):
        lines.append(
            f"  cpu0 {os.path.basename(state)}: {_read(state + '/name')} "
            f"latency {_read(state + '/latency')} us, residency {_read(state + '/residency')} us, "
            f"disabled {_read(state + '/disable')}, entered {_read(state + '/usage')} times"
        )
    flags = _read("/proc/cpuinfo")
    lines.append(f"cpuinfo 'hypervisor' flag: {'hypervisor' in flags.split()}")
    model = [ln for ln in flags.splitlines() if ln.startswith("model name")][:1]
    lines.append(
        f"cpu: {model[0].split(':', 1)[1].strip() if model else '?'}; {os.cpu_count()} cpus"
    )
    lines.append(f"dmi product: {_read('/sys/class/dmi/id/product_name')}")
    return "\n".join(lines)


@contextlib.contextmanager
def cpu_latency_qos(us: int | None) -> Iterator[str]:
    """Hold ``/dev/cpu_dma_latency`` at ``us`` while inside (nothing when None)."""
    if us is None:
        yield "default"
        return
    fd = os.open("/dev/cpu_dma_latency", os.O_RDWR)
    try:
        os.write(fd, struct.pack("i", us))
        yield f"qos{us}"
    finally:
        os.close(fd)


def lanes(sizes: str, iters: int) -> dict[tuple[str, int], float]:
    """p50 µs of the channel and the socket+GPU floor lanes (the comparison harness)."""
    out = tempfile.mkdtemp()
    cmd = [
        sys.executable, "-m", "cupy_ipcpool", "bench", "--mode", "short", "--no-scale",
        "--lanes", "cupy_ipcpool,socket_gpu_floor", "--sizes", sizes, "--iters", str(iters),
        "--outdir", out,
    ]  # fmt: skip
    subprocess.run(
        cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=300
    )
    with open(os.path.join(out, "benchmarks.json")) as fh:
        data = json.load(fh)
    return {
        (row["lane"], row["nbytes"] >> 20): row["p50_us"]
        for row in data["measurements"]
        if row.get("p50_us") is not None
    }


def channel_spin(mib: int, spin: float, frames: int) -> str:
    """The channel's round trip with ``spin_us`` on both sides (profile_hot_path's rt loop)."""
    sys.path.insert(0, HERE)
    import profile_hot_path as prof

    r = prof._run("rt", frames, mib, False, spin)
    total = r["producer"]["total"]  # type: ignore[index]
    return f"p50 {total[0]:.1f} us, p99 {total[1]:.1f} us"


def _cell(p50: dict[tuple[str, int], float], mib: int) -> str:
    ours = p50.get(("cupy_ipcpool", mib), float("nan"))
    floor = p50.get(("socket_gpu_floor", mib), float("nan"))
    return f"{mib} MiB: ours {ours:.1f} / floor {floor:.1f} = {ours / floor:.2f}x"


@contextlib.contextmanager
def halt_poll(ns: int) -> Iterator[str]:
    """Set the guest's halt polling (cpuidle-haltpoll) to ``ns`` while inside."""
    path = "/sys/module/haltpoll/parameters/guest_halt_poll_ns"
    old = _read(path)
    with open(path, "w") as fh:
        fh.write(str(ns))
    try:
        yield f"poll{ns // 1000}us"
    finally:
        with open(path, "w") as fh:
            fh.write(old)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--sizes", default="1,1024")
    ap.add_argument("--spin-us", type=float, default=50.0)
    args = ap.parse_args()
    print(describe(), flush=True)
    for r in range(args.rounds):
        conditions = [cpu_latency_qos(None), cpu_latency_qos(0)]
        if os.path.exists("/sys/module/haltpoll/parameters/guest_halt_poll_ns"):
            conditions.append(halt_poll(200_000))
        for condition in conditions:
            with condition as label:
                p50 = lanes(args.sizes, args.iters)
                cells = "  ".join(_cell(p50, int(s)) for s in args.sizes.split(","))
                print(f"round {r} {label:8s} {cells}", flush=True)
        spun = channel_spin(1, args.spin_us, 2000)
        print(
            f"round {r} channel spin_us={args.spin_us:g} (default idle), 1 MiB rt: {spun}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
