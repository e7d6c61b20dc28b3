"""CPU tier: docs/c.md's install steps, run as written, in a clean ``$HOME``.

The commands are read from docs/c.md's code blocks under "## Build and link" (no
second copy lives here) and run with ``HOME`` set to a fresh directory, so that
``$HOME/.local`` is an empty prefix and ``~/.cmake/packages`` the fresh one, from a
directory holding a copy of ``c/`` (the docs' commands are relative to the
repository's root; nothing is written into the checkout).  Then, with no
``LD_LIBRARY_PATH``, no ``CMAKE_PREFIX_PATH`` and no ``PKG_CONFIG_PATH``:

- a CMake project using the docs' ``find_package`` lines finds the installed
  package (through the user package registry) and builds a program that runs;
- the docs' pkg-config line builds the same program, which runs (its RPATH);
- the docs' in-source ``cc`` line builds it too;
- the installed ``cip_consumer`` starts (its RPATH) and fails with the library's
  own message for a socket that is not there.

The program needs no GPU: it parses junk as a pool descriptor, and prints the
status's name and where ``libcupy_ipcpool`` was mapped from (``/proc/self/maps``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "c.md"
C_DIR = ROOT / "c"

# What the programs built from the docs' lines run: no GPU needed.
CHECK_C = r"""
#include <cupy_ipcpool.h>
#include <stdio.h>
#include <string.h>

int main(void)
{
    unsigned char junk[8] = {0};
    cip_descriptor d;
    cip_status st = cip_parse_descriptor(junk, sizeof junk, &d);
    char line[4096], lib[4096] = "-";
    FILE *maps = fopen("/proc/self/maps", "r");
    while (maps != NULL && fgets(line, sizeof line, maps) != NULL) {
        char *path = strchr(line, '/');
        if (path != NULL && strstr(path, "libcupy_ipcpool") != NULL) {
            path[strcspn(path, "\n")] = '\0';
            strcpy(lib, path);
            break;
        }
    }
    if (maps != NULL)
        fclose(maps);
    printf("%s|%s|%s\n", cip_status_name(st), lib, cip_last_error());
    return st == CIP_ERR_DESCRIPTOR ? 0 : 1;
}
"""

# Variables that would let a broken install pass (or point at another install).
_SCRUBBED = (
    "LD_LIBRARY_PATH",
    "LD_PRELOAD",
    "LD_RUN_PATH",
    "LIBRARY_PATH",
    "CPATH",
    "C_INCLUDE_PATH",
    "PKG_CONFIG_PATH",
    "PKG_CONFIG_LIBDIR",
    "PKG_CONFIG_SYSROOT_DIR",
    "CMAKE_PREFIX_PATH",
    "CMAKE_INSTALL_PREFIX",
    "cupy_ipcpool_c_DIR",
    "cupy_ipcpool_c_ROOT",
    "DESTDIR",
)


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + len(heading) + 2)
    return text[start : end if end >= 0 else len(text)]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.S | re.M)


@dataclass(frozen=True)
class DocSteps:
    install: str  # the sh block that installs
    find_package: str  # the cmake block
    cc_in_source: str  # the cc line that compiles the source in
    cc_pkg_config: str  # the cc line that links the installed library


def doc_steps() -> DocSteps:
    section = _section(DOC.read_text(), "## Build and link")
    sh = _blocks(section, "sh")
    installs = [b for b in sh if "cmake --install" in b]
    assert len(installs) == 1, f"docs/c.md's Build and link has {len(installs)} install blocks"
    lines = [
        ln.strip()
        for b in sh
        if b is not installs[0]
        for ln in b.splitlines()
        if ln.strip().startswith("cc ")
    ]
    pkg = [ln for ln in lines if "pkg-config" in ln]
    plain = [ln for ln in lines if "pkg-config" not in ln]
    assert len(pkg) == 1 and len(plain) == 1, f"expected two cc lines in docs/c.md: {lines}"
    (cmake,) = _blocks(section, "cmake")
    assert "find_package(cupy_ipcpool_c" in cmake, cmake
    return DocSteps(installs[0], cmake, plain[0], pkg[0])


def clean_env(home: Path) -> dict[str, str]:
    """The caller's environment with HOME replaced and nothing that finds the library."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    env["HOME"] = str(home)
    # find_package searches the parent of every PATH entry ending in bin/ before the
    # registry: keep out of PATH the fresh prefix's bin and that of any other install
    env["PATH"] = os.pathsep.join(
        p
        for p in env.get("PATH", "").split(os.pathsep)
        if p and p != str(home / ".local" / "bin") and not _has_package(Path(p).parent)
    )
    return env


