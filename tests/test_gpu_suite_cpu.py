"""CPU tier: the GPU suite's own rules, checked where no GPU is needed.

Tests that compare the device's free memory (which is device-wide) must run
alone: they carry ``@pytest.mark.device_memory``, and ``scripts/gpu-test``
runs the parallel pass without them and then runs them one at a time.  A
test that reads the free memory, directly or through a helper of its module,
without the marker would fail whenever another worker allocates; this finds
it before the GPU does.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
GPU_FILES = sorted(TESTS.glob("test_*_gpu.py"))
FREE_MEMORY_READERS = {"device_free", "mem_info", "memGetInfo"}


def _names_called(node: ast.AST) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            names.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
        elif isinstance(sub, ast.Name):  # a helper passed as a child process's target
            names.add(sub.id)
    return names


def _marks(fn: ast.FunctionDef) -> set[str]:
    marks = set()
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute):
            marks.add(target.attr)
    return marks


def _tests_reading_free_memory(path: pathlib.Path) -> dict[str, bool]:
    """Per test function that reads the free memory: whether it carries the marker."""
    tree = ast.parse(path.read_text())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    readers: set[str] = set()
    changed = True
    while changed:  # helpers that call helpers
        changed = False
        for name, fn in functions.items():
            if name not in readers and _names_called(fn) & (FREE_MEMORY_READERS | readers):
                readers.add(name)
                changed = True
    return {
        name: "device_memory" in _marks(fn)
        for name, fn in functions.items()
        if name.startswith("test_") and name in readers
    }


def test_the_gpu_files_are_found() -> None:
    assert len(GPU_FILES) >= 10, GPU_FILES


@pytest.mark.parametrize("path", GPU_FILES, ids=[p.name for p in GPU_FILES])
def test_every_test_reading_free_memory_runs_alone(path: pathlib.Path) -> None:
    unmarked = [name for name, marked in _tests_reading_free_memory(path).items() if not marked]
    assert not unmarked, f"{path.name}: mark these @pytest.mark.device_memory: {unmarked}"


def test_the_known_free_memory_tests_are_seen() -> None:
    # the scan itself works: it finds the tests known to compare free memory
    found = _tests_reading_free_memory(TESTS / "test_pool_gpu.py")
    assert found.get("test_200_create_close_cycles_do_not_grow") is True
    found = _tests_reading_free_memory(TESTS / "test_peer_gpu.py")
    assert found.get("test_500_attach_close_cycles_do_not_grow") is True  # through a helper


def test_gpu_test_runs_the_marked_tests_after_the_parallel_pass() -> None:
    script = (TESTS.parent / "scripts" / "gpu-test").read_text()
    assert "not device_memory" in script and "-m device_memory" in script


def test_the_benchmark_suite_collects_on_its_own() -> None:
    """``pytest benchmarks`` (as ``scripts/gpu-test`` runs it) imports every module.

    The benchmarks borrow helpers from tests/ by their package path; a helper
    that imports a sibling by its bare name works inside the test suite (which
    puts tests/ on the path) and breaks the benchmark suite's collection.
    """
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist"]
    done = subprocess.run(
        [*command, "-q", "--collect-only", "benchmarks"],
        cwd=TESTS.parent,
        # as from a shell: not as an xdist worker of this run (PYTEST_XDIST_WORKER and the
        # like make pytest-benchmark warn, which the suite's settings turn into an error)
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " collected" in done.stdout or "tests collected" in done.stdout, done.stdout[-500:]
