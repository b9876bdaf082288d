"""The embedded default's path: a SQLite file and a local object store, which cannot presign, so
results stream through the API even without ``?inline=1``."""

from __future__ import annotations

import base64
import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from nnqueue.db import migrate
from nnqueue.db.lifecycle import transition
from nnqueue.db.models import JobStatus
from nnqueue.db.session import transaction
from nnqueue.settings import Settings
from nnqueue.storage.local import LocalObjectStore
from nnqueue.storage.results import load_result
from tests.utils.api import Api, app_client, register_worker
from tests.utils.payloads import fake_trace
from tests.utils.results import result_fields, store_result
from tests.utils.services import Services

S = JobStatus


@pytest.fixture
def local_api(services: Services, tmp_path: Path) -> Iterator[Api]:
    database_url = f"sqlite:///{tmp_path / 'nnqueue.db'}"
    migrate.upgrade(database_url)
    settings = Settings(
        _env_file=None,
        database_url=database_url,
        broker_url=services.settings.broker_url,
        store_dir=tmp_path / "objects",
        worker_stale_after_s=3600,
    )
    with app_client(settings) as api:
        register_worker(api.resources.sessions)
        yield api


def test_sqlite_and_a_local_store_serve_jobs_and_stream_results(local_api: Api) -> None:
    import torch

    api = local_api
    assert isinstance(api.resources.store, LocalObjectStore)
    alice = api.new_key("alice")
    ids = [api.submit_ok(alice, fake_trace(b"trace %d" % n))["id"] for n in range(3)]
    first = api.http.get(f"/v1/jobs/{ids[0]}", headers=alice).json()
    assert first["queue_position"] == 1 and first["created_at"].endswith("Z")

    page = api.http.get("/v1/jobs", headers=alice, params={"limit": 2}).json()
    rest = api.http.get("/v1/jobs", headers=alice, params={"limit": 2, "cursor": page["next_cursor"]}).json()
    assert [job["id"] for job in page["jobs"] + rest["jobs"]] == ids[::-1] and rest["next_cursor"] is None

    job_id = uuid.UUID(ids[0])
    saves = {"hidden": torch.arange(6.0).reshape(2, 3), "logits": torch.ones(4)}
    with transaction(api.resources.sessions) as session:
        transition(session, job_id, S.RUNNING, worker_id="test-worker")
    stored = store_result(api.resources.store, job_id, saves)
    with transaction(api.resources.sessions) as session:
        transition(session, job_id, S.COMPLETED, **result_fields(stored))

    response = api.http.get(f"/v1/jobs/{job_id}/result", headers=alice, follow_redirects=False)
    assert response.status_code == 200  # no presigned URL to redirect to
    assert response.headers["content-type"] == "application/octet-stream"
    assert int(response.headers["content-length"]) == stored.size == len(response.content)
    for name, value in load_result(response.content).items():
        torch.testing.assert_close(value, saves[name])
    # The sha256 the worker recorded, in the job's JSON and the download's headers, is that of the bytes served.
    sha256 = hashlib.sha256(response.content).hexdigest()
    assert api.http.get(f"/v1/jobs/{job_id}", headers=alice).json()["result"]["sha256"] == sha256
    assert response.headers["etag"] == f'"{sha256}"'
    assert response.headers["digest"] == "sha-256=" + base64.b64encode(bytes.fromhex(sha256)).decode()

    safetensors = api.http.get(f"/v1/jobs/{job_id}/result", headers=alice, params={"format": "safetensors"})
    assert safetensors.status_code == 200 and safetensors.content == api.resources.store.get_bytes(
        f"results/{job_id}/1/saves.safetensors"
    )
    assert stored.safetensors is not None and safetensors.headers["etag"] == f'"{stored.safetensors.sha256}"'

    api.resources.store.delete(stored.key)
    gone = api.http.get(f"/v1/jobs/{job_id}/result", headers=alice)
    assert gone.status_code == 410 and "no longer in the object store" in gone.json()["detail"]
