"""API keys: creating, listing, revoking and checking them.

A key's secret (``nnq_<random>``) is shown once, when it is created; the database keeps only its
sha256 and its first characters (the prefix, so owners can tell keys apart in listings). A request
is authenticated by hashing the secret it presents and looking the hash up. These functions take a
plain SQLAlchemy session so that the CLI and the HTTP layer share them.

Scopes say what a key may do (checked by :func:`nnqueue.api.deps.require_scope`):

* ``trace``: submit traces, i.e. run arbitrary nnsight (Python) code on the workers: give it only
  to people trusted with that (see the trust model, docs/operator/security.md);
* ``harvest``: submit declarative harvest specs (no code);
* ``admin``: see, cancel and download every owner's jobs; swap a model's checkpoint (``POST
  /v1/models/{key}/weights``);
* ``weights``: drive a worker's trainer endpoints (TRL's vLLM server protocol: generate, push weights over
  NCCL; :mod:`nnqueue.workers.trl_server`); checked by the worker, which has no other use for keys.

Any valid key reads its own jobs and the models. A key created without scopes gets
:data:`DEFAULT_SCOPES`, ``harvest`` only: running code is never granted implicitly.
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
SCOPES = ("trace", "harvest", "admin", "weights")
DEFAULT_SCOPES = ("harvest",)
# "nnq_" and 8 random characters: enough to tell keys apart, far too little to guess the rest.
PREFIX_LENGTH = len(SECRET_PREFIX) + 8


class AuthenticationFailed(NNqueueError):
    """The presented key is unknown or revoked; the message says which, for a 401 response."""


class KeyNotFound(NNqueueError, LookupError):
    pass


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def checked_scopes(scopes: Sequence[str]) -> list[str]:
    """``scopes`` without duplicates, in the order of :data:`SCOPES`; ValueError for an unknown one."""
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown:
        raise ValueError(f"unknown scope {', '.join(map(repr, unknown))}; scopes are {', '.join(SCOPES)}")
    return [scope for scope in SCOPES if scope in scopes]


def create_key(session: Session, owner: str, scopes: Sequence[str] = DEFAULT_SCOPES) -> tuple[ApiKey, str]:
    """A new key for ``owner`` and its secret, which is not stored anywhere. The caller commits."""
    if not owner.strip():
        raise ValueError("a key needs a non-empty owner")
    granted = checked_scopes(scopes or DEFAULT_SCOPES)
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(key_hash=hash_secret(secret), key_prefix=secret[:PREFIX_LENGTH], owner=owner, scopes=granted)
    session.add(key)
    session.flush()
    return key, secret


def list_keys(session: Session) -> list[ApiKey]:
    return list(session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)))


def revoke_key(session: Session, prefix_or_id: str) -> ApiKey:
    """Revoke the key with this id or secret prefix (revoking twice keeps the first time). The caller commits.

    Raises :class:`KeyNotFound` when no key, or more than one, matches.
    """
    key = find_key(session, prefix_or_id)
    if key.revoked_at is None:
        key.revoked_at = utcnow()
    return key


def set_scopes(session: Session, prefix_or_id: str, scopes: Sequence[str]) -> ApiKey:
    """Replace the scopes of the key with this id or secret prefix. The caller commits."""
    key = find_key(session, prefix_or_id)
    key.scopes = checked_scopes(scopes)
    return key


def find_key(session: Session, prefix_or_id: str) -> ApiKey:
    """The one key with this id or secret prefix; :class:`KeyNotFound` when none, or several, match."""
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
    return matches[0]


def authenticate(session: Session, secret: str) -> ApiKey:
    """The live key whose secret this is, or raises :class:`AuthenticationFailed`."""
    key = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_secret(secret)))
    if key is None:
        raise AuthenticationFailed("unknown API key")
    if key.revoked_at is not None:
        raise AuthenticationFailed(f"API key {key.key_prefix}... was revoked at {key.revoked_at.isoformat()}")
    return key
