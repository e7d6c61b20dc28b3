"""Consumers in another PID and mount namespace (``unshare``), shared by the CPU and GPU tiers.

A consumer is a ``python -c`` script: :data:`CONSUMER_HEAD` reads its JSON
arguments and starts its report ``out``; inside the script's ``try:``, after its
own imports, :data:`DROP_UID` drops to ``args["uid"]`` (if not None) and notes
the capabilities and uid it runs with.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

NOBODY = 65534
CHECKOUT = str(Path(__file__).resolve().parents[1])
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]

CONSUMER_HEAD = r"""
import json, os, sys
args = json.loads(sys.argv[1])
out = {"pid": os.getpid(), "pid_namespace": os.stat("/proc/self/ns/pid").st_ino}
try:
"""

DROP_UID = r"""    if args["uid"] is not None:
        os.setgroups([])
        os.setgid(args["uid"])
        os.setuid(args["uid"])
    with open("/proc/self/status") as f:
        out["cap_eff"] = next(l.split()[1] for l in f if l.startswith("CapEff:"))
    out["uid"] = os.geteuid()
"""


def unshare_skip_reason(timeout: float, *, needs_root: bool = False, **run: object) -> str | None:
    """Why ``unshare --pid --fork --mount-proc`` cannot run a consumer here (None: it can).

    ``needs_root``: refuse without root first; ``run``: more arguments of the probe's
    ``subprocess.run``.
    """
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    if needs_root and os.geteuid() != 0:
        return "unshare of a PID namespace (and the drop to uid 65534) needs root"
    try:
        probe = subprocess.run(
            [*UNSHARE, sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **run,  # type: ignore[call-overload]
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unshare --pid --fork --mount-proc cannot run here: {exc}"
    if probe.returncode != 0 or probe.stdout.strip() != "1":
        return f"unshare --pid --fork --mount-proc is refused here: {probe.stderr.strip()}"
    return None


@contextlib.contextmanager
def shared_socket_dir(prefix: str) -> Iterator[str]:
    """The socket directory both namespaces see, traversable by uid 65534; removed after."""
    path = tempfile.mkdtemp(prefix=prefix)
    os.chmod(path, 0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
