"""The channel's GPU-level payloads: limits, the WELCOME / FRAME payload heads, and the
check of a FRAME head (:func:`frame_head`).

Shared by :mod:`._publisher` and :mod:`._subscriber`; the framing around them
(message kinds, sequence numbers, versions) is :mod:`._protocol`'s.
"""

from __future__ import annotations

import struct

from .._errors import DescriptorError, ProtocolError
from .._handles import ArrayHandle
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
# FRAME payload: flag index u32 (the slot, bit 31 set for a void frame), generation u32
# (low bits), number of arrays u16, metadata length u16, then the packed array handles,
# then the metadata.
FRAME_HEAD = struct.Struct("<IIHH")
#: Set in a FRAME payload's flag index (``slot | FRAME_VOID``) for a *void* frame: a
#: frame of a ``Publisher(ahead=True)`` taken and not published, sent so that the waits
#: on its flag end; it carries no arrays and was never written (``Frame.complete`` False).
FRAME_VOID = 1 << 31


def frame_head(seq: int, slot: int, payload: bytes | memoryview) -> tuple[int, int, int, bool]:
    """Read and check the head of FRAME ``seq``'s payload, received for ``slot``.

    The one check of a FRAME payload's head, for every way a subscriber takes
    a frame (by message, or as the confirmation of a frame handed out ahead).

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
    """
    if len(payload) < FRAME_HEAD.size:
        raise ProtocolError(f"frame {seq}: payload too short")
    flag, generation, count, meta_len = FRAME_HEAD.unpack_from(payload, 0)
    void = False
    if flag != slot:
        if flag != slot | FRAME_VOID:
            raise ProtocolError(f"frame {seq} in slot {slot} names flag {flag}")
        void = True
    if count > MAX_ARRAYS or meta_len > MAX_METADATA:
        raise ProtocolError(f"frame {seq}: {count} arrays, {meta_len} metadata bytes")
    if void and count:
        raise ProtocolError(f"frame {seq}: a void frame with {count} arrays")
    return generation, count, meta_len, void


def check_handles(
    seq: int, slot: int, generation: int, payload: bytes | memoryview, count: int
) -> None:
    """Check that each of FRAME ``seq``'s ``count`` array handles lies in the frame.

    Each handle (from ``payload[FRAME_HEAD.size:]``) must name the frame's
    ``slot`` and, in its low 32 bits, the ``generation`` of its head: a
    handle of another slot or generation would point into memory that is not
    this frame's (and may be written while the frame is held).  Geometry is
    checked where the arrays are made.

    Raises
    ------
    ProtocolError
        A handle is truncated, or names another slot or generation.
    """
    pos = FRAME_HEAD.size
    for i in range(count):
        try:
            geometry, handle_generation, pos = ArrayHandle.peek(payload, pos)
        except DescriptorError:
            raise ProtocolError(f"frame {seq}: array handle {i} truncated") from None
        handle_slot = int.from_bytes(geometry[:4], "little")  # a handle begins with its slot
        if handle_slot != slot:
            raise ProtocolError(
                f"frame {seq}: array {i} lies in slot {handle_slot}, not in the frame's"
            )
        if handle_generation & 0xFFFFFFFF != generation:
            raise ProtocolError(
                f"frame {seq}: array {i} is of generation {handle_generation}, the frame of "
                f"{generation}"
            )
