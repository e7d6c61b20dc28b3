"""Wire format of the remote protocol: control messages, array specs, data tags. No I/O.

A remote session has two planes:

* the **control plane**, a TCP connection to the server's ``host:port`` that
  carries the handshake (secret proven by challenge-response, UCX worker
  address), the frame headers and the subscriber's credit.  Every message is
  length-prefixed, little-endian, and starts with the same 8-byte header::

      magic u16 = 0x4952 ('IR')   version u8 = 1   type u8   body length u32

* the **data plane**, UCX (UCXX) tag messages from the server's worker to the
  subscriber's: one message per array, straight from the producer's slot into
  a receive slot the subscriber granted.  Its tag names the session key, the
  frame and the array (:func:`data_tag`).

=============  ===========  ====================================================
type           direction    body
=============  ===========  ====================================================
HELLO=1        sub -> srv   nonce 32s, mode u8, reserved u8, num_slots u32
CHALLENGE=2    srv -> sub   nonce 32s, auth u8, server proof 32s
PROOF=3        sub -> srv   client proof 32s, len u32, UCX worker address
WELCOME=4      srv -> sub   sub_id u32, key u32, next_seq u64, max_frame u64,
                            max_arrays u16
REFUSE=5       srv -> sub   reason (UTF-8, at most 1 KiB)
FRAME=6        srv -> sub   seq u64, slot u32, arrays u16, metadata len u32,
                            then the array specs, then the metadata
CREDIT=7       sub -> srv   slot u32 (this receive slot is free: send into it)
BYE=8          either       (empty)
=============  ===========  ====================================================

An array spec is ``typestr len u8, typestr (ASCII), ndim u8, shape u64 x ndim``;
the bytes travel C-contiguous.  :func:`decode_body` and :func:`decode_specs`
check every field and raise only :class:`~cupy_ipcpool.ProtocolError`.  The specs'
rules (their check, wire form and layout in a slot) are the engine's
(``c/src/host_frame.c``), which C programs call too; this module holds their limits.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .._compiled import loader
from .._errors import ProtocolError, UsageError, UsageTypeError

MAGIC = 0x4952
VERSION = 1

HELLO = 1
CHALLENGE = 2
PROOF = 3
WELCOME = 4
REFUSE = 5
FRAME = 6
CREDIT = 7
BYE = 8

MODE_BLOCK = 0
MODE_LATEST = 1
MODE_NAMES = {MODE_BLOCK: "block", MODE_LATEST: "latest"}
MODE_CODES = {name: code for code, name in MODE_NAMES.items()}

NONCE_SIZE = 32
MAC_SIZE = 32
MAX_UCX_ADDRESS = 16384
MAX_REFUSE_REASON = 1024
MAX_ARRAYS = 64
MAX_NDIM = 32
MAX_TYPESTR = 16
#: Largest item size of an array spec's dtype, in bytes.
MAX_ITEMSIZE = 64
MAX_METADATA = 16384
MAX_RING_SLOTS = 1024
#: Alignment of each array inside a receive slot.
ALIGN = 256

HEADER = struct.Struct("<HBBI")
_HELLO = struct.Struct(f"<{NONCE_SIZE}sBBI")
_CHALLENGE = struct.Struct(f"<{NONCE_SIZE}sB{MAC_SIZE}s")
_PROOF = struct.Struct(f"<{MAC_SIZE}sI")
_WELCOME = struct.Struct("<IIQQH")
_FRAME = struct.Struct("<QIHI")
_CREDIT = struct.Struct("<I")
_U64 = struct.Struct("<Q")

#: Largest body of each message type (checked before the body is read).
MAX_BODY = {
    HELLO: _HELLO.size,
    CHALLENGE: _CHALLENGE.size,
    PROOF: _PROOF.size + MAX_UCX_ADDRESS,
    WELCOME: _WELCOME.size,
    REFUSE: MAX_REFUSE_REASON,
    FRAME: _FRAME.size + MAX_ARRAYS * (2 + MAX_TYPESTR + 8 * MAX_NDIM) + MAX_METADATA,
    CREDIT: _CREDIT.size,
    BYE: 0,
}
MAX_MESSAGE = HEADER.size + max(MAX_BODY.values())

_SIMPLE_KINDS = frozenset("biufc")

#: The engine, loaded at the first spec, built for these limits.
_engine = loader(
    "cupy_ipcpool._engine",
    SPEC_MAX_TYPESTR=MAX_TYPESTR,
    SPEC_MAX_NDIM=MAX_NDIM,
    SPEC_MAX_ITEMSIZE=MAX_ITEMSIZE,
    SPEC_ALIGN=ALIGN,
    SPEC_KINDS="".join(sorted(_SIMPLE_KINDS)),
)


# -- messages --------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """A subscriber asks to join: its nonce, mode and receive ring size."""

    nonce: bytes
    mode: int
    num_slots: int


@dataclass(frozen=True)
class Challenge:
    """The server's nonce, whether it requires a secret, and its own proof."""

    nonce: bytes
    auth: bool
    proof: bytes


