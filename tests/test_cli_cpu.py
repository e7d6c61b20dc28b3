"""CPU tier: the command line (version, names, help, errors, the demo's report) without a GPU.

The error tests run the command line's ``main()`` in a child process, with
``CUDA_VISIBLE_DEVICES=""`` (so a machine with a GPU behaves as one without):
a usage error exits 2 and a runtime error 1, each with exactly one line on
stderr and no traceback; ``--debug`` shows the traceback.  The child forks
from a server that imported the package once (``tests/_cli_child.py``), which
gives what ``python -m cupy_ipcpool`` gives (the exit status, fds 1 and 2)
in a tenth of the time; a sample of commands is run both ways and compared,
and the tests of ``--help``, ``--version`` and the program's name start the
real interpreter and the installed script.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests import _cli_child
from tests._foreign import foreign_server
from tests.skips import needs_ucx

PROG = "python -m cupy_ipcpool"
SECRET = "0123456789abcdef-cli-test"


def _cli_env(secret: str | None) -> dict[str, str]:
    """This environment without a GPU, its secret ``secret`` (none: unset)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("CUPY_IPCPOOL_SECRET", None)
    if secret is not None:
        env["CUPY_IPCPOOL_SECRET"] = secret
    return env


def _cli(
    *argv: str,
    secret: str | None = None,
    timeout: float = 120,
    env_extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m cupy_ipcpool ARGV`` without a GPU and without a secret in the env.

    Run as :mod:`tests._cli_child` runs it: ``main()`` in a forked child.
    ``env_extra``: more environment variables.
    """
    return _cli_child.run(list(argv), {**_cli_env(secret), **(env_extra or {})}, timeout)


def _python_m(*argv: str, secret: str | None = None) -> subprocess.CompletedProcess[str]:
    """The same in a fresh ``python -m cupy_ipcpool`` interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "cupy_ipcpool", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=_cli_env(secret),
        check=False,
    )


def _one_error_line(out: subprocess.CompletedProcess[str], status: int) -> str:
    """The one stderr line of a command that failed with ``status`` (asserting there is one)."""
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert out.returncode == status, (out.returncode, out.stderr)
    return lines[0]


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_gpu_commands_say_no_gpu_in_one_line_on_stderr_and_fail(command, tmp_path):
    out = _cli(command, "--outdir", str(tmp_path)) if command == "bench" else _cli(command)
    line = _one_error_line(out, 1)
    assert line.startswith("no GPU:"), line
    assert out.stdout == ""
    assert not os.listdir(tmp_path)


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


# -- errors: one line on stderr, exit 2 for a usage error (naming the flag), 1 otherwise -----


#: What the ``files`` fixture puts in its directory (a usage error adds nothing).
FILES = {"short.secret", "empty.secret", "good.secret"}


@pytest.fixture(scope="module")
def files() -> Iterator[dict[str, str]]:
    """A regular file, an empty secret file, a short one and a good one."""
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        paths = {}
        for name, text in (("short", "short\n"), ("empty", ""), ("good", SECRET + "\n")):
            paths[name] = os.path.join(tmp, f"{name}.secret")
            with open(paths[name], "w") as f:
                f.write(text)
        paths["file"] = paths["good"]
        paths["dir"] = tmp
        yield paths


