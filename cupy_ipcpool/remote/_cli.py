"""``python -m cupy_ipcpool relay|serve``: the remote layer from the command line.

The secret comes from ``$CUPY_IPCPOOL_SECRET`` or ``--secret-file`` (never the
command line, where other users can read it in the process list).

Arguments are checked before anything is connected or a GPU is touched:
addresses (``REMOTE`` with its scheme and port written out), counts and the
local socket's path (not empty, short enough for a socket, a socket where a
file is there already, for ``relay`` in a directory that exists) as they are
parsed; the secret (present unless ``--insecure``, never with it, readable,
long enough) by the ``check`` default that the command line runs first.  A
usage error raises :class:`argparse.ArgumentError`, which the command line
prints as one line naming the flag (exit status 2).

Exit status: 0 when the stream ended cleanly (the producer closed, or the
server said goodbye) or a signal stopped the command; 1 when it ended for any
other reason, which is printed (the producer died, the connection was lost,
the server was evicted or failed); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import stat
import sys
import threading
from typing import Any

from .._errors import ForeignPeerError, ProtocolError, UsageError
from .._transport import check_socket_path
from ..channel import MAX_CHANNEL_SLOTS
from . import _auth as auth
from . import _wire as wire

#: Most slots of the relay's ring: the remote credit's limit and a local channel's.
MAX_RELAY_SLOTS = min(wire.MAX_RING_SLOTS, MAX_CHANNEL_SLOTS)
NO_SECRET = (
    f"no shared secret: set ${auth.SECRET_ENV} or pass --secret-file FILE "
    "(or --insecure, on trusted hosts only)"
)


def remote_address(text: str) -> str:
    """An argparse ``type``: ``ucx://host:port`` written out, as the Python API takes it
    (:func:`~cupy_ipcpool.remote._wire.parse_address`, the one parser of both)."""
    try:
        wire.parse_address(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def listen_address(text: str) -> str:
    """An argparse ``type``: ``host:port`` to listen on, the port written out (0: any free one),
    as :class:`~cupy_ipcpool.remote.RemoteServer` takes it (``_wire.parse_listen``)."""
    try:
        wire.parse_listen(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def socket_path(text: str) -> str:
    """An argparse ``type``: a path a local channel's socket can be at (``serve``'s PATH).

    Not empty, short enough for a socket (:func:`~cupy_ipcpool._transport.check_socket_path`),
    and, where something is there already, a socket.
    """
    try:
        check_socket_path(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    try:
        mode = os.stat(text).st_mode
    except FileNotFoundError:
        return text  # no publisher there (yet): serve says so once it runs
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: {exc.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise argparse.ArgumentTypeError(
            f"{text} is not a socket (a channel's PATH is the Unix socket its publisher listens on)"
        )
    return text


def new_socket_path(text: str) -> str:
    """An argparse ``type``: a path to publish a local channel at (``relay``'s PATH).

    As :func:`socket_path` (a socket already there is replaced if no one listens on
    it, refused if someone does), in a directory that exists.
    """
    text = socket_path(text)
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"{text}: there is no directory {directory}")
    return text


def int_in(low: int, high: int | None = None) -> Any:
    """An argparse ``type``: an integer in ``low..high`` (no upper bound when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def check_secret(args: argparse.Namespace) -> None:
    """Set ``args.secret`` from ``--secret-file`` or ``$CUPY_IPCPOOL_SECRET`` (None: none).

    Raises
    ------
    argparse.ArgumentError
        The file cannot be read or is empty, the secret is shorter than 16
        bytes, there is none and ``--insecure`` was not given, or
        ``--insecure`` was given with a secret in the environment (argparse
        itself refuses it with ``--secret-file``).
    """
    secret: str | None
    if args.insecure and os.environ.get(auth.SECRET_ENV):
        raise argparse.ArgumentError(
            None,
            f"argument --insecure: ${auth.SECRET_ENV} is set; unset it to run without a "
            "secret, or drop --insecure to use it",
        )
    if args.secret_file is not None:
        source = f"argument --secret-file: {args.secret_file}"
        try:
            with open(args.secret_file, encoding="utf-8") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise argparse.ArgumentError(
                None, f"argument --secret-file: cannot read {args.secret_file}: {exc.strerror}"
            ) from exc
        except ValueError as exc:  # UnicodeDecodeError
            raise argparse.ArgumentError(None, f"{source} is not UTF-8 text") from exc
        if not secret:
            raise argparse.ArgumentError(None, f"{source} is empty")
    else:
        source = f"${auth.SECRET_ENV}"
        secret = os.environ.get(auth.SECRET_ENV) or None
    if secret is None:
        if not args.insecure:
            raise argparse.ArgumentError(None, NO_SECRET)
    elif len(secret.encode("utf-8")) < auth.MIN_SECRET:
        raise argparse.ArgumentError(
            None,
            f"{source} holds a secret of {len(secret.encode('utf-8'))} bytes; use at least "
            f"{auth.MIN_SECRET} (e.g. python3 -c 'import secrets; "
            "print(secrets.token_urlsafe(32))')",
        )
    args.secret = secret


def check_listen(args: argparse.Namespace) -> None:
    """Check that ``--listen`` names an address of this machine and a free port.

    A socket is bound to it (as the server binds its own, with
    ``SO_REUSEADDR``) and closed, before the producer's channel is joined.

    Raises
    ------
    argparse.ArgumentError
        The host is unknown or not this machine's, or the port is taken.
    """
    host, port = wire.parse_listen(args.listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
            probe.listen(1)
    except OSError as exc:
        raise argparse.ArgumentError(
            None, f"argument --listen: cannot listen on {args.listen}: {exc.strerror or exc}"
        ) from exc


def check_serve(args: argparse.Namespace) -> None:
    """The checks of ``serve`` that argparse cannot make: the secret, then ``--listen``."""
    check_secret(args)
    check_listen(args)


def _common(parser: argparse.ArgumentParser) -> None:
    secret = parser.add_mutually_exclusive_group()
    secret.add_argument(
        "--secret-file",
        metavar="FILE",
        help=f"file holding the shared secret, at least {auth.MIN_SECRET} bytes "
        f"(default: ${auth.SECRET_ENV})",
    )
    secret.add_argument(
        "--insecure",
        action="store_true",
        help=f"no secret (trusted hosts only; not with --secret-file or ${auth.SECRET_ENV})",
    )
    parser.add_argument(
        "--memory", choices=("device", "host"), default="device", help="default: device"
    )
    parser.add_argument(
        "--mode", choices=("block", "latest"), default="block", help="default: block"
    )


def _until_signal(stop: threading.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


def add_relay_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``relay REMOTE PATH``."""
    parser.add_argument(
        "remote",
        metavar="REMOTE",
        type=remote_address,
        help=f"ucx://host:port of the remote server (serve listens on port {wire.DEFAULT_PORT} "
        "unless its --listen says otherwise)",
    )
    parser.add_argument(
        "path", metavar="PATH", type=new_socket_path, help="local socket path to republish at"
    )
    parser.add_argument(
        "--slots",
        type=int_in(1, MAX_RELAY_SLOTS),
        default=4,
        help=f"local ring slots, 1..{MAX_RELAY_SLOTS} (default 4)",
    )
    _common(parser)
    parser.add_argument(
        "--device", type=int_in(0), default=0, help="GPU of the local ring (default 0)"
    )
    parser.set_defaults(
        run=run_relay,
        check=check_secret,
        gpu=lambda args: args.device if args.memory == "device" else None,
    )


def run_relay(args: argparse.Namespace) -> int:
    """Relay until the remote stream ends or a signal arrives (``args`` checked)."""
    from ._relay import Relay

    stop = threading.Event()
    _until_signal(stop)
    with Relay(
        args.remote,
        args.path,
        secret=args.secret,
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
        if end is None or bool(getattr(end, "clean", False)):
            return 0
        print(f"the relay ended: {end}", file=sys.stderr, flush=True)
        return 1


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``serve PATH``."""
    parser.add_argument(
        "path", metavar="PATH", type=socket_path, help="the producer's local socket path"
    )
    parser.add_argument(
        "--listen",
        type=listen_address,
        default=f"127.0.0.1:{wire.DEFAULT_PORT}",
        help=f"host:port (default 127.0.0.1:{wire.DEFAULT_PORT}; port 0: any free port)",
    )
    _common(parser)
    parser.add_argument(
        "--device",
        type=int_in(0),
        default=None,
        help="GPU the bridge maps the producer's pool on (default: the producer's)",
    )
    parser.set_defaults(
        run=run_serve,
        check=check_serve,
        gpu=lambda args: args.device if args.memory == "device" else None,
    )


def other_memory(args: argparse.Namespace) -> str | None:
    """The memory kind of the channel at PATH when it is not ``--memory``'s, else None.

    Asked after subscribing as ``--memory`` says failed with a
    :class:`ProtocolError`: a brief subscription of the other kind (``latest``,
    so it never holds the producer up) says whether that was the mistake.
    None when it fails too.
    """
    probe: Any
    try:
        if args.memory == "device":
            from ._host import HostChannelSubscriber

            probe = HostChannelSubscriber(args.path, mode="latest", timeout=2.0)
        else:
            from ._source import DeviceSource

            probe = DeviceSource(args.path, mode="latest", device=args.device, timeout=2.0)
    except Exception:
        return None
    probe.close()
    return "host" if args.memory == "device" else "device"


def run_serve(args: argparse.Namespace) -> int:
    """Serve until the local stream ends or a signal arrives (``args`` checked).

    Returns 0 when a signal stopped it or the producer closed its channel
    cleanly; otherwise prints why the server ended and returns 1.

    Raises
    ------
    argparse.ArgumentError
        The channel at PATH carries the other kind of memory than ``--memory``.
    ProtocolError, TransportError
        What is at PATH is not a cupy_ipcpool publisher (it answers in another
        protocol, or its socket is of another type); the message says so.
    """
    from ._source import serve

    stop = threading.Event()
    _until_signal(stop)
    try:
        server = serve(
            args.path,
            listen=args.listen,
            secret=args.secret,
            insecure=args.insecure,
            memory=args.memory,
            mode=args.mode,
            device=None if args.memory == "host" else args.device,
        )
    except ForeignPeerError:
        raise  # no publisher at all: the message says so, with what it answered
    except ProtocolError as exc:
        other = other_memory(args)
        if other is None:
            raise ProtocolError(
                f"{args.path} does not answer as a cupy_ipcpool publisher (of this version): {exc}"
            ) from exc
        raise argparse.ArgumentError(
            None,
            f"argument --memory: the channel at {args.path} carries {other} memory, not "
            f"{args.memory} memory: pass --memory {other}",
        ) from exc
    with server:
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
        print(f"the server ended: {end}", file=sys.stderr, flush=True)
        return 1
