"""Loading cupy_ipcpool's compiled parts: one loader, one error text, layouts checked.

The two C extensions (``cupy_ipcpool._fastpath`` and
``cupy_ipcpool._engine``) are loaded only through :func:`load`,
by the module that makes their calls, when it is first used: ``import
cupy_ipcpool`` (and ``python -m cupy_ipcpool info``, which reports a missing
build) works without them.

Each extension exports the constants of the layouts and limits it was built
for (``_engine.PROTOCOL``, ``_fastpath.MAX_BATCH``); the caller passes the
values of its own Python definitions, the one source of each layout, and a
build that differs is refused.  Each caller checks only what its own code
defines: the sync page the batch limit of its memory operations, the
channel's sockets the FRAME message's protocol constants.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

from ._errors import CompiledPartError

#: What to do about a missing or mismatched build (the same words everywhere).
FIX = (
    "reinstall the package (pip install . or, in a source tree, pip install -e .), "
    "or build the extensions in place: python setup.py build_ext --inplace"
)


def load(name: str, **expected: object) -> ModuleType:
    """Import the compiled module ``name`` and check the constants it was built for.

    Parameters
    ----------
    name:
        The module's full name, for example ``"cupy_ipcpool._engine"``.
    **expected:
        Attribute name -> the value this code's Python definitions give it (a
        layout's sizes and offsets, a protocol's constants); every one must
        equal the build's.

    Returns
    -------
    ModuleType
        The module (Python's import caches it: later calls cost a dict look-up
        and the comparisons).

    Raises
    ------
    CompiledPartError
        The module is not built or does not load, or it was built from other
        sources than this code (a constant differs or is missing).  The
        message names the module, what is wrong and :data:`FIX`.  Also an
        ``ImportError``.
    """
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise CompiledPartError(
            f"{name}, a compiled part of cupy_ipcpool, is not built or does not load ({exc}): {FIX}"
        ) from None
    for attr, want in expected.items():
        built = getattr(module, attr, None)
        if built != want:
            raise CompiledPartError(
                f"{name} was built from other sources than this code ({attr}: the build has "
                f"{built!r}, this code {want!r}): rebuild it: {FIX}"
            )
    return module


def loader(name: str, **expected: object) -> Callable[[], ModuleType]:
    """A call that :func:`load`\\ s ``name`` the first time it is made and returns it after.

    For a module whose calls use a compiled part on some paths only: ``_engine =
    loader("cupy_ipcpool._engine", MAX_ARRAYS=MAX_ARRAYS)`` at import, then
    ``_engine().check_frame(...)`` where needed; nothing is imported before that.
    A failed load is raised at each call until one succeeds.
    """
    loaded: list[ModuleType] = []

    def get() -> ModuleType:
        if not loaded:
            loaded.append(load(name, **expected))
        return loaded[0]

    return get