#: (argv, what the error line must name); ``{x}`` is a path of the ``files`` fixture.
USAGE_ERRORS = [
    ((), "COMMAND"),
    (("no-such-command",), "COMMAND"),
    (("demo", "--slots", "0"), "--slots"),
    (("demo", "--slots", "1"), "--slots"),
    (("demo", "--slots", "100000"), "--slots"),
    (("demo", "--consumers", "0"), "--consumers"),
    (("demo", "--consumers", "-1"), "--consumers"),
    (("demo", "--consumers", "two"), "--consumers"),
    (("demo", "--frame-mib", "0"), "--frame-mib"),
    (("demo", "--frame-mib", "nan"), "--frame-mib"),
    (("demo", "--duration", "-1"), "--duration"),
    (("demo", "--duration", "inf"), "--duration"),
    (("demo", "--device", "-1"), "--device"),
    (("demo", "--mode", "fastest"), "--mode"),
    (("bench", "--iters", "0"), "--iters"),
    (("bench", "--device", "-1"), "--device"),
    (("bench", "--sizes", "0"), "--sizes"),
    (("bench", "--lanes", "nope"), "--lanes"),
    (("bench", "--outdir", "{file}"), "--outdir"),
    (("serve",), "PATH"),
    (("serve", "/tmp/no-such.sock"), "--secret-file"),
    (("serve", "/tmp/no-such.sock", "--secret-file", "{dir}/absent"), "--secret-file"),
    (("serve", "/tmp/no-such.sock", "--secret-file", "{dir}"), "--secret-file"),
    (("serve", "/tmp/no-such.sock", "--secret-file", "{empty}"), "--secret-file"),
    (("serve", "/tmp/no-such.sock", "--secret-file", "{short}"), "--secret-file"),
    (("serve", "/tmp/no-such.sock", "--insecure", "--listen", "127.0.0.1:99999"), "--listen"),
    (("serve", "/tmp/no-such.sock", "--insecure", "--listen", "nohost"), "--listen"),
    (("serve", "/tmp/no-such.sock", "--insecure", "--listen", "192.0.2.1:5000"), "--listen"),
    (("serve", "/tmp/no-such.sock", "--insecure", "--device", "-1"), "--device"),
    (("serve", "/tmp/no-such.sock", "--insecure", "--memory", "gpu"), "--memory"),
    (("relay", "ucx://127.0.0.1:1"), "PATH"),
    (("relay", "http://127.0.0.1:1", "{dir}/r.sock", "--insecure"), "REMOTE"),
    (("relay", "ucx://127.0.0.1:99999", "{dir}/r.sock", "--insecure"), "REMOTE"),
    (("relay", "ucx://127.0.0.1:1", "/no-such-dir/r.sock", "--insecure"), "PATH"),
    (("relay", "ucx://127.0.0.1:1", "{dir}/r.sock", "--insecure", "--slots", "0"), "--slots"),
    (("relay", "ucx://127.0.0.1:1", "{dir}/r.sock", "--memory", "host"), "--secret-file"),
    (("relay", "ucx://127.0.0.1:1", "{dir}/r.sock", "--secret-file", "{short}"), "--secret-file"),
    # issue 45, point 4: each loose end of the command line is a usage error naming its flag
    (("--bogus",), "unrecognized arguments: --bogus"),
    (("--debug", "--bogus"), "unrecognized arguments: --bogus"),
    (("--debug",), "COMMAND"),
    (("serve", "", "--insecure"), "argument PATH: the socket path is empty"),
    (("serve", "{file}", "--insecure"), "argument PATH: {file} is not a socket"),
    (("serve", "{dir}", "--insecure"), "argument PATH: {dir} is not a socket"),
    (("serve", "{file}/x.sock", "--insecure"), "argument PATH"),
    (("serve", "/tmp/" + "s" * 103, "--insecure"), "argument PATH: the socket path"),
    (("relay", "ucx://127.0.0.1:1", "", "--insecure", "--memory", "host"), "argument PATH"),
    (("relay", "ucx://127.0.0.1:1", "{file}", "--insecure", "--memory", "host"), "argument PATH"),
    (("relay", "ucx://127.0.0.1:1", "{dir}/" + "r" * 120, "--insecure"), "argument PATH"),
    (("relay", "ucx://127.0.0.1", "{dir}/r.sock", "--insecure"), "argument REMOTE"),
    (("relay", "ucx://127.0.0.1:0", "{dir}/r.sock", "--insecure"), "argument REMOTE"),
    (("relay", "127.0.0.1:13337", "{dir}/r.sock", "--insecure"), "argument REMOTE"),
    (("serve", "/tmp/no-such.sock", "--insecure", "--listen", "127.0.0.1"), "--listen"),
    (("serve", "/tmp/no-such.sock", "--insecure", "--secret-file", "{good}"), "--insecure"),
    (("serve", "/tmp/no-such.sock", "--secret-file", "{good}", "--insecure"), "--insecure"),
    (
        ("relay", "ucx://127.0.0.1:1", "{dir}/r.sock", "--insecure", "--secret-file", "{good}"),
        "--insecure",
    ),
    (("bench", "--gpu-clock", "--mode", "short", "--outdir", "{dir}"), "--mode"),
    (("bench", "--gpu-clock", "--no-scale", "--outdir", "{dir}"), "--no-scale"),
    (("bench", "--lanes", "cupy_ipcpool,,host_staging", "--outdir", "{dir}"), "--lanes"),
    (("bench", "--lanes", "cupy_ipcpool,", "--outdir", "{dir}"), "--lanes"),
    (("bench", "--sizes", "1,,64", "--outdir", "{dir}"), "--sizes"),
    (("bench", "--outdir", "/proc/cupy-ipcpool-bench"), "--outdir"),  # os.access: yes, for root
    (("bench", "--outdir", "{file}/out"), "--outdir"),
    (("demo", "--frame-mib", "1e-9"), "--frame-mib"),
    (("demo", "--frame-mib", "1e308"), "--frame-mib"),
    (("demo", "--frame-mib", "0.001"), "--frame-mib"),
]


