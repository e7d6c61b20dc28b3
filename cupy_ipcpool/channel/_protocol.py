"""Wire format of the publish/subscribe channel: fixed ``struct`` layouts, no pickle.

Every message is one ``SOCK_SEQPACKET`` datagram, little-endian, and starts with
the same 4-byte header::

    magic u16 = 0x4950 ('IP')   version u8 = 2   type u8

followed by a body whose layout depends on the type:

========  ==========================  =============================================
type      direction                   body
========  ==========================  =============================================
HELLO=1   consumer -> producer        mode u8, credit u16, pid u32, len u32, payload
WELCOME=2 producer -> consumer (+fds) sub_id u32, num_slots u32, next_seq u64,
                                      credit u16, lease_timeout_ms u32, len u32,
                                      payload
REFUSE=3  producer -> consumer        len u32, reason (UTF-8)
FRAME=4   producer -> consumer        seq u64, slot u32, len u32, payload
RELEASE=5 consumer -> producer        seq u64, slot u32
BYE=6     either side                 (empty)
========  ==========================  =============================================

Version 2 added the granted credit and the lease timeout to WELCOME.  A
REFUSE after the WELCOME means the subscriber was evicted.  Payloads are
opaque bytes for the GPU layer.  :func:`decode` checks every field (the engine does,
``c/src/message.c``: the C library decodes with the same code) and raises only
:class:`~cupy_ipcpool._errors.ProtocolError` on malformed input.  What the channel
sends is written by the engine too (the accept thread's WELCOMEs and REFUSEs,
:func:`bye_message`, the FRAMEs, RELEASEs and HELLOs inside its calls); the
``encode_*`` functions are the pure-Python reference encoders that the tests
compare the engine's bytes with.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from .._compiled import loader
from .._errors import UsageError
from .._handles import MAX_SLOTS as HANDLES_MAX_SLOTS

MAGIC = 0x4950
VERSION = 2


HELLO = 1
WELCOME = 2
REFUSE = 3
FRAME = 4
RELEASE = 5
BYE = 6

MODE_BLOCK = 0
MODE_LATEST = 1
#: ``"block"`` on the wire and in the lease book, and the subscriber takes frames ahead
#: of their FRAME messages: only a publisher made with ``ahead=True`` admits it
#: (docs/protocol.md, "Frames handed out ahead").  The C library does not send it.
MODE_AHEAD = 2
MODE_NAMES = {MODE_BLOCK: "block", MODE_LATEST: "latest", MODE_AHEAD: "ahead"}
MODE_CODES = {name: code for code, name in MODE_NAMES.items()}

MAX_HELLO_PAYLOAD = 64 * 1024
MAX_WELCOME_PAYLOAD = 1024 * 1024
MAX_REFUSE_REASON = 1024
MAX_FRAME_PAYLOAD = 64 * 1024
MAX_CREDIT = 0xFFFF
MAX_SLOTS = HANDLES_MAX_SLOTS  # the one slot-count limit (cupy_ipcpool._handles)

_HEADER = struct.Struct("<HBB")
_HELLO = struct.Struct("<HBBBHII")
_WELCOME = struct.Struct("<HBBIIQHII")
_REFUSE = struct.Struct("<HBBI")
_FRAME = struct.Struct("<HBBQII")
_RELEASE = struct.Struct("<HBBQI")
_BYE = _HEADER

#: The message layouts the engine's calls were built for, as its ``PROTOCOL`` says them:
#: magic, version, FRAME, RELEASE, FRAME header size, RELEASE size, most FRAME payload
#: bytes (a build that differs is refused, by :func:`decode` and by the channel's sockets).
ENGINE_PROTOCOL = (MAGIC, VERSION, FRAME, RELEASE, _FRAME.size, _RELEASE.size, MAX_FRAME_PAYLOAD)

#: Largest datagram of each kind, for receive buffers.
MAX_HELLO_SIZE = _HELLO.size + MAX_HELLO_PAYLOAD
MAX_WELCOME_SIZE = _WELCOME.size + MAX_WELCOME_PAYLOAD
MAX_REFUSE_SIZE = _REFUSE.size + MAX_REFUSE_REASON
MAX_FRAME_SIZE = _FRAME.size + MAX_FRAME_PAYLOAD
MAX_RELEASE_SIZE = _RELEASE.size

_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


@dataclass(frozen=True)
class Hello:
    """A consumer asks to subscribe.

    Attributes
    ----------
    mode:
        ``MODE_BLOCK`` (every frame, the producer waits), ``MODE_LATEST``
        (frames are skipped while ``credit`` frames are outstanding) or
        ``MODE_AHEAD`` (as block; the consumer takes frames ahead of their
        FRAME messages).
    credit:
        Most frames the consumer holds at once (1..65535).
    pid:
        The consumer's pid as it sees itself (informational).
    payload:
        Opaque bytes for the GPU layer (at most 64 KiB).
    """

    mode: int
    credit: int
    pid: int
    payload: bytes = b""


@dataclass(frozen=True)
class Welcome:
    """The producer adopts a consumer; slot fds travel alongside (SCM_RIGHTS).

    Attributes
    ----------
    sub_id:
        The subscriber id the producer assigned.
    num_slots:
        Number of slots in the ring.
    next_seq:
        Lower bound of the first frame's sequence number this consumer receives.
    payload:
        Opaque bytes for the GPU layer (at most 1 MiB).
    credit:
        The credit the producer granted (at most the one asked for).
    lease_timeout_ms:
        Longest the producer lets this consumer hold a frame before evicting
        it, in milliseconds; 0 = no limit.
    """

    sub_id: int
    num_slots: int
    next_seq: int
    payload: bytes = b""
    credit: int = 1
    lease_timeout_ms: int = 0


@dataclass(frozen=True)
class Refuse:
    """The producer refuses a consumer and says why."""

    reason: str


# Frame and Release are made for every frame: plain slotted classes (a frozen
# dataclass's __init__ costs four times as much).  Treat them as values.
@dataclass(slots=True)
class Frame:
    """One published frame: the consumer holds a lease on ``slot`` until it releases ``seq``.

    Attributes
    ----------
    seq:
        Sequence number, increasing across the producer's frames.
    slot:
        Index of the ring slot that holds the frame's data.
    payload:
        Opaque bytes for the GPU layer (at most 64 KiB).
    """

    seq: int
    slot: int
    payload: bytes = b""


@dataclass(slots=True)
class Release:
    """The consumer returns its lease on frame ``seq`` in ``slot``."""

    seq: int
    slot: int


@dataclass(frozen=True)
class Bye:
    """The sender closes the channel."""


Message = Hello | Welcome | Refuse | Frame | Release | Bye


def _check_len(what: str, n: int, limit: int) -> None:
    if n > limit:
        raise UsageError(f"{what} is {n} bytes, more than the limit of {limit}")


def encode_hello(mode: int, credit: int, pid: int, payload: bytes = b"") -> bytes:
    """Encode a HELLO message.

    Parameters
    ----------
    mode:
        ``MODE_BLOCK``, ``MODE_LATEST`` or ``MODE_AHEAD``.
    credit:
        Most outstanding frames, 1..65535.
    pid:
        The sender's pid.
    payload:
        Opaque bytes, at most 64 KiB.

    Returns
    -------
    bytes
        The datagram.

    Raises
    ------
    UsageError
        A field is out of range.
    """
    if mode not in MODE_NAMES:
        raise UsageError(f"mode must be one of {sorted(MODE_NAMES)} ({MODE_NAMES}), not {mode}")
    if not 1 <= credit <= MAX_CREDIT:
        raise UsageError(f"credit must be in 1..{MAX_CREDIT}, not {credit}")
    _check_len("hello payload", len(payload), MAX_HELLO_PAYLOAD)
    return _HELLO.pack(MAGIC, VERSION, HELLO, mode, credit, pid, len(payload)) + bytes(payload)


def encode_welcome(
    sub_id: int,
    num_slots: int,
    next_seq: int,
    payload: bytes = b"",
    *,
    credit: int = 1,
    lease_timeout_ms: int = 0,
) -> bytes:
    """Encode a WELCOME message (the caller attaches the slot fds).

    Parameters
    ----------
    sub_id, num_slots, next_seq, credit, lease_timeout_ms:
        See :class:`Welcome`.
    payload:
        Opaque bytes, at most 1 MiB.

    Returns
    -------
    bytes
        The datagram.

    Raises
    ------
    UsageError
        A field is out of range.
    """
    if not 1 <= num_slots <= MAX_SLOTS:
        raise UsageError(f"num_slots must be in 1..{MAX_SLOTS}, not {num_slots}")
    if not 1 <= credit <= MAX_CREDIT:
        raise UsageError(f"credit must be in 1..{MAX_CREDIT}, not {credit}")
    if not 0 <= lease_timeout_ms <= _U32:
        raise UsageError(f"lease_timeout_ms must be in 0..{_U32}, not {lease_timeout_ms}")
    _check_len("welcome payload", len(payload), MAX_WELCOME_PAYLOAD)
    head = _WELCOME.pack(
        MAGIC,
        VERSION,
        WELCOME,
        sub_id,
        num_slots,
        next_seq,
        credit,
        lease_timeout_ms,
        len(payload),
    )
    return head + bytes(payload)


def encode_refuse(reason: str) -> bytes:
    """Encode a REFUSE message; a reason over 1 KiB of UTF-8 is cut (at a character boundary).

    Parameters
    ----------
    reason:
        Human-readable cause.

    Returns
    -------
    bytes
        The datagram.
    """
    raw = reason.encode("utf-8", "replace")
    if len(raw) > MAX_REFUSE_REASON:
        raw = raw[:MAX_REFUSE_REASON].decode("utf-8", "ignore").encode("utf-8")
    return _REFUSE.pack(MAGIC, VERSION, REFUSE, len(raw)) + raw


def encode_frame(seq: int, slot: int, payload: bytes = b"") -> bytes:
    """Encode a FRAME message.

    Parameters
    ----------
    seq, slot:
        See :class:`Frame`.
    payload:
        Opaque bytes, at most 64 KiB.

    Returns
    -------
    bytes
        The datagram.

    Raises
    ------
    UsageError
        The payload is too large.
    """
    n = len(payload)
    if n > MAX_FRAME_PAYLOAD:
        _check_len("frame payload", n, MAX_FRAME_PAYLOAD)
    return _FRAME.pack(MAGIC, VERSION, FRAME, seq, slot, n) + bytes(payload)


def encode_release(seq: int, slot: int) -> bytes:
    """Encode a RELEASE message.

    Parameters
    ----------
    seq, slot:
        The frame whose lease is returned.

    Returns
    -------
    bytes
        The datagram.
    """
    return _RELEASE.pack(MAGIC, VERSION, RELEASE, seq, slot)


_BYE_BYTES = _BYE.pack(MAGIC, VERSION, BYE)


def encode_bye() -> bytes:
    """Encode a BYE message.

    Returns
    -------
    bytes
        The datagram.
    """
    return _BYE_BYTES


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Decode and validate one datagram (the engine's decoder, ``c/src/message.c``).

    Parameters
    ----------
    data:
        The received bytes.

    Returns
    -------
    Message
        One of :class:`Hello`, :class:`Welcome`, :class:`Refuse`, :class:`Frame`,
        :class:`Release`, :class:`Bye`.

    Raises
    ------
    ProtocolError
        Wrong magic, version or type; truncated or trailing bytes; a length or
        field out of range; a REFUSE reason that is not UTF-8.
    CompiledPartError
        The engine is not built (:mod:`cupy_ipcpool._compiled`).
    """
    kind, *fields = _engine().decode(data)
    return _MESSAGES[kind](*fields)


