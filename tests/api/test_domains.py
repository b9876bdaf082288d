"""Trust domains through the API and the CLI (nnqueue.api.routers.domains, ``nnqueue domains``): a caller reads their
domain; an admin groups owners (checked: the scope, the name, the owner) and a grouped owner's jobs say so;
``/v1/models`` names the domains the engines serve, another owner's as "other" except to admins."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from nnqueue.api import auth
from nnqueue.cli import app
from nnqueue.db.session import transaction
from nnqueue.scheduler import registry
from tests.utils.api import LIVE_MODEL, Api, register_worker
from tests.utils.services import Services

runner = CliRunner()


@pytest.fixture(scope="module")
def keys(api: Api) -> dict[str, dict[str, str]]:
    register_worker(api.resources.sessions)
    return {
        "erin": api.new_key("erin"),
        "frank": api.new_key("frank"),
        "admin": api.new_key("root", ("admin",)),
    }


def test_an_admin_groups_owners_and_their_jobs_follow(api: Api, keys: dict[str, dict[str, str]]) -> None:
    mine = api.http.get("/v1/domains", headers=keys["erin"]).json()
    assert mine == {"mode": "owner", "domain": "owner:erin", "members": ["erin"], "groups": None}
    queued = api.submit_ok(keys["erin"])
    assert queued["domain"] == "owner:erin"

    put = lambda owner, domain, who="admin": api.http.put(  # noqa: E731
        f"/v1/domains/owners/{owner}", json={"domain": domain}, headers=keys[who]
    )
    assert put("erin", "lab", who="erin").status_code == 403  # only admins group owners
    assert put("erin", "deployment").status_code == 422
    assert put("nobody", "lab").status_code == 404
    joined = put("erin", "lab")
    assert joined.status_code == 200 and joined.json() == {"owner": "erin", "domain": "lab", "moved_jobs": 1}
    assert put("frank", "lab").json()["moved_jobs"] == 0

    assert api.http.get(f"/v1/jobs/{queued['id']}", headers=keys["erin"]).json()["domain"] == "lab"
    assert api.submit_ok(keys["frank"])["domain"] == "lab"
    assert api.http.get("/v1/domains", headers=keys["frank"]).json()["members"] == ["erin", "frank"]
    assert api.http.get("/v1/domains", headers=keys["admin"]).json()["groups"] == {"lab": ["erin", "frank"]}

    left = api.http.delete("/v1/domains/owners/frank", headers=keys["admin"])
    assert left.json() == {"owner": "frank", "domain": "owner:frank", "moved_jobs": 1}
    assert api.http.get("/v1/domains", headers=keys["erin"]).json()["members"] == ["erin"]


def test_models_name_the_domains_the_engines_serve(api: Api, keys: dict[str, dict[str, str]]) -> None:
    worker = register_worker(api.resources.sessions, model_key="domains-model")
    registry.set_domain(api.resources.sessions, worker, "owner:frank")

    def domains(who: str) -> list[str]:
        models = api.http.get("/v1/models", headers=keys[who]).json()["models"]
        return next(model["domains"] for model in models if model["model_key"] == "domains-model")

    assert (domains("frank"), domains("erin"), domains("admin")) == (["owner:frank"], ["other"], ["owner:frank"])
    served = api.http.get("/v1/models", headers=keys["erin"]).json()["models"]
    assert next(model["domains"] for model in served if model["model_key"] == LIVE_MODEL) == []  # no trace ran


def test_the_cli_groups_owners(services: Services, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NNQUEUE_DATABASE_URL", services.settings.resolved_database_url)
    created = runner.invoke(app, ["keys", "create", "--owner", "gina", "--scope", "trace", "--domain", "team-g"])
    assert created.exit_code == 0 and "trust domain team-g" in created.output, created.output
    with transaction(services.sessions) as session:
        auth.create_key(session, "hank", ["trace"])
    joined = runner.invoke(app, ["domains", "join", "hank", "team-g"])
    assert joined.exit_code == 0 and "hank is in trust domain team-g" in joined.output, joined.output
    listed = runner.invoke(app, ["domains", "list"], env={"COLUMNS": "200"})
    assert listed.exit_code == 0 and "team-g" in listed.output and "gina, hank" in listed.output
    assert runner.invoke(app, ["domains", "join", "hank", "bad name"]).exit_code == 2  # a usage error, named
    assert runner.invoke(app, ["domains", "join", "nobody", "team-g"]).exit_code == 1
    left = runner.invoke(app, ["domains", "leave", "gina"])
    assert left.exit_code == 0 and "trust domain owner:gina" in left.output
    assert "gina" not in runner.invoke(app, ["domains", "list"], env={"COLUMNS": "200"}).output