def _has_package(prefix: Path) -> bool:
    return any(prefix.glob("lib*/cmake/cupy_ipcpool_c*")) or any(
        prefix.glob("share/cmake/cupy_ipcpool_c*")
    )


def sh(script: str, cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    """Run `script` with bash, stopping at the first failing command; return its output."""
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = f"$ {script}\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, out
    return out


@dataclass(frozen=True)
class Installed:
    steps: DocSteps
    root: Path  # the directory the docs' commands ran in (a copy of c/ inside)
    home: Path
    prefix: Path
    env: dict[str, str]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed: docs/c.md's install steps need it")
    if shutil.which("cc") is None:
        pytest.skip("no C compiler named `cc`: docs/c.md's install and link steps use it")
    steps = doc_steps()
    base = tmp_path_factory.mktemp("c_install")
    root, home = base / "checkout", base / "home"
    home.mkdir()
    root.mkdir()
    shutil.copytree(C_DIR, root / "c", ignore=shutil.ignore_patterns("build*", "__pycache__"))
    env = clean_env(home)
    sh(steps.install, root, env, timeout=300)
    return Installed(steps, root, home, home / ".local", env)


def run_check(program: Path, env: dict[str, str]) -> tuple[str, str]:
    """Run a CHECK_C program; return (the library it mapped, its whole output)."""
    done = subprocess.run([str(program)], env=env, capture_output=True, text=True, timeout=30)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    name, lib, message = done.stdout.strip().split("|", 2)
    assert name == "CIP_ERR_DESCRIPTOR", out
    assert "not a cupy_ipcpool pool descriptor" in message, out
    return lib, out


def test_install_lays_out_what_the_docs_say(installed: Installed) -> None:
    prefix = installed.prefix
    for path in (
        "include/cupy_ipcpool.h",
        "include/cupy_ipcpool_wire.h",
        "include/cupy_ipcpool.hpp",
        "lib/libcupy_ipcpool.so",
        "lib/pkgconfig/cupy_ipcpool_c.pc",
        "lib/cmake/cupy_ipcpool_c/cupy_ipcpool_cConfig.cmake",
        "bin/cip_consumer",
    ):
        assert (prefix / path).exists(), f"{path} is not under {prefix}"
    entries = list((installed.home / ".cmake" / "packages" / "cupy_ipcpool_c").glob("*"))
    assert [e.read_text().strip() for e in entries] == [
        str(prefix / "lib" / "cmake" / "cupy_ipcpool_c")
    ], "the install did not record the package in the user package registry"


def test_find_package_with_no_prefix_path(installed: Installed) -> None:
    project = installed.root / "my_node"
    project.mkdir()
    (project / "my_consumer.c").write_text(CHECK_C)
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.16)\n"
        "project(my_node LANGUAGES C)\n"
        "add_executable(my_node my_consumer.c)\n"
        f"{installed.steps.find_package}"
        'message(STATUS "cupy_ipcpool_c_DIR=${cupy_ipcpool_c_DIR}")\n'
    )
    out = sh(f"cmake -S {project} -B {project / 'build'}", installed.root, installed.env)
    found = installed.prefix / "lib" / "cmake" / "cupy_ipcpool_c"
    assert f"cupy_ipcpool_c_DIR={found}\n" in out, out
    sh(f"cmake --build {project / 'build'}", installed.root, installed.env)
    lib, out = run_check(project / "build" / "my_node", installed.env)
    assert lib.startswith(f"{installed.prefix / 'lib'}/"), out


#: A C++ consumer of the installed package: the RAII header, a failure as an exception.
CHECK_CPP = r"""
#include <cupy_ipcpool.hpp>
#include <cstdio>

int main()
{
    try {
        cupy_ipcpool::subscription::open_raw("/nonexistent/cupy_ipcpool.sock");
    } catch (const cupy_ipcpool::error &e) {
        std::printf("%s|%s\n", cip_status_name(e.status()), e.what());
        return 0;
    }
    return 1;
}
"""