@dataclass(frozen=True)
class Proof:
    """The subscriber's proof and its UCX worker address."""

    proof: bytes
    ucx_address: bytes


@dataclass(frozen=True)
class Welcome:
    """The server adopts a subscriber.

    Attributes
    ----------
    sub_id:
        Id the server assigned.
    key:
        Session key: the high 32 bits of every data tag of this session.
    next_seq:
        Lower bound of the first frame's sequence number.
    max_frame:
        Most bytes one frame carries (the producer's slot size).
    max_arrays:
        Most arrays one frame carries.
    """

    sub_id: int
    key: int
    next_seq: int
    max_frame: int
    max_arrays: int


@dataclass(frozen=True)
class Refuse:
    """The server refuses and says why."""

    reason: str


@dataclass(frozen=True)
class ArraySpec:
    """Dtype (NumPy typestr, e.g. ``'<f4'``) and shape of one array of a frame."""

    typestr: str
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return int(self.typestr[2:])

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class FrameHeader:
    """One frame: its arrays travel as data messages into receive slot ``slot``."""

    seq: int
    slot: int
    specs: tuple[ArraySpec, ...]
    metadata: bytes


@dataclass(frozen=True)
class Credit:
    """Receive slot ``slot`` is free: the server may send a frame into it."""

    slot: int


@dataclass(frozen=True)
class Bye:
    """The sender ends the session."""


Message = Hello | Challenge | Proof | Welcome | Refuse | FrameHeader | Credit | Bye


# -- encoding --------------------------------------------------------------------


def _msg(kind: int, body: bytes) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, len(body)) + body


def encode_hello(nonce: bytes, mode: int, num_slots: int) -> bytes:
    """Encode HELLO.  Raises ValueError on a bad nonce, mode or ring size."""
    if len(nonce) != NONCE_SIZE:
        raise UsageError(f"nonce must be {NONCE_SIZE} bytes")
    if mode not in MODE_NAMES:
        raise UsageError(f"unknown mode {mode}")
    if not 1 <= num_slots <= MAX_RING_SLOTS:
        raise UsageError(f"num_slots must be in 1..{MAX_RING_SLOTS}, not {num_slots}")
    return _msg(HELLO, _HELLO.pack(nonce, mode, 0, num_slots))


def encode_challenge(nonce: bytes, auth: bool, proof: bytes) -> bytes:
    """Encode CHALLENGE."""
    if len(nonce) != NONCE_SIZE or len(proof) != MAC_SIZE:
        raise UsageError("nonce and proof must be 32 bytes")
    return _msg(CHALLENGE, _CHALLENGE.pack(nonce, int(auth), proof))


def encode_proof(proof: bytes, ucx_address: bytes) -> bytes:
    """Encode PROOF.  Raises ValueError on a bad proof or an oversized address."""
    if len(proof) != MAC_SIZE:
        raise UsageError(f"proof must be {MAC_SIZE} bytes")
    if not 0 < len(ucx_address) <= MAX_UCX_ADDRESS:
        raise UsageError(f"UCX address of {len(ucx_address)} bytes (at most {MAX_UCX_ADDRESS})")
    return _msg(PROOF, _PROOF.pack(proof, len(ucx_address)) + bytes(ucx_address))