def bye_message() -> bytes:
    """The BYE this side sends: the engine's writer (:func:`encode_bye`'s bytes)."""
    return bytes(_engine().encode_bye())


#: The engine, loaded at the first decode, built for these layouts (:mod:`._payload` and
#: :mod:`._syncpage` check their own).
_engine = loader("cupy_ipcpool._engine", PROTOCOL=ENGINE_PROTOCOL)


#: What :func:`decode` builds from the engine's answer (its fields in the class's order).
_MESSAGES: dict[int, Callable[..., Message]] = {
    HELLO: Hello,
    WELCOME: Welcome,
    REFUSE: Refuse,
    FRAME: Frame,
    RELEASE: Release,
    BYE: Bye,
}


__all__ = [
    "BYE",
    "FRAME",
    "HELLO",
    "MAGIC",
    "MODE_AHEAD",
    "MODE_BLOCK",
    "MODE_LATEST",
    "REFUSE",
    "RELEASE",
    "VERSION",
    "WELCOME",
    "Bye",
    "Frame",
    "Hello",
    "Message",
    "Refuse",
    "Release",
    "Welcome",
    "bye_message",
    "decode",
    "encode_bye",
    "encode_frame",
    "encode_hello",
    "encode_refuse",
    "encode_release",
    "encode_welcome",
]
