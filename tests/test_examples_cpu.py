"""The examples that run without a GPU, run as their docs say (a subprocess each)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from skips import needs_ucx

from cupy_ipcpool.remote import available

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = ROOT / "examples" / "remote_loopback.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(LOOPBACK), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@needs_ucx
@pytest.mark.timeout(150)
def test_remote_loopback_example_checks_every_frame() -> None:
    done = run("--frames", "20")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "20 of 20 frames checked out" in done.stdout


@pytest.mark.skipif(available() is None, reason="UCXX is installed: the example runs instead")
@pytest.mark.timeout(150)
def test_remote_loopback_example_says_it_needs_ucxx() -> None:
    done = run()
    assert done.returncode == 2, done.stdout + done.stderr
    assert "UCXX is not available" in done.stderr
    assert "pip install -e '.[remote-cu13]'" in done.stderr
    assert "'.[remote-cu12]' (CUDA 12)" in done.stderr


@pytest.mark.parametrize("frames", ["-3", "0", "many"])
def test_remote_loopback_example_refuses_a_frame_count_below_one(frames: str) -> None:
    # a usage error, before UCXX is looked for: exit 2 naming the flag
    done = run("--frames", frames)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "argument --frames:" in done.stderr and "UCXX" not in done.stderr, done.stderr
    assert done.stdout == ""
