"""The shell commands of README.md, docs/install.md and docs/testing.md, run as written.

Each command of those pages' ``sh`` blocks is run here, in a fresh venv and a
copy of the checkout (nothing is written into the checkout), where a CPU
machine can run it; the GPU suite's own commands are skipped with the reason.
A command the pages gain without an entry in :data:`COMMANDS` fails
:func:`test_every_documented_command_has_a_test`.  docs/c.md's commands run in
``tests/test_c_install_cpu.py``.

These install packages (minutes, and the package index or its cache), so
they carry the ``docs_shell`` marker, which the default run leaves out (the
root ``conftest.py``)::

    python3 -m pytest -m docs_shell tests/test_docs_shell_cpu.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [pytest.mark.docs_shell, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", "docs/install.md", "docs/testing.md"]

GPU_SUITE = "the GPU machine's command (its --help runs in tests/test_scripts_cpu.py)"
CI = ".ci/run runs it (tests/test_docs_budget_cpu.py checks that it is the same command)"


def documented() -> list[tuple[str, str]]:
    """(page, command) for each command line of the pages' ``sh`` blocks."""
    found = []
    for page in PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        for block in re.findall(r"^[ \t]*```sh\n(.*?)^[ \t]*```$", text, flags=re.S | re.M):
            for line in block.splitlines():
                command = re.sub(r"\s+#.*$", "", line).strip()
                if command and not command.startswith("#"):
                    found.append((page, command))
    return found


# -- where a command runs ---------------------------------------------------------------


def checkout_copy(dest: Path) -> Path:
    """The checkout's files (tracked, and untracked but not ignored), copied to ``dest``."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the checkout is copied from its file list")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / os.fsdecode(name)
        if src.is_file():
            (dest / os.fsdecode(name)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / os.fsdecode(name))
    return dest


class Venv:
    """A fresh venv: ``python3`` on its PATH is its own interpreter."""

    def __init__(self, where: Path, *, deps_from_this_env: bool = False) -> None:
        self.path = where / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(self.path)], check=True, timeout=300)
        if deps_from_this_env:
            # the dependencies already there (an offline machine): this environment's
            # site-packages on the path, by a plain .pth line (its own .pth files do not run)
            site = self.run(
                "python3 -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'"
            )
            Path(site.stdout.strip(), "_deps_from_test_env.pth").write_text(
                sysconfig.get_paths()["purelib"] + "\n"
            )

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.path / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.path)
        return env

    def run(
        self, command: str, cwd: Path | None = None, timeout: float = 900
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", command],
            cwd=cwd,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _ok(done: subprocess.CompletedProcess[str], command: str) -> None:
    assert done.returncode == 0, f"$ {command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _says_no_gpu(done: subprocess.CompletedProcess[str], command: str) -> None:
    """A GPU command on a CPU machine: exit 1, its reason in one line on stderr."""
    if done.returncode == 0:
        return  # a GPU is here
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("no GPU"), (
        f"$ {command}\nexit {done.returncode}\n{done.stderr[-3000:]}"
    )


# -- the runners ------------------------------------------------------------------------


def run_install(command: str, tmp: Path) -> None:
    """An install (and what follows it) in a fresh venv, from a copy of the checkout."""
    tree = checkout_copy(tmp / "checkout")
    venv = Venv(tmp)
    install, _, then = command.partition(" && ")
    _ok(done := venv.run(install, cwd=tree), install)
    assert "ERROR" not in done.stderr, f"$ {install}\n{done.stderr[-3000:]}"
    _ok(venv.run("python3 -m pip check", cwd=tree), "pip check")
    imported = venv.run(
        "python3 -c 'import cupy_ipcpool, cupy, cuda.bindings; print(cupy_ipcpool.__file__)'",
        cwd=tmp,
    )
    _ok(imported, "import")
    assert imported.stdout.strip().startswith(str(tree)), imported.stdout
    if "cu12" in install:  # one CUDA major's wheels, not both
        assert venv.run("python3 -m pip show -q cupy-cuda13x").returncode != 0
    if then:
        _says_no_gpu(venv.run(then, cwd=tree, timeout=300), then)


def run_offline(command: str, tmp: Path) -> None:
    """The install without fetching anything, where the dependencies are already there."""
    tree = checkout_copy(tmp / "checkout")
    venv = Venv(tmp, deps_from_this_env=True)
    # what install.md asks of the environment first (a plain venv's setuptools is older)
    _ok(venv.run("python3 -m pip install -q -U 'setuptools>=77'"), "setuptools")
    _ok(venv.run(command, cwd=tree), command)
    check = "import cupy_ipcpool._fastpath, cupy_ipcpool._engine as m; print(m.__file__)"
    imported = venv.run(f"python3 -c '{check}'", cwd=tmp)
    _ok(imported, "import")
    assert imported.stdout.strip().startswith(str(tree)), imported.stdout


def run_uninstalled(command: str, tmp: Path) -> None:
    """``PYTHONPATH=.`` in a checkout with nothing installed or built."""
    tree = checkout_copy(tmp / "checkout")
    venv = Venv(tmp, deps_from_this_env=True)
    done = venv.run(command, cwd=tree, timeout=300)
    _says_no_gpu(done, command)
    assert "compiled parts: NOT BUILT" in done.stdout, done.stdout


def run_here(command: str, tmp: Path) -> None:
    """A command of this environment (the package installed), in the checkout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    if "cupy_ipcpool info" in command:
        _says_no_gpu(done, command)
    else:
        _ok(done, command)


#: Each documented command, and how it runs here (or why it cannot, as a string).
COMMANDS: dict[str, Callable[[str, Path], None] | str] = {
    "python3 -m pip install -e '.[cu13]' && python3 -m cupy_ipcpool demo": run_install,
    (
        "python3 -m pip install -e '.[test,remote-cu13]' "
        "&& python3 -m pytest -n auto --dist loadfile"
    ): CI,
    "python3 -m cupy_ipcpool info": run_here,
    "python3 -m pip install -e '.[cu13]'": run_install,
    "python3 -m pip install -e '.[cu12]'": run_install,
    "python3 -m pip install --no-deps --no-build-isolation -e .": run_offline,
    "PYTHONPATH=. python3 -m cupy_ipcpool info": run_uninstalled,
    "python3 -m pytest -m gpu README.md docs": run_here,
    "scripts/gpu-test": GPU_SUITE,
    'TESTS="tests/test_pool_gpu.py" BENCH="benchmarks/test_bench_pool.py" scripts/gpu-test': (
        GPU_SUITE
    ),
    "BENCH=none DEMO=none scripts/gpu-test": GPU_SUITE,
}


def test_every_documented_command_has_a_test() -> None:
    commands = {command for _page, command in documented()}
    assert not commands - set(COMMANDS), f"add to COMMANDS: {sorted(commands - set(COMMANDS))}"
    assert not set(COMMANDS) - commands, f"no page shows: {sorted(set(COMMANDS) - commands)}"


@pytest.mark.parametrize("page, command", documented(), ids=[f"{p}: {c}" for p, c in documented()])
def test_documented_command(page: str, command: str, tmp_path: Path) -> None:
    how = COMMANDS.get(command)
    if how is None:
        pytest.fail(f"{page}: {command!r} has no entry in COMMANDS")
    if isinstance(how, str):
        pytest.skip(how)
    how(command, tmp_path)
