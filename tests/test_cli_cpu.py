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


def test_info_mps_field_and_note():
    from cupy_ipcpool import _info

    assert [_info.mps_text(v) for v in (True, False, None)] == ["yes", "no", "unknown"]
    # every device shared through MPS: nothing to say
    assert _info.mps_summary([True, True]) is None
    # one device time-sliced, or the driver did not say: the note, naming where to read on
    for flags in ([False], [True, False], [None], []):
        note = _info.mps_summary(flags)
        assert note is not None and "Sizing the ring" in note and "MPS" in note
