"""``python -m cupy_ipcpool relay|serve``: the remote layer from the command line.

The secret comes from ``$CUPY_IPCPOOL_SECRET`` or ``--secret-file`` (never the
command line, where other users can read it in the process list).

Exit status: 0 when the stream ended cleanly (the producer closed, or the
server said goodbye) or a signal stopped the command; 1 when it ended for any
other reason, which is printed (the producer died, the connection was lost,
the server was evicted or failed).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def _secret(args: argparse.Namespace) -> str | None:
    if args.secret_file:
        with open(args.secret_file, encoding="utf-8") as f:
            return f.read().strip()
    return None


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--secret-file", help="file holding the shared secret (default: $CUPY_IPCPOOL_SECRET)"
    )
    parser.add_argument("--insecure", action="store_true", help="no secret (trusted hosts only)")
    parser.add_argument(
        "--memory", choices=("device", "host"), default="device", help="default: device"
    )
    parser.add_argument(
        "--mode", choices=("block", "latest"), default="block", help="default: block"
    )
    parser.add_argument("--device", type=int, default=0, help="GPU (default 0)")


def _until_signal(stop: threading.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


def add_relay_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``relay REMOTE PATH``."""
    parser.add_argument("remote", help="ucx://host:port of the remote server")
    parser.add_argument("path", help="local socket path to republish at")
    parser.add_argument("--slots", type=int, default=4, help="local ring slots (default 4)")
    _common(parser)
    parser.set_defaults(run=run_relay)


def run_relay(args: argparse.Namespace) -> int:
    """Relay until the remote stream ends or a signal arrives."""
    from ._relay import Relay

    stop = threading.Event()
    _until_signal(stop)
    with Relay(
        args.remote,
        args.path,
        secret=_secret(args),
        insecure=args.insecure,
        mode=args.mode,
        slots=args.slots,
        memory=args.memory,
        device=args.device,
    ) as relay:
        print(f"relaying {args.remote} -> {args.path}", flush=True)
        while not stop.is_set() and not relay.wait(0.5):
            pass
        end = relay.ended
        print(f"relayed {relay.relayed} frames; {end or 'stopped'}", flush=True)
        clean = end is None or bool(getattr(end, "clean", False))
        return 0 if clean else 1


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``serve PATH``."""
    parser.add_argument("path", help="the producer's local socket path")
    parser.add_argument(
        "--listen", default="127.0.0.1:13337", help="host:port (default 127.0.0.1:13337)"
    )
    _common(parser)
    parser.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until the local stream ends or a signal arrives.

    Returns 0 when a signal stopped it or the producer closed its channel
    cleanly; otherwise prints why the server ended and returns 1.
    """
    from ._source import serve

    stop = threading.Event()
    _until_signal(stop)
    with serve(
        args.path,
        listen=args.listen,
        secret=_secret(args),
        insecure=args.insecure,
        memory=args.memory,
        mode=args.mode,
        device=None if args.memory == "host" else args.device,
    ) as server:
        print(f"serving {args.path} at {server.address}", flush=True)
        while not stop.is_set() and not server.wait(0.5):
            pass
        end = server.ended
        if end is None:  # stopped by a signal while serving
            print(f"sent {server.frames_sent} frames; stopped", flush=True)
            return 0
        print(f"sent {server.frames_sent} frames; {end}", flush=True)
        if end.clean:
            return 0
        print(f"cupy_ipcpool serve: the server ended: {end}", file=sys.stderr, flush=True)
        return 1
