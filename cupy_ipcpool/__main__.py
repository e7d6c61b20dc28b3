"""Command line: ``python -m cupy_ipcpool {info,demo,bench,relay,serve}``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m cupy_ipcpool`` and the ``cupy-ipcpool`` script."""
    parser = argparse.ArgumentParser(prog="python -m cupy_ipcpool")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="driver, devices, VMM / POSIX-fd support, fd transports")
    from ._bench import add_arguments as add_bench
    from ._demo import add_arguments as add_demo

    add_demo(sub.add_parser("demo", help="a producer and consumer processes passing frames"))
    add_bench(sub.add_parser("bench", help="handoff latency against the alternatives"))
    from .remote._cli import add_relay_arguments, add_serve_arguments

    add_relay_arguments(sub.add_parser("relay", help="republish a ucx:// stream locally"))
    add_serve_arguments(sub.add_parser("serve", help="serve a local channel over UCX"))
    args = parser.parse_args(argv)
    if args.command == "info":
        from ._info import main as info_main

        return info_main()
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
