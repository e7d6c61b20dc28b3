"""Argument rules shared by the public API: device ordinals, and options taken by keyword.

**Devices.**  Wherever the API takes a CUDA device it takes what CuPy takes:
an ordinal, or a ``cupy.cuda.Device`` (anything with an integer ``id``);
:func:`device_ordinal` turns either into the ordinal, or raises the error
that names the argument.  No GPU, and no CuPy import, is needed for that.

**Keyword-only options.**  One rule for every public call: its subject (the
address to subscribe to, the pool to publish, the arrays to send, a slot,
a buffer and where in it to read, the shape and dtype of an array, as CuPy
takes them) is positional; every option that says *how* (``timeout``,
``stream``, ``metadata``, ``linger``, ``device``, ``mode``...) is
keyword-only.  A call whose only job is to wait (``poll``, ``wait``) has its
timeout as its subject, as ``threading.Event.wait(timeout)`` has.  Interfaces
the library calls on the user's objects (``LeaseSource``, ``SlotMemory``)
keep their parameters as they are.

A method whose options were positional before keeps taking them that way
for now, with a :class:`DeprecationWarning` that names the keyword
(attributed to the caller's line, so Python shows it for code run as
``__main__`` and test runners show it; a ``FutureWarning`` would reach the
end users of applications built on the library).  The keyword call pays
one ``if args:``: the signature ends in ``*args`` before the keyword-only
options, no wrapper stands between caller and body, and
:func:`moved_to_keywords` is the slow path.  The signature that
``inspect.signature`` and ``help()`` show is the keyword-only one
(:func:`keyword_only_signature`), and so is the one type checkers see: the
method is declared as two overloads, the keyword-only form and the old form
marked ``@deprecated`` (PEP 702).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy

from ._errors import UsageError, UsageTypeError

F = TypeVar("F", bound=Callable[..., Any])


class HasDeviceId(Protocol):
    """A device object that names its ordinal, as ``cupy.cuda.Device`` does."""

    @property
    def id(self) -> int: ...


#: What a ``device`` argument may be: an ordinal, or a ``cupy.cuda.Device``.
DeviceLike = int | HasDeviceId


def device_ordinal(device: object, name: str = "device") -> int:
    """``device`` as a CUDA device ordinal.

    Parameters
    ----------
    device:
        An ``int`` (or NumPy integer), or an object with an integer ``id``
        attribute such as ``cupy.cuda.Device(1)``.
    name:
        The argument's name, for the error message.

    Raises
    ------
    UsageTypeError
        Neither (a ``bool`` is not an ordinal here).
    UsageError
        A negative ordinal.
    """
    value = device
    if not isinstance(value, (int, numpy.integer)):
        value = getattr(device, "id", None)
    if isinstance(value, bool) or not isinstance(value, (int, numpy.integer)):
        raise UsageTypeError(
            f"{name} must be a device ordinal (an int) or a cupy.cuda.Device, "
            f"not {type(device).__name__}"
        )
    ordinal = int(value)
    if ordinal < 0:
        raise UsageError(f"{name} must be a non-negative ordinal, got {ordinal}")
    return ordinal


def optional_device(device: object, name: str = "device") -> int | None:
    """:func:`device_ordinal`, with None (the caller's default device) kept as None."""
    return None if device is None else device_ordinal(device, name)


if TYPE_CHECKING:
    from typing_extensions import deprecated
else:

    def deprecated(message: str) -> Callable[[F], F]:
        """PEP 702's mark, for type checkers only: at run time :func:`moved_to_keywords` warns."""
        return lambda fn: fn


def keyword_only_signature(fn: F) -> F:
    """Show ``fn``'s signature without its ``*args``: the keyword-only form.

    ``fn`` itself is returned, unwrapped (the call costs what it did); only
    ``fn.__signature__`` is set, which ``inspect.signature`` and ``help()`` read.
    """
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_POSITIONAL]
    fn.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return fn


def _is_default(value: object, default: object) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def moved_to_keywords(fn: Callable[..., Any], args: tuple[Any, ...], **given: Any) -> tuple:
    """The deprecated call of ``fn`` with options by position: their values, and a warning.

    ``given`` are the options that were positional before, in their old order,
    with the values the call passed by keyword (or their defaults).  Returns
    the options' values in that order: the positional ones in place of the
    defaults.

    Raises
    ------
    UsageTypeError
        More positional arguments than ``fn`` took before, or an option given
        both by position and by keyword.
    """
    names = tuple(given)
    call = f"{fn.__qualname__}()"
    keywords = ", ".join(f"{name}=" for name in names)
    if len(args) > len(names):
        raise UsageTypeError(
            f"{call} takes {keywords} by keyword; got {len(args)} positional arguments"
        )
    defaults = fn.__kwdefaults__ or {}
    values = dict(given)
    for name, value in zip(names[: len(args)], args, strict=True):
        if not _is_default(given[name], defaults.get(name)):
            raise UsageTypeError(f"{call} got {name} twice: by position and as {name}=")
        values[name] = value
    moved = names[: len(args)]
    method = fn.__name__
    warnings.warn(
        f"{call}: passing {' and '.join(moved)} by position is deprecated; pass "
        f"{'them' if len(moved) > 1 else 'it'} by keyword: "
        f"{method}({', '.join(f'{name}=...' for name in moved)})",
        DeprecationWarning,
        stacklevel=3,
    )
    return tuple(values[name] for name in names)


__all__ = [
    "DeviceLike",
    "HasDeviceId",
    "deprecated",
    "device_ordinal",
    "keyword_only_signature",
    "moved_to_keywords",
    "optional_device",
]
