"""CPU tier: the command line (version, names, help, the demo's report) without a GPU."""

from __future__ import annotations

import argparse
import os
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


# -- the command line's own surface: version, program name, descriptions, defaults ------


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120, check=False)


def _script() -> str:
    """The installed ``cupy-ipcpool`` script beside this interpreter (skip if not installed)."""
    path = os.path.join(os.path.dirname(sys.executable), "cupy-ipcpool")
    if not os.access(path, os.X_OK):
        pytest.skip(f"the cupy-ipcpool script is not installed beside {sys.executable}")
    return path


def test_version_prints_the_package_version():
    from cupy_ipcpool import __version__

    out = _run(sys.executable, "-m", "cupy_ipcpool", "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"cupy_ipcpool {__version__}"


def test_each_way_of_starting_names_itself_in_usage():
    out = _run(sys.executable, "-m", "cupy_ipcpool", "demo", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m cupy_ipcpool demo ")
    script = _script()
    out = _run(script, "demo", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: cupy-ipcpool demo ")
    out = _run(script, "no-such-command")
    assert out.returncode == 2
    assert "cupy-ipcpool: error:" in out.stderr and "python -m" not in out.stderr


@pytest.mark.parametrize(
    ("argv0", "name"),
    [
        ("/usr/lib/python3/site-packages/cupy_ipcpool/__main__.py", "python -m cupy_ipcpool"),
        ("/opt/venv/bin/cupy-ipcpool", "cupy-ipcpool"),
        ("-c", "python -m cupy_ipcpool"),
        ("", "python -m cupy_ipcpool"),
    ],
)
def test_program_name(argv0, name):
    from cupy_ipcpool.__main__ import program_name

    assert program_name(argv0) == name


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from cupy_ipcpool.__main__ import build_parser

    parser = build_parser(prog="cupy-ipcpool")
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_command_has_a_description():
    commands = _subparsers()
    assert set(commands) >= {"info", "demo", "bench", "relay", "serve"}
    for name, parser in commands.items():
        text = parser.format_help()
        assert parser.description and len(parser.description) > 40, name
        assert " ".join(parser.description.split()[:4]) in " ".join(text.split()), name


@pytest.mark.parametrize("command", ["info", "demo", "bench"])
def test_help_shows_every_default(command):
    parser = _subparsers()[command]
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if not action.option_strings or action.default in (None, argparse.SUPPRESS):
            continue
        if action.default is False:  # a flag
            continue
        assert action.help, f"{command} {action.option_strings[0]} has no help text"
        assert f"(default: {action.default})" in text, (command, action.option_strings, text)


def test_demo_help_names_its_defaults_without_a_gpu():
    out = _run(sys.executable, "-m", "cupy_ipcpool", "demo", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for default in ("(default: 8.0)", "(default: 8)", "(default: 2)", "(default: block)"):
        assert default in text, default
    assert "handoff" in text and "queued" in text


# -- the demo's report (pure functions; the demo itself needs a GPU) ----------------------


def test_split_latency_separates_the_handoff_from_the_time_in_the_ring():
    from cupy_ipcpool._demo import split_latency

    # the consumer was already waiting in recv when the frame was published
    assert split_latency(published_ns=1_000, asked_ns=400, returned_ns=1_090) == (90, 0)
    # the frame waited 2 ms in the ring for a busy consumer, then recv took 15 us
    assert split_latency(published_ns=1_000, asked_ns=2_001_000, returned_ns=2_016_000) == (
        15_000,
        2_000_000,
    )
    handoff, queued = split_latency(5, 7, 20)
    assert handoff + queued == 20 - 5


def test_progress_line_reports_both_figures_apart():
    from cupy_ipcpool._demo import progress_line

    # 98 frames: handoff 100 us, queued 2 ms; two slow ones (the p99's rank reads them)
    samples = [(100_000, 2_000_000)] * 98 + [(300_000, 5_000_000)] * 2
    line = progress_line(3.0, 12_345, 10_000.4, [12_000, 11_990], samples)
    assert "published    12345" in line and "10000 frames/s" in line
    assert "received 12000/11990" in line
    assert "handoff p50   100.0 us  p99   300.0 us" in line
    assert "queued p50  2000.0 us  p99  5000.0 us" in line
    assert "latency p50" not in line  # no figure that mixes the two


def _summary(**overrides):
    from cupy_ipcpool._demo import summary_lines

    kwargs = dict(
        published=1000,
        elapsed_s=2.0,
        frame_bytes=8 << 20,
        mode="block",
        done={0: (1000, 0), 1: (1000, 0)},
        received=[1000, 1000],
        failures=[],
        samples=[(90_000, 1_500_000)] * 10,
    )
    kwargs.update(overrides)
    return summary_lines(**kwargs)


def test_summary_says_what_each_figure_is():
    from cupy_ipcpool._demo import FIGURES

    ok, lines = _summary()
    text = "\n".join(lines)
    assert ok
    assert "published 1000 frames in 2.0 s (500 frames/s, 8.4 GB/s" in text
    assert "handoff p50    90.0 us" in text and "queued p50  1500.0 us" in text
    for figure in FIGURES:
        assert figure in text
    handoff, queued = FIGURES
    assert handoff.startswith("handoff:") and "what the channel costs" in handoff
    assert queued.startswith("queued:") and "--slots" in queued and "not the channel" in queued
    assert lines[-1] == (
        "every received frame verified: YES (block mode: all 1000 frames delivered to every "
        "consumer)"
    )


def test_summary_fails_a_lost_frame_a_mismatch_and_a_consumer_that_did_not_finish():
    ok, lines = _summary(done={0: (1000, 0), 1: (999, 0)})
    assert not ok and lines[-1] == "every received frame verified: NO"
    ok, lines = _summary(mode="latest", done={0: (1000, 0), 1: (640, 0)})
    assert ok  # latest mode skips frames by design
    ok, lines = _summary(done={0: (1000, 0), 1: (1000, 3)})
    assert not ok and "  consumer 1: received 1000 frames, 3 mismatching bytes" in lines
    ok, lines = _summary(done={0: (1000, 0)}, failures=["consumer 1: EndOfStream: gone"])
    assert not ok
    assert "  consumer 1: received 1000 frames, did not finish" in lines
    assert "  consumer 1: EndOfStream: gone" in lines


def test_info_note_points_at_headings_that_exist():
    import pathlib

    from cupy_ipcpool import _info

    note = _info.mps_summary([False])
    assert note is not None and "docs/performance.md" in note
    page = pathlib.Path(__file__).resolve().parent.parent / "docs" / "performance.md"
    headings = [
        line[3:].strip() for line in page.read_text().splitlines() if line.startswith("## ")
    ]
    for quoted in ("Sizing the ring", "MPS"):
        assert f"'{quoted}'" in note and quoted in headings, (quoted, headings)
