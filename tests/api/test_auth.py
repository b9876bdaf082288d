"""API keys: stored only as hashes, accepted in either header, refused once revoked; the keys CLI."""

from __future__ import annotations

import hashlib
import time

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from nnqueue.api import auth
from nnqueue.cli import app
from nnqueue.db.models import ApiKey
from nnqueue.db.session import transaction
from tests.utils.api import Api, api_client, create_secret
from tests.utils.services import Services

runner = CliRunner()


def test_a_key_is_stored_as_its_sha256_and_never_as_the_secret(services: Services) -> None:
    with transaction(services.sessions) as session:
        key, secret = auth.create_key(session, "alice", ["harvest"])
    assert secret.startswith("nnq_") and len(secret) > 40
    with services.sessions() as session:
        row = session.execute(select(ApiKey.__table__).where(ApiKey.id == key.id)).one()
    assert row.key_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in [str(value) for value in row]  # no column holds the secret
    assert secret.startswith(row.key_prefix) and len(row.key_prefix) < len(secret) // 3
    assert (row.owner, row.scopes) == ("alice", ["harvest"])


def test_both_headers_authenticate_and_anything_else_is_401(api: Api) -> None:
    secret = create_secret(api.resources.sessions, "alice")
    for headers in ({"Authorization": f"Bearer {secret}"}, {"ndif-api-key": secret}):
        assert api.http.get("/v1/jobs", headers=headers).status_code == 200

    missing = api.http.get("/v1/jobs")
    assert missing.status_code == 401 and "missing API key" in missing.json()["detail"]
    assert missing.headers["www-authenticate"] == "Bearer"
    for headers in ({"Authorization": f"Bearer {secret}x"}, {"ndif-api-key": "nnq_guess"}, {"Authorization": secret}):
        response = api.http.get("/v1/models", headers=headers)
        assert response.status_code == 401, headers


def test_a_revoked_key_is_rejected_and_says_so_within_the_cache_period(services: Services) -> None:
    """The API remembers a valid key for NNQUEUE_AUTH_CACHE_S rather than look it up on every request."""
    with api_client(services, auth_cache_s=2) as api:
        secret = create_secret(api.resources.sessions, "alice")
        headers = {"Authorization": f"Bearer {secret}"}
        assert api.http.get("/v1/models", headers=headers).status_code == 200
        with transaction(api.resources.sessions) as session:
            auth.revoke_key(session, secret[: auth.PREFIX_LENGTH])
        assert api.http.get("/v1/models", headers=headers).status_code == 200  # remembered
        time.sleep(2.1)  # the remembered lookup expires

        for path in ("/v1/models", "/v1/jobs"):
            response = api.http.get(path, headers=headers)
            assert response.status_code == 401
            assert "was revoked" in response.json()["detail"]
        assert api.http.get("/healthz").status_code == 200  # health needs no key
    with api_client(services, auth_cache_s=0) as uncached:
        assert uncached.http.get("/v1/models", headers=headers).status_code == 401


def test_keys_cli_creates_lists_and_revokes(services: Services, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NNQUEUE_DATABASE_URL", services.settings.resolved_database_url)
    keys = []
    for owner in ("carol", "dave"):
        created = runner.invoke(app, ["keys", "create", "--owner", owner, "--scope", "trace", "--scope", "harvest"])
        assert created.exit_code == 0, created.output
        secret = created.output.strip().splitlines()[-1]
        with services.sessions() as session:
            keys.append(session.scalar(select(ApiKey).where(ApiKey.key_hash == auth.hash_secret(secret))))
        assert keys[-1] is not None and keys[-1].owner == owner and keys[-1].scopes == ["trace", "harvest"]
    carol, dave = keys

    listed = runner.invoke(app, ["keys", "list"], env={"COLUMNS": "200"})
    assert listed.exit_code == 0
    assert carol.key_prefix in listed.output and "carol" in listed.output and "dave" in listed.output
    assert secret not in listed.output

    assert runner.invoke(app, ["keys", "revoke", "nnq_"]).exit_code == 1  # too short to name one key
    revoked = runner.invoke(app, ["keys", "revoke", carol.key_prefix])
    assert revoked.exit_code == 0 and f"revoked key {carol.id}" in revoked.output
    with services.sessions() as session:
        assert session.get(ApiKey, carol.id).revoked_at is not None
        assert session.get(ApiKey, dave.id).revoked_at is None
    assert runner.invoke(app, ["keys", "revoke", str(dave.id)]).exit_code == 0
    with services.sessions() as session:
        assert session.get(ApiKey, dave.id).revoked_at is not None
    assert runner.invoke(app, ["keys", "revoke", "999999"]).exit_code == 1
