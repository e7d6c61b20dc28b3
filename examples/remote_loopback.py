"""The remote tier on one machine, in host memory: a producer, its server and a subscriber.

A :class:`~cupy_ipcpool.remote.HostChannelPublisher` (memfd slots, no GPU)
publishes frames on a local socket; :func:`cupy_ipcpool.remote.serve` bridges
that channel to UCX on 127.0.0.1; :func:`cupy_ipcpool.remote.subscribe` with
``memory="host"`` receives each frame into its own receive ring as a
``numpy.ndarray``.  Every byte of every frame is checked.

Needs no GPU, but needs UCXX: the remote tier's data plane is UCX, even on
loopback.  From the checkout::

    python3 -m pip install -e '.[remote-cu13]'
    python3 examples/remote_loopback.py [--frames N]

Exits 0 when every frame checked out, 1 when one did not, and 2 (with the
reason on stderr) for a ``--frames`` below 1 or when UCXX is not available.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

from cupy_ipcpool import remote

SECRET = "loopback example secret, 16+ bytes"
N_FLOATS = 100_000  # 400 kB a frame: above UCX's rendezvous threshold (zero-copy)


def frame_count(text: str) -> int:
    """An argparse ``type``: how many frames to send, at least 1."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {count}")
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--frames", type=frame_count, default=50, help="frames to send, at least 1 (default 50)"
    )
    args = parser.parse_args()

    reason = remote.available()
    if reason is not None:
        print(f"remote_loopback: UCXX is not available: {reason}", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cam.sock")
        with (
            remote.HostChannelPublisher(path, 4, N_FLOATS * 4) as pub,
            remote.serve(path, memory="host", listen="127.0.0.1:0", secret=SECRET) as server,
            remote.subscribe(server.address, secret=SECRET, memory="host", slots=2) as sub,
        ):
            deadline = time.monotonic() + 10.0
            while not server.subscribers:  # frames published before adoption are not sent
                if time.monotonic() > deadline:
                    print("remote_loopback: the subscriber was not adopted", file=sys.stderr)
                    return 1
                time.sleep(0.01)
            bad = 0
            for i in range(args.frames):
                sent = np.arange(N_FLOATS, dtype=np.float32) + i
                seq = pub.send(sent, metadata=i.to_bytes(8, "little"))
                with sub.recv(timeout=10.0) as frame:
                    ok = (
                        frame.seq == seq
                        and int.from_bytes(frame.metadata, "little") == i
                        and np.array_equal(frame.array, sent)
                    )
                    bad += not ok
            print(f"remote_loopback: {args.frames - bad} of {args.frames} frames checked out")
            return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
