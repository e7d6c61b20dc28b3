"""The compiled part of cupy_ipcpool (everything else is in pyproject.toml).

``cupy_ipcpool._fastpath`` is a small C extension with no dependency beyond
Python's headers: ``pip install .`` (or ``-e .``) builds it with the system's
C compiler.  See docs/performance.md for what it does and why.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cupy_ipcpool._fastpath",
            sources=["cupy_ipcpool/_fastpath.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
        )
    ]
)