def encode_welcome(sub_id: int, key: int, next_seq: int, max_frame: int, max_arrays: int) -> bytes:
    """Encode WELCOME."""
    return _msg(WELCOME, _WELCOME.pack(sub_id, key, next_seq, max_frame, max_arrays))


def encode_refuse(reason: str) -> bytes:
    """Encode REFUSE; a reason over 1 KiB of UTF-8 is cut at a character boundary."""
    raw = reason.encode("utf-8", "replace")
    if len(raw) > MAX_REFUSE_REASON:
        raw = raw[:MAX_REFUSE_REASON].decode("utf-8", "ignore").encode("utf-8")
    return _msg(REFUSE, raw)


def pairs(
    specs: tuple[ArraySpec, ...] | list[ArraySpec],
) -> list[tuple[str, tuple[int, ...]]]:
    """``specs`` as the engine takes them: ``(typestr, shape)`` pairs."""
    return [(spec.typestr, spec.shape) for spec in specs]


def encode_specs(specs: tuple[ArraySpec, ...] | list[ArraySpec]) -> bytes:
    """Encode array specs (checked like the receiver checks them: ProtocolError)."""
    return _engine().encode_array_specs(pairs(specs))


def encode_frame(seq: int, slot: int, specs: tuple[ArraySpec, ...], metadata: bytes = b"") -> bytes:
    """Encode FRAME.  Raises ValueError when a field is out of range."""
    if len(specs) > MAX_ARRAYS:
        raise UsageError(f"at most {MAX_ARRAYS} arrays per frame, got {len(specs)}")
    if len(metadata) > MAX_METADATA:
        raise UsageError(f"metadata is {len(metadata)} bytes; at most {MAX_METADATA}")
    head = _FRAME.pack(seq, slot, len(specs), len(metadata))
    return _msg(FRAME, head + encode_specs(specs) + bytes(metadata))


def encode_credit(slot: int) -> bytes:
    """Encode CREDIT."""
    return _msg(CREDIT, _CREDIT.pack(slot))


_BYE = _msg(BYE, b"")


def encode_bye() -> bytes:
    """Encode BYE."""
    return _BYE


# -- decoding --------------------------------------------------------------------


