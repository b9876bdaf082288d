"""API keys: creating, listing, revoking and checking them.

A key's secret (``nnq_<random>``) is shown once, when it is created; the database keeps only its
sha256 and its first characters (the prefix, so owners can tell keys apart in listings). A request
is authenticated by hashing the secret it presents and looking the hash up. These functions take a
plain SQLAlchemy session so that the CLI and the HTTP layer share them.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from nnqueue.db.models import ApiKey, utcnow
from nnqueue.errors import NNqueueError

SECRET_PREFIX = "nnq_"
# "nnq_" and 8 random characters: enough to tell keys apart, far too little to guess the rest.
PREFIX_LENGTH = len(SECRET_PREFIX) + 8


class AuthenticationFailed(NNqueueError):
    """The presented key is unknown or revoked; the message says which, for a 401 response."""


class KeyNotFound(NNqueueError, LookupError):
    pass


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_key(session: Session, owner: str, scopes: Sequence[str] = ()) -> tuple[ApiKey, str]:
    """A new key for ``owner`` and its secret, which is not stored anywhere. The caller commits."""
    if not owner.strip():
        raise ValueError("a key needs a non-empty owner")
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(key_hash=hash_secret(secret), key_prefix=secret[:PREFIX_LENGTH], owner=owner, scopes=list(scopes))
    session.add(key)
    session.flush()
    return key, secret


def list_keys(session: Session) -> list[ApiKey]:
    return list(session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)))


def revoke_key(session: Session, prefix_or_id: str) -> ApiKey:
    """Revoke the key with this id or secret prefix (revoking twice keeps the first time). The caller commits.

    Raises :class:`KeyNotFound` when no key, or more than one, matches.
    """
    if prefix_or_id.isdigit():
        matches = list(session.scalars(select(ApiKey).where(ApiKey.id == int(prefix_or_id))))
    elif len(prefix_or_id) > len(SECRET_PREFIX):
        by_prefix = ApiKey.key_prefix.startswith(prefix_or_id[:PREFIX_LENGTH], autoescape=True)
        matches = list(session.scalars(select(ApiKey).where(by_prefix)))
    else:
        matches = []
    if len(matches) != 1:
        found = "no key" if not matches else f"{len(matches)} keys"
        raise KeyNotFound(f"{found} match {prefix_or_id!r}; give a key id or a longer prefix")
    key = matches[0]
    if key.revoked_at is None:
        key.revoked_at = utcnow()
    return key


def authenticate(session: Session, secret: str) -> ApiKey:
    """The live key whose secret this is, or raises :class:`AuthenticationFailed`."""
    key = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_secret(secret)))
    if key is None:
        raise AuthenticationFailed("unknown API key")
    if key.revoked_at is not None:
        raise AuthenticationFailed(f"API key {key.key_prefix}... was revoked at {key.revoked_at.isoformat()}")
    return key
