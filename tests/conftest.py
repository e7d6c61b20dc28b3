"""Shared fixtures: the GPU tier skips with a reason where no usable device exists."""

from __future__ import annotations

import os

import pytest


def _gpu_skip_reason() -> str | None:
    """Return why the GPU tier cannot run here, or None when it can."""
    from cupy_ipcpool import _driver

    try:
        _driver.require_vmm_device(0)
    except Exception as exc:  # any reason at all is a reason to skip the GPU tier
        return f"GPU tier needs a CUDA device with VMM + POSIX-fd handles: {exc}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def fd_count():
    """Return a callable giving the number of open fds in this process."""

    def count() -> int:
        return len(os.listdir("/proc/self/fd"))

    return count
