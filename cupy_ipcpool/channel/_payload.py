"""The channel's GPU-level payloads: limits and the WELCOME / FRAME payload heads.

Shared by :mod:`._publisher` and :mod:`._subscriber`; the framing around them
(message kinds, sequence numbers, versions) is :mod:`._protocol`'s.
"""

from __future__ import annotations

import struct

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
# FRAME payload: flag index u32 (the slot), generation u32 (low bits), number of
# arrays u16, metadata length u16, then the packed array handles, then the metadata.
FRAME_HEAD = struct.Struct("<IIHH")
