"""What the isolation tests share: a worker environment that lets traces run arbitrary code (the protected
environment off, as a sandbox escape would) with a fake AWS secret in it, and the check that no secret of the
suite's services came back from intervention code."""

from __future__ import annotations

import pwd
import uuid
from typing import Any

from tests.utils.services import Services, WorkerProcess

FAKE_AWS_SECRET = f"aws-{uuid.uuid4().hex}"
UNPROTECTED = {"NNQUEUE_PROTECTED_ENVIRONMENT": "false", "AWS_SECRET_ACCESS_KEY": FAKE_AWS_SECRET}


def secrets_of(services: Services) -> list[str]:
    names = ("NNQUEUE_DATABASE_URL", "NNQUEUE_BROKER_URL", "NNQUEUE_S3__ACCESS_KEY_ID", "NNQUEUE_S3__SECRET_ACCESS_KEY")
    return [services.env[name] for name in names] + [FAKE_AWS_SECRET]


def assert_no_secret(found: dict[str, Any], services: Services) -> None:
    text = repr(found)
    for secret in secrets_of(services):
        assert secret not in text, f"a secret reached intervention code: {text[:2000]}"
    leaked = [
        key
        for key in found["environ"]
        if key in ("NNQUEUE_DATABASE_URL", "NNQUEUE_BROKER_URL") or key.startswith(("NNQUEUE_S3__", "AWS_"))
    ]
    assert not leaked


def pwd_uid(name: str) -> int:
    return pwd.getpwnam(name).pw_uid


def engine_uid(worker: WorkerProcess) -> int:
    """The uid the worker's engine runs users' code as, from what it registered: the engine user, or root
    kept (the engine user cannot use this Python)."""
    containment = worker.wait_registered().containment
    assert containment is not None
    if containment["engine_user"].startswith("kept "):
        assert "cannot use this Python" in containment["note"] and "fix:" in containment["note"], containment
        return 0
    return pwd_uid(containment["engine_user"])