def has_magic(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` (a message's first bytes) begins with this protocol's magic."""
    return len(data) >= 2 and int.from_bytes(bytes(data[:2]), "little") == MAGIC


def decode_header(data: bytes | bytearray | memoryview) -> tuple[int, int]:
    """Check an 8-byte header; return ``(type, body length)``.

    Raises
    ------
    ProtocolError
        Wrong magic or version, unknown type, or a body longer than that type allows.
    """
    if len(data) != HEADER.size:
        raise ProtocolError(f"header must be {HEADER.size} bytes, got {len(data)}")
    magic, version, kind, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(
            f"bad magic 0x{magic:04x} (expected 0x{MAGIC:04x}): the peer does not speak "
            "cupy_ipcpool's remote protocol"
        )
    if version != VERSION:
        raise ProtocolError(f"unsupported remote protocol version {version} (this side: {VERSION})")
    limit = MAX_BODY.get(kind)
    if limit is None:
        raise ProtocolError(f"unknown message type {kind}")
    if length > limit:
        raise ProtocolError(f"message type {kind} with a {length}-byte body (at most {limit})")
    return kind, length


def check_spec(spec: ArraySpec) -> None:
    """Raise ProtocolError unless ``spec`` is a plain numeric dtype and a sane shape."""
    _engine().encode_array_specs(pairs((spec,)))


def decode_specs(data: bytes | memoryview, count: int) -> tuple[tuple[ArraySpec, ...], int]:
    """Decode ``count`` array specs from the start of ``data``; return ``(specs, bytes used)``."""
    raw, used = _engine().decode_array_specs(data, count)
    return tuple(ArraySpec(typestr, shape) for typestr, shape in raw), used


def decode_body(kind: int, body: bytes | bytearray | memoryview) -> Message:
    """Decode and validate one message body of type ``kind`` (from :func:`decode_header`).

    Raises
    ------
    ProtocolError
        Truncated or trailing bytes, a field out of range.  Nothing else.
    """
    n = len(body)

    def exact(st: struct.Struct, name: str) -> tuple[Any, ...]:
        if n != st.size:
            raise ProtocolError(f"{name} must carry {st.size} bytes, got {n}")
        return st.unpack(body)

    if kind == FRAME:
        if n < _FRAME.size:
            raise ProtocolError(f"truncated FRAME ({n} bytes)")
        seq, slot, count, meta_len = _FRAME.unpack_from(body)
        if count > MAX_ARRAYS:
            raise ProtocolError(f"FRAME with {count} arrays (at most {MAX_ARRAYS})")
        if meta_len > MAX_METADATA:
            raise ProtocolError(f"FRAME with {meta_len} metadata bytes (at most {MAX_METADATA})")
        view = memoryview(body)[_FRAME.size :]
        specs, used = decode_specs(view, count)
        if len(view) - used != meta_len:
            raise ProtocolError(
                f"FRAME metadata length says {meta_len} bytes, the message carries "
                f"{len(view) - used}"
            )
        return FrameHeader(seq, slot, specs, bytes(view[used:]))
    if kind == CREDIT:
        (slot,) = exact(_CREDIT, "CREDIT")
        return Credit(slot)
    if kind == BYE:
        if n:
            raise ProtocolError(f"BYE must be empty, got {n} bytes")
        return Bye()
    if kind == HELLO:
        nonce, mode, _reserved, num_slots = exact(_HELLO, "HELLO")
        if mode not in MODE_NAMES:
            raise ProtocolError(f"HELLO has unknown mode {mode}")
        if not 1 <= num_slots <= MAX_RING_SLOTS:
            raise ProtocolError(f"HELLO ring of {num_slots} slots (1..{MAX_RING_SLOTS})")
        return Hello(nonce, mode, num_slots)
    if kind == CHALLENGE:
        nonce, auth, proof = exact(_CHALLENGE, "CHALLENGE")
        if auth not in (0, 1):
            raise ProtocolError(f"CHALLENGE auth flag {auth}")
        return Challenge(nonce, bool(auth), proof)
    if kind == PROOF:
        if n < _PROOF.size:
            raise ProtocolError(f"truncated PROOF ({n} bytes)")
        proof, length = _PROOF.unpack_from(body)
        if not 0 < length <= MAX_UCX_ADDRESS or n != _PROOF.size + length:
            raise ProtocolError(f"PROOF address length {length} does not match {n} bytes")
        return Proof(proof, bytes(body[_PROOF.size :]))
    if kind == WELCOME:
        sub_id, key, next_seq, max_frame, max_arrays = exact(_WELCOME, "WELCOME")
        if max_arrays > MAX_ARRAYS:
            raise ProtocolError(f"WELCOME allows {max_arrays} arrays (at most {MAX_ARRAYS})")
        return Welcome(sub_id, key, next_seq, max_frame, max_arrays)
    if kind == REFUSE:
        try:
            return Refuse(bytes(body).decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"REFUSE reason is not UTF-8: {exc}") from None
    raise ProtocolError(f"unknown message type {kind}")


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Decode one whole message (header and body)."""
    if len(data) < HEADER.size:
        raise ProtocolError(f"message of {len(data)} bytes is shorter than the header")
    kind, length = decode_header(memoryview(data)[: HEADER.size])
    if len(data) != HEADER.size + length:
        raise ProtocolError(f"header says {length} body bytes, got {len(data) - HEADER.size}")
    return decode_body(kind, memoryview(data)[HEADER.size :])


# -- layout, tags, addresses ----------------------------------------------------------


def layout(specs: tuple[ArraySpec, ...], slot_nbytes: int) -> list[int]:
    """Offsets of ``specs`` packed in one slot, each aligned to :data:`ALIGN` bytes.

    Raises
    ------
    ProtocolError
        The arrays do not fit in ``slot_nbytes`` (or a spec is bad).
    """
    return _engine().array_layout(pairs(specs), slot_nbytes)


def data_tag(key: int, seq: int, index: int) -> int:
    """The 64-bit UCX tag of array ``index`` of frame ``seq`` in session ``key``."""
    return (key & 0xFFFFFFFF) << 32 | (seq & 0xFFFFFF) << 8 | (index & 0xFF)


DEFAULT_PORT = 13337
#: Start of a REFUSE reason that means "busy, try again" (a handshake pushed out by newer ones).
REFUSE_BUSY = "busy: "


def split_address(address: str) -> tuple[bool, str, int | None]:
    """Split ``ucx://host:port`` (or ``host:port``, ``[v6]:port``) as written.

    Returns
    -------
    tuple[bool, str, int | None]
        Whether the ``ucx://`` scheme was written, the host, and the port
        (None when the address names none).

    Raises
    ------
    UsageError
        Another scheme, a path, query or fragment, no host, or a port that is
        not a number in 0..65535.
    """
    written = "://" in address
    text = address if written else f"ucx://{address}"
    parts = urlsplit(text)
    if parts.scheme != "ucx":
        raise UsageError(f"{address!r} is not a ucx:// address")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise UsageError(f"{address!r}: expected ucx://host:port")
    try:
        port = parts.port
    except ValueError:
        raise UsageError(f"{address!r}: the port must be a number in 0..65535") from None
    host = parts.hostname
    if not host:
        raise UsageError(f"{address!r}: no host")
    return written, host, port


#: Where a server listens unless told otherwise, as :func:`parse_address`'s errors say.
_LISTENS = (
    f"a server listens on {DEFAULT_PORT} unless serve's --listen or RemoteServer's listen= "
    "says otherwise"
)


def parse_address(address: str) -> tuple[str, int]:
    """Split a server's address, ``ucx://host:port`` written out, into ``(host, port)``.

    The one parser of the address a subscriber connects to: :func:`subscribe`,
    :class:`~cupy_ipcpool.remote.RemoteSubscriber`, :class:`~cupy_ipcpool.remote.Relay`
    and the command line's ``REMOTE`` all take what it takes.  The host may
    be a name, an IPv4 address or ``[v6]``; the scheme and a port in 1..65535
    must be written (no default port: a server's port is wherever it listens).

    Raises
    ------
    UsageError
        No ``ucx://`` scheme (or another one), a path, query or fragment, no
        host, no port, or a port that is not in 1..65535; the message names
        the form ``ucx://HOST:PORT``.  A :class:`UsageTypeError` for an
        address that is not a string.
    """
    if not isinstance(address, str):
        raise UsageTypeError(
            f"a server's address is a string, ucx://HOST:PORT, not {type(address).__name__}"
        )
    written, host, port = split_address(address)
    if not written:
        raise UsageError(f"{address!r} has no scheme: give ucx://{address}")
    if port is None:
        raise UsageError(f"{address!r} has no port: give ucx://HOST:PORT ({_LISTENS})")
    if port == 0:
        raise UsageError(
            f"{address!r}: port 0 is no server's port: give ucx://HOST:PORT, the port the "
            f"server listens on ({_LISTENS})"
        )
    return host, port


def parse_listen(address: str) -> tuple[str, int]:
    """Split where a server listens, ``host:port`` (or ``ucx://host:port``), into ``(host, port)``.

    The one parser of :class:`~cupy_ipcpool.remote.RemoteServer`'s ``listen``
    and the command line's ``--listen``: the port must be written; 0 means any
    free port.

    Raises
    ------
    UsageError
        Another scheme, a path, query or fragment, no host, no port, or a port
        that is not in 0..65535.
    """
    if not isinstance(address, str):
        raise UsageTypeError(f"listen is a string, HOST:PORT, not {type(address).__name__}")
    _written, host, port = split_address(address)
    if port is None:
        raise UsageError(
            f"{address!r} has no port: give HOST:PORT ({DEFAULT_PORT} by default; 0: any free port)"
        )
    return host, port


def is_remote_address(address: object) -> bool:
    """True for a ``ucx://`` address string."""
    return isinstance(address, str) and address.startswith("ucx://")