#: Commands run both ways, forked and as a fresh ``python -m`` (one of each kind of ending).
BOTH_WAYS = [
    ("demo", "--slots", "0"),  # a usage error of a command
    ("--bogus",),  # the parser's own
    ("demo",),  # a runtime error: no GPU
    ("serve", "/tmp/no-such-publisher.sock", "--insecure"),  # one after a connect
    ("--version",),  # argparse's exit 0, on stdout
    ("relay", "--help"),
    ("--debug", "serve", "/tmp/no-such.sock"),  # an uncaught exception
]


@pytest.mark.parametrize("argv", BOTH_WAYS, ids=" ".join)
def test_the_forked_command_line_ends_as_python_m_does(argv):
    forked, fresh = _cli(*argv), _python_m(*argv)
    assert forked.returncode == fresh.returncode, (forked.stderr, fresh.stderr)
    assert forked.stdout == fresh.stdout
    if "Traceback" in fresh.stderr:  # the frames above main() differ (runpy vs. the fork)
        assert "Traceback (most recent call last)" in forked.stderr
        assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1]
    else:
        assert forked.stderr == fresh.stderr


@pytest.mark.parametrize(("argv", "flag"), USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_a_usage_error_is_one_line_naming_the_flag_before_any_gpu(argv, flag, files):
    out = _cli(*(a.format(**files) for a in argv))
    line = _one_error_line(out, 2)
    command = argv[0] if argv and argv[0] in ("demo", "bench", "serve", "relay") else None
    prefix = f"{PROG} {command}: error: " if command else f"{PROG}: error: "
    assert line.startswith(prefix), line
    assert flag.format(**files) in line, line
    assert out.stdout == ""
    assert set(os.listdir(files["dir"])) == FILES  # nothing made before the usage error


def test_the_usage_errors_say_what_is_wrong_and_what_to_give(files):
    """The words of the new usage errors: the range, the default port, the conflict."""
    line = _one_error_line(_cli("demo", "--frame-mib", "1e-9"), 2)
    assert "must be in 0.00390625..8388607" in line and "got 1e-9" in line, line
    line = _one_error_line(_cli("relay", "ucx://h", files["dir"] + "/r.sock", "--insecure"), 2)
    assert "has no port" in line and "13337" in line, line
    line = _one_error_line(_cli("relay", "h:5", files["dir"] + "/r.sock", "--insecure"), 2)
    assert "has no scheme: give ucx://h:5" in line, line
    line = _one_error_line(_cli("relay", "ucx://h:0", files["dir"] + "/r.sock", "--insecure"), 2)
    assert "port 0" in line, line
    long = "/tmp/" + "s" * 103
    line = _one_error_line(_cli("serve", long, "--insecure"), 2)
    assert "108 bytes long" in line and "at most 107 bytes" in line and "/tmp" in line, line
    line = _one_error_line(_cli("bench", "--lanes", "cupy_ipcpool,,host_staging"), 2)
    assert "empty lane" in line, line
    line = _one_error_line(_cli("bench", "--gpu-clock", "--mode", "short"), 2)
    assert "argument --mode: not with --gpu-clock" in line, line


def test_insecure_with_a_secret_in_the_environment_is_a_usage_error(files):
    for argv in (
        ("serve", "/tmp/no-such.sock", "--insecure"),
        ("relay", "ucx://127.0.0.1:1", files["dir"] + "/r.sock", "--insecure", "--memory", "host"),
    ):
        line = _one_error_line(_cli(*argv, secret=SECRET), 2)
        assert line.startswith(f"{PROG} {argv[0]}: error: argument --insecure:"), line
        assert "$CUPY_IPCPOOL_SECRET is set" in line, line


def test_info_without_a_gpu_gives_its_reason_on_stderr():
    out = _cli("info")
    line = _one_error_line(out, 1)  # docs/install.md: one line on stderr
    assert line.startswith(("no GPU:", "no usable GPU:")), line
    assert "pidfd_getfd:" in out.stdout and "compiled parts:" in out.stdout  # the report
    assert "no GPU" not in out.stdout, out.stdout


def test_relay_help_gives_the_default_port():
    out = _run(sys.executable, "-m", "cupy_ipcpool", "relay", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "REMOTE ucx://host:port of the remote server (serve listens on port 13337" in text


@pytest.mark.parametrize("memory", ["host", "device"])
def test_serve_says_a_socket_that_is_no_publisher_is_not_one(tmp_path, memory):
    path = str(tmp_path / "other.sock")
    with foreign_server(path, socket.SOCK_SEQPACKET, b"<!DOCTYPE html>"):
        out = _cli("serve", path, "--insecure", "--memory", memory, "--listen", "127.0.0.1:0")
    line = _one_error_line(out, 1)
    assert f"{path} is not a cupy_ipcpool publisher: it answered b'<!DOCTYPE html>'" in line, line
    assert line.endswith("(bad magic 0x213c, expected 0x4950)"), line
    assert line.count("cupy_ipcpool publisher") == 1, line
    os.unlink(path)
    with foreign_server(path, socket.SOCK_STREAM):
        out = _cli("serve", path, "--insecure", "--memory", memory, "--listen", "127.0.0.1:0")
    line = _one_error_line(out, 1)
    assert f"{path} is not a cupy_ipcpool publisher: its socket is of another type" in line, line
    assert line.count("cupy_ipcpool publisher") == 1, line


def test_the_remote_handshake_names_a_peer_that_is_not_a_server():
    """The remote client's first read (the relay's, a remote subscriber's): a peer that
    answers in another protocol is named as no cupy_ipcpool server, not as a bad magic."""
    import time

    from cupy_ipcpool import ProtocolError
    from cupy_ipcpool.remote import _io

    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"<!DOCTYPE html>")
        with pytest.raises(ProtocolError) as raised:
            _io.recv_message(
                a, time.monotonic() + 5, foreign="ucx://h:1 is not a cupy_ipcpool server"
            )
    text = str(raised.value)
    assert text.startswith("ucx://h:1 is not a cupy_ipcpool server: it answered b'<!DOCTYP'"), text
    assert "magic" not in text


@needs_ucx
def test_relay_names_a_server_that_is_not_cupy_ipcpool(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]

        def answer() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"<!DOCTYPE html>\n")
                conn.recv(4096)

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        out = _cli(
            "relay", f"ucx://127.0.0.1:{port}", str(tmp_path / "r.sock"), "--insecure",
            "--memory", "host",
        )  # fmt: skip
        thread.join(5)
    line = _one_error_line(out, 1)
    assert f"ucx://127.0.0.1:{port} is not a cupy_ipcpool server" in line, line


