"""The remote layer's CPU tests, shared: a host channel served over UCX on 127.0.0.1.

``test_remote_cpu.py`` and ``test_remote_hardening.py`` each publish frames of
their own shape (their ``publish`` and ``check``); the producer, the remote
subscriber and the waiting are these.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

SECRET = "correct horse battery staple 42"


@contextlib.contextmanager
def served_host_channel(
    slot_nbytes: int, num_slots: int = 4, **kwargs: Any
) -> Iterator[tuple[Any, Any]]:
    """A host channel of ``num_slots`` slots and its remote server, both in this process.

    ``kwargs`` go to :func:`cupy_ipcpool.remote.serve` (``secret`` defaults to SECRET).
    """
    from cupy_ipcpool.remote import HostChannelPublisher, serve

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cam.sock")
        pub = HostChannelPublisher(path, num_slots, slot_nbytes)
        try:
            kwargs.setdefault("secret", SECRET)
            server = serve(path, memory="host", listen="127.0.0.1:0", **kwargs)
            try:
                yield pub, server
            finally:
                server.close()
        finally:
            pub.close()


def remote_sub(address: str, **kwargs: Any) -> Any:
    """A remote subscriber with a host-memory receive ring (``secret`` defaults to SECRET)."""
    from cupy_ipcpool.remote import subscribe

    kwargs.setdefault("secret", SECRET)
    return subscribe(address, memory="host", **kwargs)


def wait_for(cond: Any, timeout: float = 10.0, poll: Any = None, what: Any = None) -> None:
    """Wait for ``cond()``, calling ``poll()`` (if given) meanwhile.

    On a timeout the TimeoutError says ``what()`` (the state), if given.
    """
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"condition not met in {timeout} s" + ("" if what is None else f": {what()}")
            )
        if poll is not None:
            poll()
        time.sleep(0.005)
