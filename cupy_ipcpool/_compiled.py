"""Loading :mod:`cupy_ipcpool._hotpath`, the compiled per-frame bookkeeping, with its checks.

Pool layer: the slot table loads it; the peer pool's and the channel's
per-frame calls come from the same module (the channel checks the FRAME
layout the module was built for itself: ``channel._payload.hotpath``).

Not at import time: ``import cupy_ipcpool`` (and ``python -m cupy_ipcpool
info``, which reports a missing build) works without the compiled parts; a
pool, a peer pool or a channel loads it when it is made.
"""

from __future__ import annotations

import sys
from types import ModuleType

_loaded: ModuleType | None = None


class _Probe:
    __slots__ = ("array",)

    def __init__(self) -> None:
        self.array = object()


def hotpath() -> ModuleType:
    """The compiled module, checked against the layouts and rules of the Python code.

    Raises
    ------
    ImportError
        Not built, built from other layouts than this code's, or this
        interpreter counts an attribute's references otherwise than the
        compiled kept-array rule assumes (``sys.getrefcount`` of an attribute).
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    try:
        from . import _hotpath
    except ImportError as exc:
        raise ImportError(
            f"cupy_ipcpool._hotpath, a compiled part of cupy_ipcpool, is not built ({exc}): "
            "install the package with pip (pip install .), or build it in place with "
            "'python3 setup.py build_ext --inplace'"
        ) from None
    from . import _handles

    # the handle layout (the channel checks its own FRAME layout: channel._payload)
    layout = (
        _handles._HANDLE_HEADER.size,
        _handles._GENERATION_AT,
        _handles._OFFSET_AT,
        _handles._NDIM_AT,
    )
    if layout != _hotpath.LAYOUT[1:5]:
        raise ImportError(
            f"cupy_ipcpool._hotpath was built for the handle layout {_hotpath.LAYOUT[1:5]}, "
            f"this code uses {layout}: rebuild it (pip install -e .)"
        )
    probe = _Probe()
    if _hotpath.attr_refcount(probe, "array") != sys.getrefcount(probe.array):
        raise ImportError(
            "cupy_ipcpool._hotpath reads reference counts otherwise than this interpreter's "
            "sys.getrefcount (the rule KeptArray.in_use relies on); this Python version is "
            "not supported"
        )
    from ._arrays import KeptArray

    _hotpath.set_kept_type(KeptArray)
    _loaded = _hotpath
    return _hotpath
