"""The UCX data plane: one UCXX worker in blocking-progress mode, tag sends and receives.

Only this module imports ``ucxx``, lazily, so ``cupy_ipcpool.remote`` imports
without it and says how to install it when a session is opened.  A worker is
driven by one thread; its epoll fd joins that thread's ``poll(2)`` set
(:meth:`Worker.fileno`), so the control sockets and the data plane share one
wait.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from typing import Any

from ._errors import RemoteUnavailableError

_api: Any = None
_Array: Any = None

INSTALL_HINT = (
    "install the remote extra of your CUDA major: from the source tree, python3 -m pip "
    "install -e '.[remote-cu13]' (CUDA 13) or -e '.[remote-cu12]' (CUDA 12)"
)
#: What to do when a UCX older than UCXX needs was loaded (a system installation).
OLD_UCX_HINT = (
    "an older UCX of the system was loaded instead of the libucx-cu13 (or -cu12) wheel's: put the "
    "wheel's libraries first (LD_LIBRARY_PATH=<site-packages>/libucx/lib), or remove the "
    "system UCX, or upgrade it"
)


def _preload_wheel_ucx() -> None:
    """Load the libucx-cu13 (or -cu12) wheel's UCX libraries, if that wheel is installed.

    UCXX's own loader may leave the choice to the dynamic linker, which
    prefers a system UCX in the default library path (seen on the H200
    image: UCX 1.16 in /lib/x86_64-linux-gnu, too old for UCXX).  Loaded
    first, the wheel's libraries are the ones UCXX binds to.  The wheel's
    ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY`` setting still applies.
    """
    try:
        import libucx
    except ImportError:
        return
    with contextlib.suppress(OSError):  # not loadable: UCXX's import says why
        libucx.load_library()


def load() -> Any:
    """Import UCXX once; return ``ucxx._lib.libucxx``.

    Raises
    ------
    RemoteUnavailableError
        UCXX is not installed or its libraries do not load.
    """
    global _api, _Array
    if _api is None:
        # UCXX sets UCX_MEMTYPE_CACHE, which UCX >= 1.19 no longer knows: do not warn about it.
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        _preload_wheel_ucx()
        try:
            import ucxx._lib.libucxx as api
            from ucxx._lib.arr import Array
        except Exception as exc:  # ImportError, or a library that fails to load
            hint = OLD_UCX_HINT if "has ended" in str(exc) else INSTALL_HINT
            raise RemoteUnavailableError(f"UCXX is not usable here ({exc}); {hint}") from exc
        _api, _Array = api, Array
    return _api


def available() -> str | None:
    """None when UCXX imports, else the reason it does not."""
    try:
        load()
    except RemoteUnavailableError as exc:
        return str(exc)
    return None


def buffer(obj: Any) -> Any:
    """Wrap a contiguous host (buffer protocol) or device (``__cuda_array_interface__``) array."""
    load()
    return _Array(obj)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and the 127/8 and ::1 addresses."""
    return host in ("localhost", "::1") or host.startswith("127.")


#: Seconds :meth:`Worker.close` waits for its receives still in flight to end.
CLOSE_TIMEOUT = 5.0