def test_no_secret_names_the_flags_not_the_api():
    line = _one_error_line(_cli("serve", "/tmp/no-such.sock"), 2)
    for words in ("$CUPY_IPCPOOL_SECRET", "--secret-file", "--insecure"):
        assert words in line, line
    assert "secret=" not in line and "insecure=True" not in line


def test_a_short_secret_in_the_environment_names_it():
    line = _one_error_line(_cli("serve", "/tmp/no-such.sock", secret="short"), 2)
    assert "$CUPY_IPCPOOL_SECRET" in line and "5 bytes" in line and "16" in line, line


def test_a_taken_port_is_a_usage_error_of_listen():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = _cli("serve", "/tmp/no-such.sock", "--insecure", "--listen", f"127.0.0.1:{port}")
    line = _one_error_line(out, 2)
    assert "--listen" in line and "in use" in line, line


def _ucx_missing() -> str | None:
    from cupy_ipcpool.remote import _ucx

    return _ucx.available()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_no_publisher_at_the_path_is_a_runtime_error():
    line = _one_error_line(_cli("serve", "/tmp/no-such-publisher.sock", "--insecure"), 1)
    assert "cannot connect to the publisher at /tmp/no-such-publisher.sock" in line, line


def test_a_refused_connection_is_a_runtime_error(tmp_path):
    url = f"ucx://127.0.0.1:{_closed_port()}"
    out = _cli("relay", url, str(tmp_path / "r.sock"), "--insecure", "--memory", "host")
    line = _one_error_line(out, 1)
    if _ucx_missing() is None:
        assert f"cannot connect to the remote server at {url}: Connection refused" in line, line
    else:  # without UCXX the relay says what to install, in one line too
        assert "remote extra" in line, line


