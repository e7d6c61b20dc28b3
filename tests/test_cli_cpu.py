"""CPU tier: the command line says what is missing without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.skips import no_driver


@no_driver
@pytest.mark.parametrize("command", ["demo", "bench"])
def test_gpu_commands_say_no_gpu_in_one_line_and_fail(command):
    out = subprocess.run(
        [sys.executable, "-m", "cupy_ipcpool", command], capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, out.stdout
    assert lines[0].startswith("no GPU:")


def test_help_lists_the_commands():
    out = subprocess.run(
        [sys.executable, "-m", "cupy_ipcpool", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0
    for command in ("info", "demo", "bench"):
        assert command in out.stdout
