"""The ``remote`` benchmark lane: frames through the remote channel vs raw UCXX vs a TCP socket.

Three ways to move the same frames from one process to another on one
machine, each timed in the same run (medians over repeats, ratios against raw
UCXX):

* ``channel``: a producer's channel (host: :class:`HostChannelPublisher`;
  device: :class:`cupy_ipcpool.Publisher`) served by
  :func:`cupy_ipcpool.remote.serve`, received by
  :func:`cupy_ipcpool.remote.subscribe` in a child process;
* ``ucxx``: raw UCXX tag send/recv of buffers of the same size, same worker
  setup, the receiver cycling through the same number of receive buffers;
* ``tcp``: the hand-written alternative: ``sendall`` / ``recv_into`` over a
  TCP socket on 127.0.0.1 (host staging; device frames copied to host first);
* ``ucxx_vmm`` (device memory only): raw UCXX as ``ucxx``, between buffers in
  :class:`~cupy_ipcpool.IpcPool` slots (the VMM memory the channel uses), since
  UCX may move such memory by another transport than ``cupy.ones`` buffers.

Each lane first moves :data:`WARMUP` frames untimed (connections, UCX's
first mappings of each buffer, staging buffers made: costs a stream pays
once), then is timed from the sender's first timed send to the receiver's
last frame (``time.perf_counter``, CLOCK_MONOTONIC, one clock for the
processes of one machine), divided by the frames: the pipeline's fill is
counted, so a lane of few frames (large sizes) is timed on the slow side,
never faster than it runs.

Run ``python -m cupy_ipcpool._bench.remote [--memory device]`` or
``benchmarks/test_bench_remote.py``.  ``UCX_TLS`` decides the transport;
``--tls default --tls tcp,cuda_copy`` runs the lanes with each set in turn,
and ``--json FILE`` writes the figures (as committed under docs/bench).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

MiB = 1 << 20
#: frames each lane moves before its timed frames (the same in every lane)
WARMUP = 8
#: the most timed frames of a lane at one size (small frames: the budget would give more)
MAX_FRAMES = 1000
#: receive slots of the channel lane's subscriber (raw UCXX keeps as many receives posted)
SLOTS = 4
SECRET = "benchmark-secret-not-for-use-0123456789"
CTX = mp.get_context("spawn")


@dataclass
class Result:
    """One lane at one size: seconds per frame (median over repeats)."""

    lane: str
    nbytes: int
    frames: int
    seconds: float

    @property
    def fps(self) -> float:
        return self.frames / self.seconds

    @property
    def gbps(self) -> float:
        return self.nbytes * self.frames / self.seconds / 1e9


def _alloc(memory: str, nbytes: int, device: int) -> Any:
    import numpy as np

    if memory == "host":
        return np.ones(nbytes, np.uint8)
    import cupy as cp

    with cp.cuda.Device(device):
        return cp.ones(nbytes, cp.uint8)


def _vmm_buffers(count: int, nbytes: int, device: int) -> tuple[Any, list[Any]]:
    """``count`` device buffers in the slots of one IpcPool (VMM memory, as the channel's)."""
    import cupy as cp

    from cupy_ipcpool import IpcPool

    cp.cuda.Device(device).use()
    pool = IpcPool(count, nbytes, device=device)
    bufs = [pool.array((nbytes,), cp.uint8, slot=i) for i in range(count)]
    for b in bufs:
        b.fill(1)
    return pool, bufs


# -- children -----------------------------------------------------------------------


def _child_channel(conn: Connection, address: str, frames: int, memory: str, dev: int) -> None:
    from cupy_ipcpool.remote._subscriber import subscribe

    with subscribe(address, secret=SECRET, memory=memory, device=dev, slots=SLOTS) as sub:
        conn.send("ready")
        for _ in range(WARMUP):
            sub.recv(timeout=120).release()
        conn.send("warm")
        for _ in range(frames):
            sub.recv(timeout=120).release()
        conn.send(time.perf_counter())  # when the last frame was in


def _child_ucxx(
    conn: Connection, frames: int, nbytes: int, memory: str, dev: int, vmm: bool = False
) -> None:
    import select

    from cupy_ipcpool.remote import _ucx as ucx

    if memory == "device":
        import cupy as cp

        cp.cuda.Device(dev).use()
    worker = ucx.Worker(loopback_only=True)
    pool = None
    if vmm:
        pool, bufs = _vmm_buffers(4, nbytes, dev)
    else:
        bufs = [_alloc(memory, nbytes, dev) for _ in range(4)]
    conn.send(worker.address)
    poller = select.poll()
    poller.register(worker.fileno(), select.POLLIN)
    total = WARMUP + frames
    pending = [worker.recv(bufs[i % 4], i) for i in range(min(4, total))]
    posted = len(pending)
    done = 0
    while done < total:
        worker.progress()
        while pending and ucx.request_state(pending[0]) is not None:
            pending.pop(0)
            done += 1
            if done == WARMUP:
                conn.send("warm")
            if posted < total:
                pending.append(worker.recv(bufs[posted % 4], posted))
                posted += 1
        if done < total and worker.arm():
            poller.poll(100)
    conn.send(time.perf_counter())  # when the last frame was in
    conn.recv()
    del bufs, pending
    if pool is not None:
        pool.close()


def _child_tcp(conn: Connection, port: int, frames: int, nbytes: int) -> None:
    import numpy as np

    buf = np.empty(nbytes, np.uint8)
    view = buf.data
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(WARMUP + frames):
            if i == WARMUP:
                conn.send("warm")
            got = 0
            while got < nbytes:
                n = s.recv_into(view[got:])
                if not n:
                    raise EOFError
                got += n
        conn.send(time.perf_counter())  # when the last frame was in


# -- lanes --------------------------------------------------------------------------


def _channel(nbytes: int, frames: int, memory: str, device: int) -> float:
    from cupy_ipcpool.remote._source import serve

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.sock")
        if memory == "host":
            from cupy_ipcpool.remote._host import HostChannelPublisher, spec_of

            pub: Any = HostChannelPublisher(path, 6, nbytes)
            specs = (spec_of(_alloc("host", nbytes, device)),)

            def send_one() -> None:
                slot = pub.acquire(timeout=60)
                pub.publish(slot, specs, metadata=b"")

        else:
            import cupy as cp

            from cupy_ipcpool import IpcPool, Publisher

            cp.cuda.Device(device).use()
            pool = IpcPool(6, nbytes, device=device)
            pub = Publisher(pool, path)

            def send_one() -> None:
                with pub.frame(timeout=60) as f:
                    f.publish(f.array((nbytes,), "uint8"))

        server = serve(path, memory=memory, listen="127.0.0.1:0", secret=SECRET)
        parent, child = CTX.Pipe()
        proc = CTX.Process(
            target=_child_channel, args=(child, server.address, frames, memory, device)
        )
        proc.start()
        try:
            assert parent.poll(120) and parent.recv() == "ready"
            deadline = time.monotonic() + 30
            while not server.subscribers and time.monotonic() < deadline:
                time.sleep(0.01)
            for _ in range(WARMUP):
                send_one()
            while not parent.poll(0.001):
                pub.poll(0.0)
            assert parent.recv() == "warm"
            start = time.perf_counter()
            for _ in range(frames):
                send_one()
            while not parent.poll(0.01):
                pub.poll(0.0)
            elapsed = float(parent.recv()) - start
        finally:
            proc.join(60)
            server.close()
            pub.close()
            if memory == "device":
                pool.close()
    return elapsed / frames


def _ucxx(nbytes: int, frames: int, memory: str, device: int, vmm: bool = False) -> float:
    import select

    from cupy_ipcpool.remote import _ucx as ucx

    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_child_ucxx, args=(child, frames, nbytes, memory, device, vmm))
    proc.start()
    try:
        assert parent.poll(120)
        address = parent.recv()
        worker = ucx.Worker(loopback_only=True)
        ep = worker.connect(address)
        pool = None
        if vmm:
            pool, (buf,) = _vmm_buffers(1, nbytes, device)
        else:
            buf = _alloc(memory, nbytes, device)
        poller = select.poll()
        poller.register(worker.fileno(), select.POLLIN)
        inflight: list[Any] = []

        def send(src: Any, first: int, count: int) -> None:
            for i in range(first, first + count):
                inflight.append(worker.send(ep, src, i))
                while len(inflight) >= 4:
                    worker.progress()
                    inflight[:] = [r for r in inflight if ucx.request_state(r) is None]
                    if len(inflight) >= 4 and worker.arm():
                        poller.poll(10)

        send(buf, 0, WARMUP)
        while not parent.poll(0.001):
            worker.progress()
        assert parent.recv() == "warm"
        start = time.perf_counter()
        send(buf, WARMUP, frames)
        while not parent.poll(0.001):
            worker.progress()
        elapsed = float(parent.recv()) - start
        parent.send("bye")
        ucx.close_endpoint(ep)
        worker.progress()
        inflight.clear()
        del buf
        if pool is not None:
            pool.close()
    finally:
        proc.join(60)
    return elapsed / frames