def test_an_unknown_host_is_a_runtime_error(tmp_path):
    out = _cli(
        "relay", "ucx://no-such-host.invalid:1", str(tmp_path / "r.sock"), "--insecure",
        "--memory", "host",
    )  # fmt: skip
    line = _one_error_line(out, 1)
    assert "no-such-host.invalid" in line if _ucx_missing() is None else "remote extra" in line


def test_device_memory_needs_a_gpu_before_anything_connects(tmp_path):
    url = f"ucx://127.0.0.1:{_closed_port()}"
    line = _one_error_line(_cli("relay", url, str(tmp_path / "r.sock"), "--insecure"), 1)
    assert line.startswith("no GPU:"), line
    line = _one_error_line(_cli("serve", "/tmp/no-such.sock", "--insecure", "--device", "0"), 1)
    assert line.startswith("no GPU:"), line


@contextlib.contextmanager
def host_publisher(path: str) -> Iterator[Any]:
    """A host-memory channel at ``path``, admitting subscribers from a thread of this process."""
    from cupy_ipcpool.remote import HostChannelPublisher

    pub = HostChannelPublisher(path, 4, 1 << 16)
    stop = threading.Event()

    def admit() -> None:
        while not stop.is_set():
            pub.poll(0.02)

    thread = threading.Thread(target=admit, daemon=True)
    thread.start()
    try:
        yield pub
    finally:
        stop.set()
        thread.join(5)
        pub.close()


def test_device_memory_against_a_host_channel_names_memory(tmp_path):
    path = str(tmp_path / "cam.sock")
    with host_publisher(path):
        out = _cli("serve", path, "--insecure", "--listen", "127.0.0.1:0")
    line = _one_error_line(out, 2)
    assert line.startswith(f"{PROG} serve: error: argument --memory:"), line
    assert "carries host memory" in line and "--memory host" in line, line
    assert "WELCOME" not in line


@needs_ucx
def test_a_refused_secret_is_told_in_the_flags_words(tmp_path):
    from cupy_ipcpool.remote import serve

    path = str(tmp_path / "cam.sock")
    with host_publisher(path), serve(path, memory="host", listen="127.0.0.1:0", insecure=True) as s:
        out = _cli("relay", s.address, str(tmp_path / "r.sock"), "--memory", "host", secret=SECRET)
    line = _one_error_line(out, 1)
    assert "does not prove the shared secret" in line and "--insecure" in line, line
    assert "insecure=True" not in line


