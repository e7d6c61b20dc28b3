"""CPU tier: what the foundation does without a GPU (runs on CI)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings

import pytest

import cupy_ipcpool as cip
from cupy_ipcpool import _driver
from cupy_ipcpool._vmm import UndoStack, round_up
from tests.skips import no_driver


def test_import_needs_no_gpu():
    out = subprocess.run(
        [sys.executable, "-c", "import cupy_ipcpool, sys; print(cupy_ipcpool.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == cip.__version__


@no_driver
def test_every_gpu_call_raises_one_clear_error():
    for call in (
        lambda: cip.IpcPool(2, 1 << 20),
        lambda: cip.IPCBufferManager(2, 1 << 20),
        _driver.device_count,
        lambda: _driver.require_vmm_device(0),
    ):
        with pytest.raises(cip.CudaUnavailableError, match=r"driver|cuda"):
            call()


@no_driver
def test_info_cli_says_why_in_one_line_and_fails():
    out = subprocess.run(
        [sys.executable, "-m", "cupy_ipcpool", "info"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1
    # the reason is the command line's runtime error: one line on stderr (docs/install.md)
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("no GPU:"), out.stderr
    assert "driver" in out.stderr and "Traceback" not in out.stderr
    assert "no GPU" not in out.stdout, out.stdout
    assert "pidfd_getfd:" in out.stdout  # transport facts are reported without a GPU too
    # the install built the compiled part, and info says so
    assert "compiled parts: built" in out.stdout, out.stdout


@pytest.mark.parametrize(
    ("args", "kwargs", "exc"),
    [
        ((0, 1024), {}, ValueError),
        ((70000, 1024), {}, ValueError),
        ((2, 0), {}, ValueError),
        ((2, -5), {}, ValueError),
        ((2, 1 << 50), {}, ValueError),
        ((2.0, 1024), {}, TypeError),
        ((2, "1024"), {}, TypeError),
        ((True, 1024), {}, TypeError),
        ((2, 1024), {"device": -1}, ValueError),
        ((2, 1024), {"device": "0"}, TypeError),
    ],
)
def test_bad_arguments_are_rejected_before_the_driver(args, kwargs, exc):
    with pytest.raises(exc):
        cip.IpcPool(*args, **kwargs)


@pytest.mark.parametrize(
    ("n", "g", "want"),
    [
        (1, 2 << 20, 2 << 20),
        (2 << 20, 2 << 20, 2 << 20),
        ((2 << 20) + 1, 2 << 20, 4 << 20),
        (4096, 4096, 4096),
        (12345, 1, 12345),
    ],
)
def test_round_up_keeps_aligned_sizes(n, g, want):
    assert round_up(n, g) == want


@pytest.mark.parametrize(("n", "g"), [(0, 4096), (-1, 4096), (10, 0), (10, -4096)])
def test_round_up_rejects_bad_input(n, g):
    with pytest.raises(ValueError):
        round_up(n, g)


def test_undo_stack_runs_in_reverse_on_failure_and_not_after_commit():
    log: list[str] = []
    with pytest.raises(RuntimeError), UndoStack() as undo:
        undo.push(log.append, "release")
        undo.push(log.append, "free")
        undo.push(log.append, "unmap")
        raise RuntimeError("step 4 failed")
    assert log == ["unmap", "free", "release"]
    log.clear()
    with UndoStack() as undo:
        undo.push(log.append, "release")
        undo.commit()
    assert log == []


def test_undo_stack_keeps_going_when_a_step_fails():
    log: list[str] = []

    def boom() -> None:
        raise OSError("cannot")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyError), UndoStack() as undo:
            undo.push(log.append, "first")
            undo.push(boom)
            raise KeyError("x")
    assert log == ["first"]
    assert [w.category for w in caught] == [cip.TeardownWarning]


@pytest.mark.parametrize(
    "exc",
    [
        cip.CudaError("cuMemMap", 1, "CUDA_ERROR_INVALID_VALUE", "detail"),
        cip.CudaOutOfMemoryError("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY"),
        cip.TransportError(1, "pidfd_getfd: not permitted"),
        cip.PeerRefusedError("uid 1000 refused"),
        cip.SlotFullError(100, 10, 3, 1024),
        cip.SlotBusyError("slot 1 busy"),
        cip.DescriptorError("bad"),
        cip.EndOfStream("gone"),
    ],
)
def test_errors_pickle(exc):
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    if isinstance(exc, OSError):
        assert back.errno == exc.errno


def test_cuda_error_names_call_and_enum():
    e = cip.CudaError("cuMemMap", 1, "CUDA_ERROR_INVALID_VALUE")
    assert str(e).startswith("cuMemMap: CUDA_ERROR_INVALID_VALUE")
    assert isinstance(cip.CudaOutOfMemoryError("x", 2, "y"), MemoryError)
