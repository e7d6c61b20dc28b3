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
