"""Key scopes: trace (run code), harvest (no code), admin (every owner's jobs); 403 says which is missing."""

from __future__ import annotations

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from nnqueue.api import auth
from nnqueue.api.deps import Caller, require_scope
from nnqueue.cli import app
from nnqueue.db.models import ApiKey
from nnqueue.db.session import transaction
from tests.utils.api import Api, register_worker
from tests.utils.services import Services

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def live_model(api: Api) -> None:
    register_worker(api.resources.sessions)


def test_a_key_without_the_trace_scope_cannot_submit_code(api: Api) -> None:
    for scopes in ((), ("harvest",), ("admin",)):
        response = api.submit(api.new_key("mallory", scopes))
        assert response.status_code == 403, response.text
        assert "lacks the 'trace' scope" in response.json()["detail"] and "arbitrary code" in response.json()["detail"]
    assert api.submit(api.new_key("alice", ("trace",))).status_code == 201


def test_nnsights_own_protocols_need_the_trace_scope_too(api: Api) -> None:
    harvest_only = api.new_key("mallory", ("harvest",))
    remote = api.http.post("/ndif/request", headers=harvest_only, data={"data": "{}"}, files={"blob": ("t", b"x")})
    served = api.http.post("/ndif/serve/api-test-model/v1/nnsight/generate", headers=harvest_only, content=b"x")
    for response in (remote, served):
        assert response.status_code == 403 and "lacks the 'trace' scope" in response.json()["detail"]


def test_keys_get_harvest_only_unless_trace_is_granted(services: Services) -> None:
    with transaction(services.sessions) as session:
        key, _ = auth.create_key(session, "bob")
        assert key.scopes == ["harvest"]
        with pytest.raises(ValueError, match="unknown scope 'root'"):
            auth.create_key(session, "bob", ["root"])


def test_an_admin_sees_and_cancels_every_owners_jobs_others_see_their_own(api: Api) -> None:
    alice, bob = api.new_key("alice"), api.new_key("bob")
    admin = api.new_key("root", ("admin",))
    job = api.submit_ok(alice)

    assert api.http.get(f"/v1/jobs/{job['id']}", headers=bob).status_code == 404
    assert api.http.post(f"/v1/jobs/{job['id']}/cancel", headers=bob).status_code == 404
    forbidden = api.http.get("/v1/jobs", headers=bob, params={"owner": "alice"})
    assert forbidden.status_code == 403 and "'admin' scope" in forbidden.json()["detail"]

    listed = api.http.get("/v1/jobs", headers=admin, params={"limit": 200}).json()["jobs"]
    assert job["id"] in [each["id"] for each in listed]
    only_alice = api.http.get("/v1/jobs", headers=admin, params={"owner": "alice"}).json()["jobs"]
    assert only_alice and {each["owner"] for each in only_alice} == {"alice"}
    assert api.http.get(f"/v1/jobs/{job['id']}", headers=admin).json()["owner"] == "alice"
    # nnsight's status route too (it answered an admin 404 once); another owner still gets 404.
    assert api.http.get(f"/ndif/response/{job['id']}", headers=admin).json()["id"] == job["id"]
    assert api.http.get(f"/ndif/response/{job['id']}", headers=bob).status_code == 404
    cancelled = api.http.post(f"/v1/jobs/{job['id']}/cancel", headers=admin)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"


def test_require_scope_guards_a_route(api: Api) -> None:
    # What the harvest routes use: Depends(require_scope("harvest")).
    routes = FastAPI()
    routes.state.resources = api.resources

    @routes.get("/harvest-only")
    def harvest_only(caller: Caller = Depends(require_scope("harvest"))) -> dict[str, str]:
        return {"owner": caller.owner}

    with TestClient(routes) as http:
        assert http.get("/harvest-only", headers=api.new_key("carol", ("harvest",))).json() == {"owner": "carol"}
        refused = http.get("/harvest-only", headers=api.new_key("carol", ("trace",)))
        assert refused.status_code == 403 and "lacks the 'harvest' scope" in refused.json()["detail"]
        assert http.get("/harvest-only").status_code == 401


def test_keys_cli_defaults_to_harvest_and_changes_scopes(services: Services, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NNQUEUE_DATABASE_URL", services.settings.resolved_database_url)
    created = runner.invoke(app, ["keys", "create", "--owner", "dana"])
    assert created.exit_code == 0 and "scopes harvest" in created.output
    secret = created.output.strip().splitlines()[-1]
    assert runner.invoke(app, ["keys", "create", "--owner", "dana", "--scope", "sudo"]).exit_code != 0

    changed = runner.invoke(
        app, ["keys", "scopes", secret[: auth.PREFIX_LENGTH], "--scope", "trace", "--scope", "harvest"]
    )
    assert changed.exit_code == 0, changed.output
    with services.sessions() as session:
        key = session.query(ApiKey).filter_by(key_hash=auth.hash_secret(secret)).one()
        assert key.scopes == ["trace", "harvest"]