def test_library_words_become_flags():
    from cupy_ipcpool.__main__ import in_flag_words

    text = in_flag_words(
        "the server at ucx://h:1 requires a shared secret: pass secret=...; "
        "refusing it (insecure=True accepts such a server)"
    )
    assert "secret=" not in text and "insecure=True" not in text
    assert "--secret-file FILE" in text and "$CUPY_IPCPOOL_SECRET" in text
    assert "(--insecure accepts such a server)" in text


def test_an_unexpected_error_is_one_line_that_points_at_debug():
    from cupy_ipcpool.__main__ import error_line

    line = error_line(KeyError("x\ny"))
    assert "\n" not in line and line.startswith("KeyError:") and "--debug" in line


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(where):
    argv = ["serve", "/tmp/no-such-publisher.sock", "--insecure"]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    out = _cli(*argv)
    assert out.returncode == 1
    assert "Traceback (most recent call last)" in out.stderr
    assert "TransportError" in out.stderr and "cannot connect to the publisher" in out.stderr


def test_debug_shows_the_traceback_of_a_usage_error_found_after_parsing():
    out = _cli("--debug", "serve", "/tmp/no-such.sock")
    assert out.returncode == 1  # Python's own status for an uncaught exception
    assert "Traceback" in out.stderr and "ArgumentError" in out.stderr


def test_help_documents_debug_and_the_exit_status():
    out = _run(sys.executable, "-m", "cupy_ipcpool", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "--debug" in text and "traceback" in text
    assert "Exit status" in text and "2 for a usage error" in text
    for command in ("demo", "serve"):
        sub = _run(sys.executable, "-m", "cupy_ipcpool", command, "--help")
        assert "--debug" in sub.stdout, command


def test_info_says_how_to_install_the_remote_extra_from_a_checkout(monkeypatch):
    from cupy_ipcpool import _info

    monkeypatch.setattr(_info, "_version", lambda dist: "not installed")
    line = _info.remote_summary()
    assert "python3 -m pip install -e '.[remote-cu13]' (CUDA 13)" in line, line
    assert "-e '.[remote-cu12]' (CUDA 12)" in line, line
    assert "cupy_ipcpool[remote" not in line


@pytest.mark.parametrize(
    ("tls", "words"),
    [
        ("", "staged through cudaMalloc buffers to and from peers on this machine"),
        ("all", "staged through cudaMalloc buffers"),
        ("tcp,cuda_copy", "the slots themselves (UCX_TLS=tcp,cuda_copy leaves out cuda_ipc)"),
    ],
)
def test_info_says_how_remote_device_frames_travel(monkeypatch, tls, words):
    from cupy_ipcpool import _info

    monkeypatch.setenv("UCX_TLS", tls)
    assert words in _info.remote_device_path()
    out = _cli("info", env_extra={"UCX_TLS": tls})
    assert words in out.stdout, out.stdout


def test_the_docs_give_the_install_that_works():
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    for page in ("remote.md", "install.md"):
        lines = (root / "docs" / page).read_text().splitlines()
        assert any("python3 -m pip install -e '.[remote-cu13]'" in line for line in lines), page
        assert any("'.[remote-cu12]'" in line for line in lines), page
        # no command to copy that asks an index for the package
        assert not any(line.startswith("python3 -m pip install 'cupy_ipcpool") for line in lines)
    # one extra per CUDA major (pyproject.toml): the GPU stack, and UCXX with it
    install = (root / "docs" / "install.md").read_text()
    assert "python3 -m pip install -e '.[cu13]'" in install
    assert "python3 -m pip install -e '.[cu12]'" in install
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = page.read_text()
        assert "remote]" not in text, f"{page.name} names the extra 'remote', which is gone"


def test_parse_errors_are_one_line_without_the_usage_block(capsys):
    from cupy_ipcpool.__main__ import build_parser

    parser = build_parser(prog="cupy-ipcpool")
    with pytest.raises(SystemExit) as raised:
        parser.parse_args(["demo", "--slots", "0"])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err == "cupy-ipcpool demo: error: argument --slots: must be in 2..252, got 0\n"
