"""The channel's GPU-level payloads: limits, the WELCOME / FRAME payload heads, and the
check of a FRAME payload (:func:`frame_head`, :func:`check_frame`: the engine's).

Shared by :mod:`._publisher` and :mod:`._subscriber`; the framing around them
(message kinds, sequence numbers, versions) is :mod:`._protocol`'s.
"""

from __future__ import annotations

import struct

from .._compiled import loader
from .._handles import _HANDLE_HEADER
from .._transport import SCM_MAX_FD

#: Most bytes of user metadata per frame.
MAX_METADATA = 16384
#: Most arrays per frame.
MAX_ARRAYS = 64
#: Most slots a published pool may have: the WELCOME message carries one fd per
#: slot and the sync page's, in one ``SCM_RIGHTS`` message (``SCM_MAX_FD`` fds).
MAX_CHANNEL_SLOTS = SCM_MAX_FD - 1

# WELCOME payload: descriptor length u32, num_slots u32, max_subscribers u32, this
# subscriber's index in the sync page u32, sync page bytes u64, then the descriptor.
# Its fds: one per slot, then the sync page's.
WELCOME_HEAD = struct.Struct("<IIIIQ")
#: Where the subscriber's index in the sync page is, in the WELCOME payload.
WELCOME_ROW_AT = 12
# FRAME payload: flag index u32 (the slot, bit 31 set for a void frame), generation u32
# (low bits), number of arrays u16, metadata length u16, then the packed array handles,
# then the metadata.
FRAME_HEAD = struct.Struct("<IIHH")
#: Set in a FRAME payload's flag index (``slot | FRAME_VOID``) for a *void* frame: a
#: frame of a ``Publisher(ahead=True)`` taken and not published, sent so that the waits
#: on its flag end; it carries no arrays and was never written (``Frame.complete`` False).
FRAME_VOID = 1 << 31


#: The engine, loaded at the first check, built for these layouts and limits
#: (:mod:`._protocol` and :mod:`._syncpage` check their own).
_engine = loader(
    "cupy_ipcpool._engine",
    FRAME_HEAD_SIZE=FRAME_HEAD.size,
    FRAME_VOID=FRAME_VOID,
    MAX_ARRAYS=MAX_ARRAYS,
    MAX_METADATA=MAX_METADATA,
    HANDLE_SIZE=_HANDLE_HEADER.size,
)


def frame_head(seq: int, slot: int, payload: bytes | memoryview) -> tuple[int, int, int, bool]:
    """Read and check the head of FRAME ``seq``'s payload, received for ``slot``.

    The one check of a FRAME payload's head (the engine's, ``c/src/wire.c``), for
    every way a subscriber takes a frame (by message, or as the confirmation of a
    frame handed out ahead).  :func:`check_frame` checks the whole payload.

    Returns
    -------
    (generation, number of arrays, metadata length, void)
        ``generation``: the low 32 bits of the slot's generation; ``void``: the
        flag index carries :data:`FRAME_VOID` (then there are no arrays).

    Raises
    ------
    ProtocolError
        The payload is shorter than its head, its flag index is neither
        ``slot`` nor ``slot | FRAME_VOID``, it declares more arrays or metadata
        than a frame may carry, or a void frame declares arrays.
    CompiledPartError
        The engine is not built (:mod:`cupy_ipcpool._compiled`).
    """
    return _engine().frame_head(payload, seq, slot)


def check_welcome(payload: bytes | memoryview, num_slots: int, nfds: int) -> tuple[int, ...]:
    """Check a WELCOME's payload (the engine's check, ``c/src/welcome.c``, the C subscriber's).

    For a session of ``num_slots`` slots that received ``nfds`` fds: the head
    adds up (the slots; the descriptor's length; this subscriber's row among at
    most 65536; one fd per slot and the sync page's), the pool descriptor parses
    and has those slots, and the announced sync page is its layout's size.

    Returns
    -------
    (row, max_subscribers, sync_nbytes, desc_offset, desc_len)

    Raises
    ------
    ProtocolError
        Any of the above does not hold (the engine's words).
    """
    checked: tuple[int, ...] = _engine().check_welcome(payload, num_slots, nfds)
    return checked


def check_frame(
    seq: int, slot: int, payload: bytes | memoryview, slot_nbytes: int
) -> tuple[int, int, int, bool]:
    """Check FRAME ``seq``'s whole payload, received for ``slot`` of slots of ``slot_nbytes``.

    The engine's check (``c/src/wire.c``, the C library's ``cip_parse_frame_payload``):
    the head as :func:`frame_head`; each array handle well formed, naming the
    frame's slot and, in its low 32 bits, the generation of the head (a handle
    of another slot or generation would point into memory that is not this
    frame's), every byte of its array inside the slot, its offset and strides
    multiples of its item size; the metadata's length.

    Returns
    -------
    As :func:`frame_head`; the metadata is the payload's last ``metadata length`` bytes.

    Raises
    ------
    ProtocolError
        Any of the above does not hold (the engine's words).
    CompiledPartError
        The engine is not built.
    """
    return _engine().check_frame(payload, seq, slot, slot_nbytes)
