"""``python -m cupy_ipcpool info``: what this machine offers the library."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

from . import _driver
from ._errors import CudaError, CudaUnavailableError
from ._version import __version__

CAP_SYS_PTRACE = 19
#: How to install the remote extra: UCXX of the CUDA major, from the source tree (the
#: package is on no index).
REMOTE_INSTALL = (
    "from the source tree: python3 -m pip install -e '.[remote-cu13]' (CUDA 13) or "
    "-e '.[remote-cu12]' (CUDA 12)"
)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cupy_version() -> str:
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy"):
        v = _version(dist)
        if v != "not installed":
            return f"{v} ({dist})"
    return "not installed"


def ptrace_scope() -> int | None:
    """Yama's ``kernel.yama.ptrace_scope`` (None where Yama is absent)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def has_cap_sys_ptrace() -> bool:
    """Whether this process's effective capabilities include ``CAP_SYS_PTRACE``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError):
        pass
    return False


def pidfd_summary() -> str:
    """One line on whether ``pidfd_getfd`` can reach peers' fds from this process."""
    scope = ptrace_scope()
    cap = has_cap_sys_ptrace()
    if not hasattr(os, "pidfd_open"):
        return "unavailable (Python without os.pidfd_open); use transport='socket'"
    scope_txt = "no Yama" if scope is None else f"Yama ptrace_scope={scope}"
    if cap:
        verdict = "likely (CAP_SYS_PTRACE held)"
    elif scope in (None, 0):
        verdict = "for peers of the same uid"
    elif scope == 1:
        verdict = "only for descendants (or CAP_SYS_PTRACE); use transport='socket' otherwise"
    else:
        verdict = "no; use transport='socket'"
    return f"{verdict} [{scope_txt}, CAP_SYS_PTRACE={'yes' if cap else 'no'}]"


def remote_summary() -> str:
    """One line on the remote extra (UCXX) and the UCX version it loads."""
    for major in ("cu13", "cu12"):
        v = _version(f"ucxx-{major}")
        if v != "not installed":
            return f"remote (UCXX): ucxx-{major} {v}, libucx-{major} {_version(f'libucx-{major}')}"
    return f"remote (UCXX): not installed; {REMOTE_INSTALL}"


def remote_device_path(tls: str | None = None) -> str:
    """One line on how remote device frames travel with UCX's transports ``tls``.

    ``tls`` defaults to ``$UCX_TLS`` (unset: UCX's own choice, ``cuda_ipc``
    included).  The rule is :func:`cupy_ipcpool.remote._staging.needs_staging`.
    """
    from .remote._staging import transports_include_cuda_ipc

    if tls is None:
        tls = os.environ.get("UCX_TLS", "")
    if transports_include_cuda_ipc(tls):
        return (
            "remote device frames: staged through cudaMalloc buffers to and from peers on "
            "this machine (UCX's cuda_ipc cannot export POSIX-fd VMM slots); the slots "
            "themselves between machines"
        )
    return f"remote device frames: the slots themselves (UCX_TLS={tls} leaves out cuda_ipc)"


def fastpath_summary() -> str:
    """One line on the compiled parts (``_fastpath``, ``_engine``)."""
    import importlib

    built, missing = [], []
    for name in ("cupy_ipcpool._fastpath", "cupy_ipcpool._engine"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            missing.append(name.rsplit(".", 1)[1])
        else:
            built.append(os.path.basename(module.__file__ or name))
    if missing:
        return (
            f"compiled parts: NOT BUILT ({', '.join(missing)}); publishers and subscribers "
            "cannot run: reinstall with pip, or 'python3 setup.py build_ext --inplace' in a "
            "source tree"
        )
    return f"compiled parts: built ({', '.join(built)})"


def gpudirect_rdma(ordinal: int) -> str:
    """Whether VMM allocations on the device can be GPUDirect-RDMA capable (NIC registration)."""
    try:
        supported = _driver.device_info(ordinal).gpudirect_rdma
    except Exception:
        return "unknown"
    return "yes (slots are allocated GPUDirect-RDMA capable)" if supported else "no"


def mps_text(mps: bool | None) -> str:
    """The ``MPS=`` field of a device line."""
    return "unknown" if mps is None else ("yes" if mps else "no")


def mps_summary(flags: list[bool | None]) -> str | None:
    """A note on GPU sharing between processes when a device is not shared through MPS.

    ``flags``: each listed device's :attr:`DeviceInfo.mps`.  None when every
    device is shared through the MPS daemon (nothing to say).
    """
    if flags and all(flags):
        return None
    return (
        "GPU sharing between processes: without the MPS daemon, each process has its own "
        "context and the GPU runs them in turns (~150 us per switch on an H200), which bounds "
        "a channel's frames/s with few slots; see 'Sizing the ring' and 'MPS' in "
        "docs/performance.md"
    )


def report() -> tuple[list[str], str | None]:
    """What this machine offers: the report's lines, and why no device can host a pool.

    Returns
    -------
    lines : list[str]
        Versions, the fd transports, the remote extra, the compiled parts, the
        driver and each device.
    failure : str or None
        One line saying why no device can host a pool (``no GPU: ...``), or
        None when one can.
    """
    lines = [
        f"cupy_ipcpool {__version__}  python {platform.python_version()}  "
        f"kernel {platform.release()}",
        f"cupy {_cupy_version()}  cuda-bindings {_version('cuda-bindings')}",
        f"pidfd_getfd: {pidfd_summary()}",
        "socket transport (SCM_RIGHTS): available",
        remote_summary(),
        remote_device_path(),
        fastpath_summary(),
    ]
    try:
        version = _driver.driver_version()
        count = _driver.device_count()
    except CudaUnavailableError as exc:
        return lines, " ".join(f"no GPU: {exc}".split())
    lines.append(f"driver CUDA version {version // 1000}.{version % 1000 // 10}, {count} device(s)")
    if count == 0:
        return lines, "no GPU: the driver sees no device"
    usable = 0
    mps_flags: list[bool | None] = []
    for i in range(count):
        try:
            d = _driver.device_info(i)
        except CudaError as exc:
            lines.append(f"  [{i}] query failed: {exc}")
            continue
        usable += d.usable
        gran = f"{d.granularity} B" if d.granularity else "n/a"
        lines.append(
            f"  [{i}] {d.name} sm_{d.compute_capability[0]}{d.compute_capability[1]} "
            f"{d.total_memory / 2**30:.1f} GiB uuid={d.uuid.hex()} VMM={'yes' if d.vmm else 'no'} "
            f"POSIX-fd={'yes' if d.posix_fd else 'no'} fabric={'yes' if d.fabric else 'no'} "
            f"granularity={gran} GPUDirect-RDMA={gpudirect_rdma(i)} MPS={mps_text(d.mps)}"
        )
        mps_flags.append(d.mps)
    note = mps_summary(mps_flags)
    if note is not None and usable:
        lines.append(note)
    if not usable:
        return lines, "no usable GPU: no device supports VMM with POSIX-fd handles"
    return lines, None


def main() -> int:
    """Print the report on stdout; return 0, or 1 with its one-line reason on stderr.

    The reason (no driver, no device, no device that can host a pool) is the
    command line's runtime error: one line on stderr, exit status 1.
    """
    lines, failure = report()
    print("\n".join(lines), flush=True)
    if failure is None:
        return 0
    print(failure, file=sys.stderr)
    return 1