class Worker:
    """A UCX context and worker with wakeup (epoll) support, for tag messages.

    The worker keeps the receives it posted until they end: UCX cannot cancel
    a receive that matched a rendezvous send (its data arriving), and UCXX
    holds such a request, and the request its worker, until it completes.
    :meth:`close` therefore waits for them (see there).

    Parameters
    ----------
    loopback_only:
        Restrict UCX to the loopback device (``NET_DEVICES=lo``) unless
        ``UCX_NET_DEVICES`` is set, so nothing of this worker listens on other
        interfaces.
    """

    def __init__(self, *, loopback_only: bool) -> None:
        api = load()
        config: dict[str, str] = {}
        if loopback_only and "UCX_NET_DEVICES" not in os.environ:
            config["NET_DEVICES"] = "lo"
        self._api = api
        self._context = api.UCXContext(
            config_dict=config, feature_flags=(api.Feature.TAG, api.Feature.WAKEUP)
        )
        self._worker = api.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        self._recvs: list[Any] = []  # posted receives, not known to have ended
        self._pruned = 0  # len(self._recvs) after the last pruning
        self._closed = False

    def fileno(self) -> int:
        """The worker's epoll fd: readable when progress may complete something."""
        return int(self._worker.epoll_file_descriptor)

    @property
    def address(self) -> bytes:
        """This worker's UCX address (what a peer connects to)."""
        return bytes(self._worker.address)

    @property
    def config(self) -> dict[str, str]:
        """The UCX configuration in effect (``TLS``, ``NET_DEVICES``...)."""
        return dict(self._context.config)

    def connect(self, address: bytes) -> Any:
        """An endpoint (with error handling) to the worker at ``address``."""
        addr = self._api.UCXAddress.create_from_buffer(address)
        return self._worker.create_endpoint_from_worker_address(addr, True)

    def send(self, endpoint: Any, array: Any, tag: int) -> Any:
        """Start a tag send of ``array``; return the request (None: the endpoint is gone)."""
        return _keep_if_empty(endpoint.tag_send(_Array(array), self._api.UCXXTag(tag)))

    def recv(self, array: Any, tag: int) -> Any:
        """Post a tag receive into ``array``; return the request (kept until :meth:`close`)."""
        req = _keep_if_empty(self._worker.tag_recv(_Array(array), self._api.UCXXTag(tag)))
        if req is not None:
            recvs = self._recvs
            if len(recvs) >= 2 * self._pruned + 16:
                recvs[:] = [r for r in recvs if not r.completed]
                self._pruned = len(recvs)
            recvs.append(req)
        return req

    def progress(self) -> None:
        """Make all the progress available now."""
        w = self._worker
        while w.progress_once():
            pass

    def arm(self) -> bool:
        """Arm the epoll fd; False when events are pending (progress again, do not sleep)."""
        return bool(self._worker.arm())

    def cancel(self) -> None:
        """Cancel the requests UCXX scheduled for cancelling (an endpoint's, once it failed/closed).

        Receives posted on the worker are not among them (UCXX's
        ``cancel_inflight_requests`` does not touch them): freeing one cancels
        it, unless it matched a send already (see :meth:`close`).
        """
        self._worker.cancel_inflight_requests()

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Drop the worker and the context (endpoints must be closed first).

        Its receives still in flight are progressed until they end, for up to
        ``timeout`` seconds: one that matched a send (its data partly here)
        cannot be cancelled, and UCXX keeps the worker (its epoll, eventfd,
        sockets, shared memory) for as long as such a request lives, so a
        worker dropped with one would never go.  A peer that closes its
        endpoint (a server told BYE) completes them.  Then the rest, receives
        that matched nothing, are cancelled as they are freed.  Call it from
        the thread that drove the worker, once that thread stopped.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._drain(time.monotonic() + timeout)
        finally:
            self._recvs.clear()  # freeing a request cancels it, where UCX still can
            with contextlib.suppress(Exception):
                self.progress()
            self._worker = None
            self._context = None

    def _drain(self, deadline: float) -> None:
        """Progress until no posted receive is in flight, or ``deadline``."""
        if not self._recvs:
            return
        poller = select.poll()
        poller.register(self.fileno(), select.POLLIN)
        while True:
            self.progress()
            self._recvs = [r for r in self._recvs if not r.completed]
            left = deadline - time.monotonic()
            if not self._recvs or left <= 0:
                return
            if self.arm():
                poller.poll(max(1, int(min(left, 0.05) * 1000)))


def request_state(req: Any) -> str | None:
    """None while ``req`` runs; ``""`` when it succeeded; the error text when it failed."""
    if req is None or not req.ucxx_ptr:  # UCXX hands back no request for a closed endpoint
        return "no request (the endpoint is closed)"
    if not req.completed:
        return None
    try:
        req.check_error()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def close_endpoint(endpoint: Any) -> Any:
    """Start closing ``endpoint`` (its requests in flight fail); return the close request.

    The request may be empty (an endpoint already closed by an error): check
    it with :func:`request_state` only.
    """
    with contextlib.suppress(Exception):
        endpoint.remove_close_callback()
    try:
        if not endpoint.alive:
            return None  # closed by an error already
        req = endpoint.close()
    except Exception:
        return None
    return _keep_if_empty(req)


#: UCXX 0.52 hands back an empty request for an endpoint closed meanwhile, and
#: freeing that Python object dereferences a null pointer (``UCXRequest.__dealloc__``
#: calls ``cancel()`` on it).  Such objects are kept for the life of the process.
_EMPTY_REQUESTS: list[Any] = []


def _keep_if_empty(req: Any) -> Any:
    if req is not None and not req.ucxx_ptr:
        _EMPTY_REQUESTS.append(req)
        return None
    return req
