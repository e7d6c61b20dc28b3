"""The compiled parts of cupy_ipcpool (everything else is in pyproject.toml).

Two C extensions with no dependency beyond Python's headers, built by
``pip install .`` (or ``-e .``) with the system's C compiler:
``cupy_ipcpool._fastpath`` (the per-frame stream memory operations, driver
layer) and ``cupy_ipcpool._engine`` (the channel engine: every ``c/src``
file, the C library's own sources, and the binding in ``c/python``, with the
channel's per-frame socket calls; the driver is loaded at run time, so no
CUDA header or library is needed to build it).
docs/install.md ("The compiled parts") says what each saves per frame and why
it is plain C; ``cupy_ipcpool._compiled.load`` loads them and checks each
build's layout constants against the Python definitions.
"""

from pathlib import Path

import setuptools
from setuptools import Extension, setup

#: pyproject.toml's license is an SPDX string (PEP 639), which setuptools reads from 77 on;
#: an older one (a plain venv's, used by a build without isolation) fails with
#: "invalid pyproject.toml config: project.license", which says nothing of the fix.
SETUPTOOLS_NEEDED = (77, 0)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


if _version(setuptools.__version__) < SETUPTOOLS_NEEDED:
    raise SystemExit(
        f"cupy_ipcpool's build needs setuptools >= {SETUPTOOLS_NEEDED[0]} (pyproject.toml's SPDX "
        f"license); this one is {setuptools.__version__}. Build with isolation (a plain "
        "'python3 -m pip install -e .' fetches it), or first run "
        f"'python3 -m pip install -U \"setuptools>={SETUPTOOLS_NEEDED[0]}\"'"
    )

_FLAGS = ["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"]
_SHARED = ["cupy_ipcpool/_memop_args.h"]
#: The engine: the C library's sources (one concern each), and its Python binding.
_ENGINE_SOURCES = sorted(str(p) for d in ("c/python", "c/src") for p in Path(d).glob("*.c"))
_ENGINE_HEADERS = [
    *_SHARED,
    *sorted(str(p) for d in ("c/python", "c/src", "c/include") for p in Path(d).glob("*.h")),
]

setup(
    ext_modules=[
        Extension(
            "cupy_ipcpool._fastpath",
            sources=["cupy_ipcpool/_fastpath.c"],
            depends=_SHARED,
            extra_compile_args=_FLAGS,
        ),
        Extension(
            "cupy_ipcpool._engine",
            sources=_ENGINE_SOURCES,
            depends=_ENGINE_HEADERS,
            include_dirs=["c/include", "c/src", "c/python", "cupy_ipcpool"],
            # the engine's cip_* functions stay this module's own (the C library, loaded
            # beside it through ctypes, has the same names)
            extra_compile_args=[*_FLAGS, "-std=gnu11", "-pthread", "-fvisibility=hidden"],
            extra_link_args=["-pthread"],
            libraries=["dl"],
        ),
    ]
)
