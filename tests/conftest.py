"""Shared fixtures: the GPU tier skips with a reason where no usable device exists."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests import _fds

#: "on": this process runs GPU tests, so each test's end checks its CUDA context;
#: "broken": (test id, error) of the test after which the context held an error.
_context_check: dict[str, object] = {}


def _context_error() -> str | None:
    """The sticky error this process's CUDA context holds, or None (also when CUDA is unused).

    A synchronize of device 0's primary context (the one CuPy and the library use)
    surfaces an error left by any earlier kernel: an illegal address, say, which
    poisons the context for good.  Nothing is initialised that a test did not start.
    """
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    err, dev = driver.cuDeviceGet(0)
    if err != driver.CUresult.CUDA_SUCCESS:
        return None
    err, _flags, active = driver.cuDevicePrimaryCtxGetState(dev)
    if err != driver.CUresult.CUDA_SUCCESS or not active:
        return None
    err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"cuDevicePrimaryCtxRetain: {err.name}"
    try:
        (err,) = driver.cuCtxPushCurrent(ctx)
        if err != driver.CUresult.CUDA_SUCCESS:
            return f"cuCtxPushCurrent: {err.name}"
        (err,) = driver.cuCtxSynchronize()
        driver.cuCtxPopCurrent()
        return None if err == driver.CUresult.CUDA_SUCCESS else f"cuCtxSynchronize: {err.name}"
    finally:
        driver.cuDevicePrimaryCtxRelease(dev)


@pytest.fixture(autouse=True)
def _cuda_context_intact(request: pytest.FixtureRequest) -> Iterator[None]:
    """Pin a sticky CUDA error on the test after which it appeared, and blame no later test.

    Where the GPU tier runs, every test ends with a synchronize of this process's
    context: a test that leaves an error there (an illegal address from its own
    work) fails in its teardown with that error.  The context cannot be repaired,
    so under pytest-xdist the worker then exits (xdist starts a fresh one for the
    rest); in a single process every later GPU test fails at once, naming the test
    that broke the context, instead of reporting the error as its own.
    """
    if not _context_check.get("on"):
        yield
        return
    broken = _context_check.get("broken")
    if isinstance(broken, tuple) and request.node.get_closest_marker("gpu") is not None:
        culprit, error = broken
        pytest.fail(f"not run: this process's CUDA context was broken by {culprit} ({error})")
    yield
    if broken is None:
        error = _context_error()
        if error is not None:
            _context_check["broken"] = (request.node.nodeid, error)
            pytest.fail(f"this test left an error in the process's CUDA context: {error}")


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    result = yield
    broken = _context_check.get("broken")
    if (
        isinstance(broken, tuple)
        and broken[0] == item.nodeid
        and hasattr(item.config, "workerinput")
    ):
        # an xdist worker whose context is lost: this test's reports are sent; end the
        # worker, so that a fresh one (a fresh CUDA context) runs the remaining tests
        os._exit(3)
    return result


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
        _context_check["on"] = True
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def fd_count():
    """Return a callable giving the number of open fds in this process."""

    return _fds.fd_count