def _tcp(nbytes: int, frames: int, memory: str, device: int) -> float:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=_child_tcp, args=(child, port, frames, nbytes))
        proc.start()
        try:
            conn, _ = listener.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                src = _alloc(memory, nbytes, device)

                def send(count: int) -> None:
                    for _ in range(count):
                        data = src if memory == "host" else src.get()  # host staging
                        conn.sendall(memoryview(data))

                send(WARMUP)
                assert parent.recv() == "warm"
                start = time.perf_counter()
                send(frames)
                elapsed = float(parent.recv()) - start
        finally:
            proc.join(60)
    return elapsed / frames


def _ucxx_vmm(nbytes: int, frames: int, memory: str, device: int) -> float:
    return _ucxx(nbytes, frames, memory, device, vmm=True)


LANES = {"channel": _channel, "ucxx": _ucxx, "tcp": _tcp}
#: device memory only: raw UCXX between buffers in IpcPool slots (the VMM memory the
#: channel sends from and receives into), beside ``ucxx``'s ``cupy.ones`` buffers
DEVICE_LANES = {"ucxx_vmm": _ucxx_vmm}


def run(
    sizes: tuple[int, ...] = (1 * MiB, 64 * MiB, 256 * MiB),
    *,
    memory: str = "host",
    device: int = 0,
    repeats: int = 3,
    budget_bytes: int = 2 << 30,
) -> list[Result]:
    """Time every lane at every size; return medians (seconds per frame)."""
    out = []
    for nbytes in sizes:
        frames = max(4, min(MAX_FRAMES, budget_bytes // nbytes))
        lanes = {**LANES, **DEVICE_LANES} if memory == "device" else LANES
        for lane, fn in lanes.items():
            secs = [fn(nbytes, frames, memory, device) for _ in range(repeats)]
            out.append(Result(lane, nbytes, frames, statistics.median(secs) * frames))
    return out


def report(results: list[Result]) -> str:
    """A table with frames/s, GB/s and the ratio to raw UCXX."""
    raw = {r.nbytes: r for r in results if r.lane == "ucxx"}
    lines = [f"{'size':>8} {'lane':>8} {'frames/s':>10} {'GB/s':>7} {'vs ucxx':>8}"]
    for r in results:
        ratio = r.gbps / raw[r.nbytes].gbps if r.nbytes in raw else float("nan")
        lines.append(
            f"{r.nbytes // MiB:>5} MiB {r.lane:>8} {r.fps:>10.1f} {r.gbps:>7.2f} {ratio:>7.2f}x"
        )
    return "\n".join(lines)


#: ``--tls`` value for UCX's own choice of transports (``UCX_TLS`` unset)
DEFAULT_TLS = "default"


def with_tls(tls: str) -> contextlib.AbstractContextManager[None]:
    """``UCX_TLS`` set to ``tls`` (``default``: unset) for the lanes run inside.

    Every lane makes its UCX contexts (and its child processes) afresh, so
    each reads the setting in effect when it runs.
    """

    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        before = os.environ.get("UCX_TLS")
        if tls == DEFAULT_TLS:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = tls
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("UCX_TLS", None)
            else:
                os.environ["UCX_TLS"] = before

    return scope()


def memory_key(memory: str, tls: str) -> str:
    """The result file's key of a run: ``device``, or ``device_tcp_cuda_copy`` for a ``UCX_TLS``."""
    if tls == DEFAULT_TLS:
        return memory
    return f"{memory}_{tls.replace(',', '_')}"


def record(figures: dict[str, Any], memory: str, by_tls: dict[str, list[Result]]) -> None:
    """Put runs into ``figures`` as docs/bench/remote.json holds them.

    ``memory.<key>.<size>``: each lane's seconds per frame and its rate over raw
    UCXX's (``<lane>_over_ucxx``); ``frames.<key>_<size>`` and
    ``gbps.<key>_<size>_<lane>`` beside.  Runs of other keys already there stay.
    """
    for tls, results in by_tls.items():
        key = memory_key(memory, tls)
        raw = {r.nbytes: r.seconds / r.frames for r in results if r.lane == "ucxx"}
        sizes: dict[str, Any] = {}
        for r in results:
            size = f"{r.nbytes // MiB}MiB"
            lanes = sizes.setdefault(size, {})
            lanes[r.lane] = r.seconds / r.frames
            if r.lane != "ucxx" and r.nbytes in raw:
                lanes[f"{r.lane}_over_ucxx"] = raw[r.nbytes] / (r.seconds / r.frames)
            figures.setdefault("frames", {})[f"{key}_{size}"] = r.frames
            figures.setdefault("gbps", {})[f"{key}_{size}_{r.lane}"] = r.gbps
        figures.setdefault("memory", {})[key] = sizes


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m cupy_ipcpool._bench.remote [options]``."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m cupy_ipcpool._bench.remote")
    p.add_argument("--memory", choices=("host", "device"), default="host")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--sizes", default="1,64,256", help="MiB, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-mib", type=int, default=2048, help="bytes moved per lane and size")
    p.add_argument(
        "--tls",
        action="append",
        metavar="TLS",
        help=f"a UCX_TLS to run the lanes with ('{DEFAULT_TLS}': unset); repeat for several "
        "(default: the environment's)",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="also write the figures to FILE (as docs/bench/remote.json; other runs in FILE stay)",
    )
    args = p.parse_args(argv)
    sizes = tuple(int(s) * MiB for s in args.sizes.split(","))
    sets = args.tls or [os.environ.get("UCX_TLS", DEFAULT_TLS)]
    by_tls: dict[str, list[Result]] = {}
    for tls in sets:
        with with_tls(tls):
            by_tls[tls] = run(
                sizes,
                memory=args.memory,
                device=args.device,
                repeats=args.repeats,
                budget_bytes=args.budget_mib * MiB,
            )
        print(f"UCX_TLS={tls} memory={args.memory}")
        print(report(by_tls[tls]))
    if args.json:
        figures: dict[str, Any] = {}
        if os.path.exists(args.json):  # a host run and a device run go in one file
            with open(args.json) as f:
                figures = json.load(f)
        record(figures, args.memory, by_tls)
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
