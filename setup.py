"""The compiled parts of cupy_ipcpool (everything else is in pyproject.toml).

Two small C extensions with no dependency beyond Python's headers, built by
``pip install .`` (or ``-e .``) with the system's C compiler:
``cupy_ipcpool._fastpath`` (the per-frame stream memory operations, driver
layer) and ``cupy_ipcpool.channel._frameio`` (the channel's per-frame socket
calls).
docs/install.md ("The compiled parts") says what each saves per frame and why
it is plain C; ``cupy_ipcpool._compiled.load`` loads them and checks each
build's layout constants against the Python definitions.
"""

from setuptools import Extension, setup

_FLAGS = ["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"]
_SHARED = ["cupy_ipcpool/_memop_args.h", "cupy_ipcpool/_le.h"]

setup(
    ext_modules=[
        Extension(
            "cupy_ipcpool._fastpath",
            sources=["cupy_ipcpool/_fastpath.c"],
            depends=_SHARED,
            extra_compile_args=_FLAGS,
        ),
        Extension(
            "cupy_ipcpool.channel._frameio",
            sources=["cupy_ipcpool/channel/_frameio.c"],
            depends=_SHARED,
            extra_compile_args=_FLAGS,
        ),
    ]
)
