"""Whether a call lets other Python threads run (releases the GIL) while it blocks."""

from __future__ import annotations

import platform
import threading
import time
from collections.abc import Callable
from typing import Any

#: Numbers of the system calls a blocking call of the library sleeps in, by machine.
_SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {"poll": 7, "ppoll": 271, "nanosleep": 35, "clock_nanosleep": 230},
    "aarch64": {"ppoll": 73, "nanosleep": 101, "clock_nanosleep": 115},
}


def _current_syscall(tid: int) -> int | None:
    """The system call thread ``tid`` of this process is in, or None (running, unknown)."""
    with open(f"/proc/self/task/{tid}/syscall") as f:
        first = f.read().split(maxsplit=1)
    return int(first[0]) if first and first[0].lstrip("-").isdigit() else None


def assert_gil_released(
    call: Callable[[], Any], waits_in: tuple[str, ...], wake: Callable[[], Any] | None = None
) -> Any:
    """Another Python thread runs while ``call`` is blocked in one of the system calls ``waits_in``.

    A watcher thread, which can only run while it holds the GIL, reads this
    thread's current system call from ``/proc`` until it finds it asleep in one
    of ``waits_in``; it then calls ``wake`` (when given: something that ends the
    call's wait, so the call can be given a long timeout) and records that it
    got there.  Were the GIL held across the wait, the watcher could not run
    during it and would never see the thread there.  No timing threshold: a
    loaded machine can delay the watcher, not make it see what did not happen.
    Returns what ``call`` returned.
    """
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        import pytest

        pytest.skip(f"system call numbers of {platform.machine()} are not listed")
    wanted = {numbers[name] for name in waits_in if name in numbers}
    assert wanted, (waits_in, platform.machine())
    tid = threading.get_native_id()
    seen = threading.Event()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if _current_syscall(tid) in wanted:
                seen.set()
                if wake is not None:
                    wake()
                return
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = call()
    finally:
        done.set()
        watcher.join()
    assert seen.is_set(), f"no other thread ran while the call waited in {waits_in}"
    return result
