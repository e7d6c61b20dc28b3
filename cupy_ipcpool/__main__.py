"""Command line: ``python -m cupy_ipcpool {info,demo,bench,relay,serve}``.

The same commands are installed as the ``cupy-ipcpool`` script; each names
itself the way it was started.

Errors are one line on stderr, never a traceback (``--debug`` shows it):

* a usage error (a value out of range, a missing file, a bad address, a
  missing secret, the wrong ``--memory``) exits 2 with argparse's
  ``PROG COMMAND: error: argument --flag: ...``, naming the flag to fix;
* a runtime error (no publisher at the path, a refused connection, no GPU, a
  library error) exits 1 with a line that says what failed.

A command's arguments are checked before any GPU is touched: argparse's
``type`` functions check each value; a command's ``check`` default (a
function of the parsed arguments, run by :func:`main`) checks what needs
several of them or the environment, and raises :class:`argparse.ArgumentError`;
its ``gpu`` default names the device that must exist before ``run`` starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from ._version import __version__

DESCRIPTION = (
    "Zero-copy sharing of CuPy arrays between processes on one machine: a ring of CUDA "
    "VMM buffers exported as POSIX file descriptors, and a publish/subscribe channel "
    "over it. Run 'COMMAND --help' for a command's options."
)
INFO_DESCRIPTION = (
    "Print what this machine offers the library: the CUDA driver and each device "
    "(VMM, POSIX-fd handles, granularity, GPUDirect RDMA, MPS), whether pidfd_getfd "
    "can reach peers' fds, the remote extra and the compiled parts. Needs no GPU; "
    "exits 1 when no device can host a pool."
)
BENCH_DESCRIPTION = (
    "Measure the round trip of one frame between two processes with cupy_ipcpool, "
    "with the alternatives (host staging, legacy CUDA IPC, torch.multiprocessing, "
    "cuda.core IPC buffers) and against floors that share nothing; writes a Markdown "
    "table, the JSON samples and a plot to --outdir. Needs a GPU."
)
RELAY_DESCRIPTION = (
    "Subscribe to a remote channel (ucx://host:port, served by 'serve') and republish "
    "its frames as a local channel at PATH. Needs the remote extra."
)
SERVE_DESCRIPTION = (
    "Serve the local channel published at PATH to subscribers on other machines over "
    "UCX. The shared secret comes from $CUPY_IPCPOOL_SECRET or --secret-file. Needs the "
    "remote extra."
)
DEBUG_HELP = (
    "on an error, raise it with its Python traceback instead of printing one line "
    "(for a bug report; also accepted after the command)"
)
EPILOG = (
    "Exit status: 0 on success; 1 when the command failed (no GPU, no publisher, a "
    "connection refused...: one line on stderr says what); 2 for a usage error (one line "
    "naming the option to fix). --debug shows the traceback instead."
)

#: API keywords that library messages name, in the command line's words.
FLAG_WORDS = (
    ("pass secret=...", "set $CUPY_IPCPOOL_SECRET or pass --secret-file FILE"),
    ("secret=...", "--secret-file FILE"),
    ("insecure=True", "--insecure"),
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line: ``PROG: error: MESSAGE``.

    The usage synopsis is left out (``--help`` prints it); a missing command
    lists the commands.
    """

    commands: tuple[str, ...] = ()

    def error(self, message: str) -> NoReturn:
        if self.commands and "required: COMMAND" in message:
            message += f" (one of {', '.join(self.commands)}; see --help)"
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def one_line(text: str) -> str:
    """``text`` on one line (whitespace runs, newlines included, become one space)."""
    return " ".join(text.split())


def in_flag_words(text: str) -> str:
    """A library message with its API keywords replaced by the flags (:data:`FLAG_WORDS`)."""
    for api, flag in FLAG_WORDS:
        text = text.replace(api, flag)
    return text


