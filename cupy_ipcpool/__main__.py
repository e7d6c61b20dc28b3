"""Command line: ``python -m cupy_ipcpool {info,demo,bench,relay,serve}``.

The same commands are installed as the ``cupy-ipcpool`` script; each names
itself the way it was started.
"""

from __future__ import annotations

import argparse
import os
import sys

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
    parser = argparse.ArgumentParser(
        prog=program_name() if prog is None else prog,
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"cupy_ipcpool {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=summary, description=description, formatter_class=HelpFormatter
        )

    command("info", "driver, devices, VMM / POSIX-fd support, fd transports", INFO_DESCRIPTION)
    from ._bench import add_arguments as add_bench
    from ._demo import DESCRIPTION as DEMO_DESCRIPTION
    from ._demo import add_arguments as add_demo

    add_demo(command("demo", "a producer and consumer processes passing frames", DEMO_DESCRIPTION))
    add_bench(command("bench", "handoff latency against the alternatives", BENCH_DESCRIPTION))
    from .remote._cli import add_relay_arguments, add_serve_arguments

    add_relay_arguments(command("relay", "republish a ucx:// stream locally", RELAY_DESCRIPTION))
    add_serve_arguments(command("serve", "serve a local channel over UCX", SERVE_DESCRIPTION))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m cupy_ipcpool`` and the ``cupy-ipcpool`` script."""
    args = build_parser().parse_args(argv)
    if args.command == "info":
        from ._info import main as info_main

        return info_main()
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
