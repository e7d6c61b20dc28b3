"""CPU tier: the maintainer scripts in ``scripts/`` answer ``--help`` anywhere and are documented.

The diagnostics run on a GPU machine, but a person reading about them first
asks for their options: ``--help`` must work without a GPU, a driver or a
build, and docs/testing.md must name every script that is there.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))


def test_there_are_scripts_to_check() -> None:
    assert SCRIPTS, "scripts/*.py not found beside tests/"
    assert (ROOT / "scripts" / "gpu-test").is_file()


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_help_works_without_a_gpu(script: pathlib.Path) -> None:
    # no device visible, whatever this machine has: --help must not touch CUDA
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, str(script), "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: "), out.stdout[:500]
    assert "Traceback" not in out.stderr


def test_testing_md_names_every_script() -> None:
    text = (ROOT / "docs" / "testing.md").read_text()
    missing = [p.name for p in [*SCRIPTS, ROOT / "scripts" / "gpu-test"] if p.name not in text]
    assert not missing, f"docs/testing.md does not describe: {missing}"


SHELL_SCRIPTS = [ROOT / "scripts" / "gpu-test", ROOT / "scripts" / "gpu-clock"]


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=[p.name for p in SHELL_SCRIPTS])
def test_shell_scripts_answer_help_and_refuse_arguments_without_running(
    script: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """``--help`` prints the script's usage and runs nothing (before, it started the whole
    run); an argument it does not take is refused with exit 2, also before anything runs."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON="/nonexistent-python")
    out = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=30, env=env
    )
    assert out.returncode == 0, out.stderr
    assert "$OUT" in out.stdout and "#" not in out.stdout.splitlines()[0]
    assert not (tmp_path / "out").exists(), "--help started a run"
    bad = subprocess.run(
        [str(script), "--bogus"], capture_output=True, text=True, timeout=30, env=env
    )
    assert bad.returncode == 2
    assert "--bogus" in bad.stderr and "--help" in bad.stderr
    assert not (tmp_path / "out").exists()


def test_setup_py_says_which_setuptools_it_needs() -> None:
    """A build without isolation under an old setuptools (a plain venv's) stops with what
    to do, not pyproject's 'invalid ... project.license'; a recent one builds."""
    import setuptools

    out = subprocess.run(
        [sys.executable, "setup.py", "--name"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    major = int("".join(c for c in setuptools.__version__.split(".")[0] if c.isdigit()))
    if major < 77:
        assert out.returncode != 0
        assert "setuptools >= 77" in out.stderr and setuptools.__version__ in out.stderr
        assert "project.license" not in out.stderr
    else:
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == "cupy_ipcpool"
