"""``python -m cupy_ipcpool relay|serve``: the remote layer from the command line.

The secret comes from ``$CUPY_IPCPOOL_TOKEN`` or ``--token-file`` (never the
command line, where other users can read it in the process list).
"""

from __future__ import annotations

import argparse
import signal
import threading


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as f:
            return f.read().strip()
    return None


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", help="file holding the shared secret ($CUPY_IPCPOOL_TOKEN)")
    parser.add_argument("--insecure", action="store_true", help="no secret (trusted hosts only)")
    parser.add_argument("--memory", choices=("device", "host"), default="device")
    parser.add_argument("--mode", choices=("block", "latest"), default="block")
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
        token=_token(args),
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
        return 0 if end is None or end.clean else 1


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``serve PATH``."""
    parser.add_argument("path", help="the producer's local socket path")
    parser.add_argument(
        "--listen", default="127.0.0.1:13337", help="host:port (default 127.0.0.1:13337)"
    )
    _common(parser)
    parser.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until the local stream ends or a signal arrives."""
    from ._server import serve

    stop = threading.Event()
    _until_signal(stop)
    with serve(
        args.path,
        listen=args.listen,
        token=_token(args),
        insecure=args.insecure,
        memory=args.memory,
        mode=args.mode,
        device=None if args.memory == "host" else args.device,
    ) as server:
        print(f"serving {args.path} at {server.address}", flush=True)
        while not stop.is_set() and not server.wait(0.5):
            pass
        print(f"sent {server.frames_sent} frames", flush=True)
    return 0