def error_line(exc: BaseException) -> str:
    """The one line a runtime error prints: what failed, in the command line's words."""
    from ._errors import CudaUnavailableError, IpcPoolError, UnsupportedDeviceError

    text = str(exc) or type(exc).__name__
    if isinstance(exc, CudaUnavailableError):
        text = f"no GPU: {text}"
    elif isinstance(exc, UnsupportedDeviceError):
        text = f"no usable GPU: {text}"
    elif not isinstance(exc, (IpcPoolError, OSError)):
        text = f"{type(exc).__name__}: {text} (unexpected; --debug shows the traceback)"
    return one_line(in_flag_words(text))


def require_gpu(ordinal: int) -> None:
    """Check that CUDA device ``ordinal`` exists, before a command starts using it.

    Raises
    ------
    CudaUnavailableError
        No driver, or the driver sees no device.
    argparse.ArgumentError
        ``--device`` names a device that does not exist.
    """
    from . import _driver
    from ._errors import CudaUnavailableError

    count = _driver.device_count()
    if count == 0:
        raise CudaUnavailableError("the CUDA driver sees no device")
    if ordinal >= count:
        raise argparse.ArgumentError(
            None,
            f"argument --device: there is no CUDA device {ordinal}: {count} visible "
            f"(0..{count - 1})",
        )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, unless its help text already names it.

    Options whose default is None or False (a flag) show none.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


def program_name(argv0: str | None = None) -> str:
    """How the user started the command line, for usage lines and messages.

    ``python -m cupy_ipcpool`` runs ``cupy_ipcpool/__main__.py``; the installed
    script runs as ``cupy-ipcpool`` (or whatever its file is called).

    Parameters
    ----------
    argv0
        ``sys.argv[0]`` (the default).
    """
    name = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    if not name or name in ("__main__.py", "-c", "-m") or name.startswith("python"):
        return "python -m cupy_ipcpool"
    return name


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The whole command line: every subcommand and its options (no GPU is touched).

    Parameters
    ----------
    prog
        The program name for usage lines (default: :func:`program_name`).
    """
    parser = ArgumentParser(
        prog=program_name() if prog is None else prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"cupy_ipcpool {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    # not required here: main() says a command is missing once argparse has named any
    # unknown option (a required COMMAND would be reported first, hiding it)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name, help=summary, description=description, formatter_class=HelpFormatter
        )
        # SUPPRESS: absent after the command, it leaves the global flag's value alone
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
        return p

    command("info", "driver, devices, VMM / POSIX-fd support, fd transports", INFO_DESCRIPTION)
    from ._bench import add_arguments as add_bench
    from ._demo import DESCRIPTION as DEMO_DESCRIPTION
    from ._demo import add_arguments as add_demo

    add_demo(command("demo", "a producer and consumer processes passing frames", DEMO_DESCRIPTION))
    add_bench(command("bench", "handoff latency against the alternatives", BENCH_DESCRIPTION))
    from .remote._cli import add_relay_arguments, add_serve_arguments

    add_relay_arguments(command("relay", "republish a ucx:// stream locally", RELAY_DESCRIPTION))
    add_serve_arguments(command("serve", "serve a local channel over UCX", SERVE_DESCRIPTION))
    parser.commands = tuple(sub.choices)
    return parser


def run_command(args: argparse.Namespace) -> int:
    """Check ``args`` (the command's ``check``), then its GPU (``gpu``), then run it."""
    if args.command == "info":
        from ._info import main as info_main

        return info_main()
    check: Callable[[argparse.Namespace], None] | None = getattr(args, "check", None)
    if check is not None:
        check(args)
    gpu: Callable[[argparse.Namespace], int | None] | None = getattr(args, "gpu", None)
    ordinal = None if gpu is None else gpu(args)
    if ordinal is not None:
        require_gpu(ordinal)
    return int(args.run(args))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m cupy_ipcpool`` and the ``cupy-ipcpool`` script.

    Returns the exit status: 0, 1 (a runtime error) or 2 (a usage error), each
    error printed as one line on stderr; with ``--debug`` an error is raised
    instead, with its traceback.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error("the following arguments are required: COMMAND")
    try:
        return run_command(args)
    except argparse.ArgumentError as exc:
        if args.debug:
            raise
        print(f"{parser.prog} {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(error_line(exc), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
