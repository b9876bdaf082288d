"""Ids by their first characters, through the real API (``id_prefix`` on the listings) and the client and CLI that
read them: a unique prefix is the id, several matches are named, another owner's ids are never matched, and what is
not an id's start is a 422 that says so. No worker: the rows are written as submissions leave them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from typer.testing import CliRunner

from nnqueue.cli import app
from nnqueue.client import AmbiguousIdError, Client, NotFoundError
from nnqueue.db.lifecycle import create_job
from nnqueue.db.models import Job, JobKind
from nnqueue.db.session import transaction
from nnqueue.embedded import ApiServer
from tests.utils.api import create_secret
from tests.utils.queued import add_harvest
from tests.utils.services import Services

ALICES = ["aaaa0000-0000-4000-8000-000000000000", "aaaa1111-1111-4111-8111-111111111111"]
BOBS = "bbbb0000-0000-4000-8000-000000000000"
STEERING = "cccc0000-0000-4000-8000-000000000000"


@pytest.fixture(scope="module", autouse=True)
def rows(services: Services) -> None:
    owned = [
        *[("alice", i, JobKind.TRACE) for i in ALICES],
        ("bob", BOBS, JobKind.TRACE),
        ("alice", STEERING, JobKind.STEER),
    ]
    with transaction(services.sessions) as session:
        for owner, ident, kind in owned:
            job = Job(
                id=uuid.UUID(ident), owner=owner, model_key="m", kind=kind, meta={}, payload_key="p", payload_size=1
            )
            create_job(session, job)


@pytest.fixture(scope="module")
def client(api_server: ApiServer, services: Services) -> Iterator[Client]:
    """Alice's client with a key that reads her jobs and her harvests and steering jobs."""
    with Client(api_server.url, create_secret(services.sessions, "alice", ("trace", "harvest"))) as client:
        yield client


def test_a_unique_prefix_is_the_id_and_several_matches_are_named(client: Client) -> None:
    assert client.job("aaaa1").id == ALICES[1]
    assert client.job("AAAA0000-0").id == ALICES[0]
    assert client.job(ALICES[0]).id == ALICES[0]
    with pytest.raises(AmbiguousIdError) as several:
        client.job("aaaa")
    assert sorted(several.value.matches) == ALICES and "give more of the id" in str(several.value)
    with pytest.raises(NotFoundError, match="no job of yours starts with 'bbbb'"):
        client.job("bbbb")  # bob's: never matched for alice
    assert client.get_steering("cccc").id == STEERING
    with pytest.raises(NotFoundError, match="no steering job of yours"):
        client.get_steering("aaaa")  # trace jobs are not steering jobs


def test_a_harvest_by_its_first_characters(client: Client, services: Services) -> None:
    add_harvest(services.sessions, "m", "alice", chunks=1)
    [harvest] = client.harvests()
    assert client.get_harvest(harvest.id[:6]).id == harvest.id


def test_what_is_not_an_ids_start_is_a_422_that_says_so(client: Client) -> None:
    for collection in ("jobs", "harvests", "steering"):
        answer = httpx.get(
            f"{client.url}/v1/{collection}", params={"id_prefix": "xyz"}, headers=client.transport.auth_headers()
        )
        assert answer.status_code == 422 and "is not the start of an id" in answer.text, answer.text


def test_the_cli_takes_prefixes_and_names_the_matches_of_an_ambiguous_one(api_server: ApiServer, secret: str) -> None:
    env = {"NNQUEUE_URL": api_server.url, "NNQUEUE_API_KEY": secret, "COLUMNS": "80"}
    shown = CliRunner().invoke(app, ["status", "aaaa1"], env=env)
    assert shown.exit_code == 0 and ALICES[1] in shown.output and "queued" in shown.output, shown.output
    ambiguous = CliRunner().invoke(app, ["cancel", "aaaa"], env=env)
    assert ambiguous.exit_code == 1 and "AmbiguousIdError" in ambiguous.output, ambiguous.output
    assert all(ident in ambiguous.output.replace("\n", "") for ident in ALICES)
    cancelled = CliRunner().invoke(app, ["cancel", "aaaa0"], env=env)
    assert cancelled.exit_code == 0 and f"job {ALICES[0]} is cancelled" in cancelled.output, cancelled.output