def test_a_cpp_project_builds_against_the_installed_package(installed: Installed) -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
    project = installed.root / "my_cpp_node"
    project.mkdir()
    (project / "my_consumer.cpp").write_text(CHECK_CPP)
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.16)\n"
        "project(my_cpp_node LANGUAGES C CXX)\n"
        "set(CMAKE_CXX_STANDARD 17)\n"
        "add_executable(my_node my_consumer.cpp)\n"  # the target docs/c.md's block links
        f"{installed.steps.find_package}"
    )
    sh(f"cmake -S {project} -B {project / 'build'}", installed.root, installed.env)
    sh(f"cmake --build {project / 'build'}", installed.root, installed.env)
    done = subprocess.run(
        [str(project / "build" / "my_node")],
        capture_output=True,
        text=True,
        env=installed.env,
        timeout=30,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    status, message = done.stdout.strip().split("|", 1)
    assert status == "CIP_ERR_TRANSPORT", done.stdout
    assert "cannot connect to the publisher at /nonexistent/cupy_ipcpool.sock" in message


def test_pkg_config_line(installed: Installed) -> None:
    if shutil.which("pkg-config") is None:
        pytest.skip("pkg-config is not installed (apt-get install pkg-config)")
    work = installed.root / "pkg_config"
    work.mkdir()
    (work / "my_consumer.c").write_text(CHECK_C)
    sh(installed.steps.cc_pkg_config, work, installed.env)
    lib, out = run_check(work / "my_consumer", installed.env)
    # linked to the installed shared library, found by the RPATH the .pc file gives
    assert lib.startswith(f"{installed.prefix / 'lib'}/"), out


def test_in_source_cc_line(installed: Installed) -> None:
    (installed.root / "my_consumer.c").write_text(CHECK_C)
    sh(installed.steps.cc_in_source, installed.root, installed.env)
    lib, out = run_check(installed.root / "my_consumer", installed.env)
    assert lib == "-", out  # compiled in: no shared library


def test_the_examples_own_build_line(installed: Installed) -> None:
    """``c/examples/consumer.c`` says how to build it, in its header: that line, with the
    PKG_CONFIG_PATH it names for a ``$HOME/.local`` install, builds it."""
    if shutil.which("pkg-config") is None:
        pytest.skip("pkg-config is not installed (apt-get install pkg-config)")
    header = (C_DIR / "examples" / "consumer.c").read_text().split("*/", 1)[0]
    (line,) = [ln for ln in header.splitlines() if "cc consumer.c" in ln]
    command = line[line.index("cc consumer.c") :].strip()
    work = installed.root / "example_header"
    work.mkdir()
    shutil.copy(C_DIR / "examples" / "consumer.c", work)
    env = {**installed.env, "PKG_CONFIG_PATH": f"{installed.prefix}/lib/pkgconfig"}
    sh(command, work, env)
    done = subprocess.run(
        [str(work / "consumer"), str(installed.home / "no-publisher.sock")],
        env=installed.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("CIP_ERR_TRANSPORT: cannot connect"), done.stderr


def test_installed_example_starts_without_ld_library_path(installed: Installed) -> None:
    missing = installed.home / "no-publisher.sock"
    done = subprocess.run(
        [str(installed.prefix / "bin" / "cip_consumer"), str(missing)],
        env=installed.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "cannot open shared object file" not in done.stderr, done.stderr
    assert done.returncode == 1, done.stdout + done.stderr
    expected = "CIP_ERR_TRANSPORT: cannot connect to the publisher"
    assert done.stderr.startswith(expected), done.stderr


def test_docs_show_the_example_consumer_as_it_is() -> None:
    section = _section(DOC.read_text(), "## A consumer")
    blocks = _blocks(section, "c")
    assert blocks, "docs/c.md's 'A consumer' has no C block"
    assert blocks[0] == (C_DIR / "examples" / "consumer.c").read_text(), (
        "docs/c.md's example differs from c/examples/consumer.c"
    )
