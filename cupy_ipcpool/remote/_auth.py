"""Challenge-response with a shared secret (HMAC-SHA256). Pure functions, no I/O.

The secret never crosses the network.  Each side sends a fresh 32-byte nonce;
each proves it knows the secret with an HMAC over the whole handshake so far
(both nonces, the subscriber's parameters and its UCX address), under a label
that differs per direction so a proof cannot be reflected back::

    sub -> srv  HELLO(nonce_c, ...)
    srv -> sub  CHALLENGE(nonce_s, auth, HMAC(k, "server" | HELLO | nonce_s))
    sub -> srv  PROOF(HMAC(k, "client" | HELLO | CHALLENGE | address), address)

The subscriber checks the server's proof before it sends its own, so it never
talks to a server that does not hold the secret.  The proof binds the UCX
address the server will connect to.  UCX itself does not encrypt: the secret
keeps strangers out, it does not hide the frames from the network.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from .._errors import UsageError
from . import _wire as wire

_LABEL_SERVER = b"cupy_ipcpool remote v1 server proof\x00"
_LABEL_CLIENT = b"cupy_ipcpool remote v1 client proof\x00"
#: Environment variable read when no secret is passed.
SECRET_ENV = "CUPY_IPCPOOL_SECRET"
#: Fewest bytes a secret may have.
MIN_SECRET = 16
_NO_PROOF = bytes(wire.MAC_SIZE)


def nonce() -> bytes:
    """A fresh random nonce."""
    return os.urandom(wire.NONCE_SIZE)


def secret_from(secret: str | bytes | None) -> bytes | None:
    """The secret as bytes: ``secret``, else ``$CUPY_IPCPOOL_SECRET``, else None.

    Raises
    ------
    UsageError
        The secret is shorter than 16 bytes.
    """
    if secret is None:
        env = os.environ.get(SECRET_ENV)
        if not env:
            return None
        secret = env
    raw = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
    if len(raw) < MIN_SECRET:
        raise UsageError(
            f"the shared secret has {len(raw)} bytes; use at least {MIN_SECRET} "
            "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return raw


def server_proof(secret: bytes | None, hello: bytes, server_nonce: bytes) -> bytes:
    """The server's proof over the HELLO message and its nonce (zeros without a secret)."""
    if secret is None:
        return _NO_PROOF
    return hmac.new(secret, _LABEL_SERVER + hello + server_nonce, hashlib.sha256).digest()


def client_proof(secret: bytes | None, hello: bytes, challenge: bytes, address: bytes) -> bytes:
    """The subscriber's proof over HELLO, CHALLENGE and its UCX address (zeros without a secret)."""
    if secret is None:
        return _NO_PROOF
    return hmac.new(secret, _LABEL_CLIENT + hello + challenge + address, hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(expected, got)
