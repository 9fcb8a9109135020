"""API keys: which keys the router accepts and how a presented one is checked.

Both front doors take the key the same way, ``authorization: Bearer <key>`` (an
HTTP header, gRPC metadata). Keys come from ``--api-key`` and/or
``--api-key-file`` (one key per line; blank lines and ``#`` comments skipped), so
keys can be rotated by listing the old and the new one for a while.

Constant time: a presented token is hashed (SHA-256) and compared with every
key's hash by ``hmac.compare_digest``, all of them, whatever matched: neither the
time taken nor an early exit tells how close a guess was or which key it hit.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import stat
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("pdserve.auth")

BEARER = "bearer"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    """A non-empty set of accepted keys."""

    def __init__(self, keys: Iterable[str]):
        clean = [k.strip() for k in keys]
        if not clean:
            raise ValueError("at least one API key is required")
        for key in clean:
            if not key or any(c.isspace() or not c.isprintable() for c in key):
                raise ValueError("an API key must be non-empty printable text without spaces")
        self._digests = [_digest(k) for k in clean]

    def __len__(self) -> int:
        return len(self._digests)

    @classmethod
    def load(cls, key: str | None, key_file: str | Path | None) -> ApiKeys | None:
        """The keys of ``--api-key`` and ``--api-key-file``; None when neither is set."""
        keys = [key] if key else []
        if key_file:
            path = Path(key_file)
            mode = path.stat().st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                log.warning("API key file %s can be read by other users (chmod 600 it)", path)
            lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
            from_file = [line for line in lines if line and not line.startswith("#")]
            if not from_file:
                raise ValueError(f"API key file {path} holds no key")
            keys += from_file
        return cls(keys) if keys else None

    def accepts(self, token: str) -> bool:
        """Whether ``token`` is one of the keys (constant time, see the module doc)."""
        given = _digest(token)
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(given, digest)
        return ok

    def accepts_header(self, authorization: str | None) -> bool:
        """Whether an ``authorization`` value is ``Bearer <one of the keys>``."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        return scheme.lower() == BEARER and self.accepts(token.strip())
