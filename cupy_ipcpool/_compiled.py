"""Loading cupy_ipcpool's compiled parts: one loader, one error text, layouts checked.

The three C extensions (``cupy_ipcpool._fastpath``, ``cupy_ipcpool._hotpath``
and ``cupy_ipcpool.channel._frameio``) are loaded only through :func:`load`,
by the module that makes their calls, when it is first used: ``import
cupy_ipcpool`` (and ``python -m cupy_ipcpool info``, which reports a missing
build) works without them.

Each extension exports the constants of the layouts and limits it was built
for (``_hotpath.HANDLE_LAYOUT`` and ``FRAME_LAYOUT``, ``_frameio.PROTOCOL``,
``_fastpath.MAX_BATCH``); the caller passes the values of its own Python
definitions, the one source of each layout, and a build that differs is
refused.  Each caller checks only what its own layer defines: the pool layer
the array handle's layout, the channel the FRAME message and the FRAME
payload.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

#: What to do about a missing or mismatched build (the same words everywhere).
FIX = (
    "reinstall the package (pip install . or, in a source tree, pip install -e .), "
    "or build the extensions in place: python setup.py build_ext --inplace"
)

_kept_type_set = False


class _Probe:
    __slots__ = ("array",)

    def __init__(self) -> None:
        self.array = object()


def load(name: str, **expected: object) -> ModuleType:
    """Import the compiled module ``name`` and check the constants it was built for.

    Parameters
    ----------
    name:
        The module's full name, for example ``"cupy_ipcpool.channel._frameio"``.
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
    ImportError
        The module is not built or does not load, or it was built from other
        sources than this code (a constant differs or is missing).  The
        message names the module, what is wrong and :data:`FIX`.
    """
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(
            f"{name}, a compiled part of cupy_ipcpool, is not built or does not load ({exc}): {FIX}"
        ) from None
    for attr, want in expected.items():
        built = getattr(module, attr, None)
        if built != want:
            raise ImportError(
                f"{name} was built from other sources than this code ({attr}: the build has "
                f"{built!r}, this code {want!r}): rebuild it: {FIX}"
            )
    return module


def hotpath(**expected: object) -> ModuleType:
    """:mod:`cupy_ipcpool._hotpath`, checked against the array handle's layout and ``expected``.

    Parameters
    ----------
    **expected:
        Further constants to check, as :func:`load` takes them (the channel
        passes its FRAME payload layout).

    Raises
    ------
    ImportError
        As :func:`load`, or this interpreter counts an attribute's references
        otherwise than the compiled kept-array rule assumes
        (``sys.getrefcount`` of an attribute).
    """
    global _kept_type_set
    from . import _handles

    # the array handle's fixed header: its size, where the generation, the offset
    # and ndim lie (the rest of a handle is 16 bytes per dimension)
    handle = (
        _handles._HANDLE_HEADER.size,
        _handles._GENERATION_AT,
        _handles._OFFSET_AT,
        _handles._NDIM_AT,
    )
    module = load("cupy_ipcpool._hotpath", HANDLE_LAYOUT=handle, **expected)
    if not _kept_type_set:
        probe = _Probe()
        if module.attr_refcount(probe, "array") != sys.getrefcount(probe.array):
            raise ImportError(
                "cupy_ipcpool._hotpath reads reference counts otherwise than this "
                "interpreter's sys.getrefcount (the rule KeptArray.in_use relies on); this "
                "Python version is not supported"
            )
        from ._arrays import KeptArray

        module.set_kept_type(KeptArray)
        _kept_type_set = True
    return module
