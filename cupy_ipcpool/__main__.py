"""Command line: ``python -m cupy_ipcpool {info,demo,bench}``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m cupy_ipcpool`` and the ``cupy-ipcpool`` script."""
    parser = argparse.ArgumentParser(prog="python -m cupy_ipcpool")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="driver, devices, VMM / POSIX-fd support, fd transports")
    try:
        from ._demo import add_arguments as add_demo
    except ImportError:  # pragma: no cover - demo module not built yet
        add_demo = None
    if add_demo is not None:
        add_demo(sub.add_parser("demo", help="producer + consumers passing frames"))
    try:
        from ._bench import add_arguments as add_bench
    except ImportError:  # pragma: no cover
        add_bench = None
    if add_bench is not None:
        add_bench(sub.add_parser("bench", help="handoff latency against the alternatives"))
    args = parser.parse_args(argv)
    if args.command == "info":
        from ._info import main as info_main

        return info_main()
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
