"""Property-based fuzzing of the API from its own OpenAPI schema (schemathesis): no request a client can
send gets a server error (a 5xx other than 503, "unavailable"), and the server process survives them all.

The API runs as ``nnqueue serve-api`` in its own process on the module's real Postgres, Redis and S3,
with a live worker row for one model and an admin trace key, so that requests get past authentication
into every route's own validation. Bounded (`EXAMPLES_PER_OPERATION` each way, valid and invalid, per operation; no
shrinking of passing runs): about 50 s on two cores, 95 s with 40 examples.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from nnqueue.settings import Settings
from tests.utils.api import app_client, create_secret, register_worker
from tests.utils.servers import free_ports
from tests.utils.services import Services

pytestmark = pytest.mark.slow  # a real API process, fuzzed for about 50 s

EXAMPLES_PER_OPERATION = 20


class ServeApi:
    def __init__(self, services: Services, log_path: Path) -> None:
        (port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{port}"
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "nnqueue", "serve-api", "--port", str(port)],
                env={**os.environ, **services.env, "NNQUEUE_WORKER_STALE_AFTER_S": "3600"},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.log_path = log_path
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"serve-api did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def server(services: Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeApi]:
    register_worker(services.sessions, model_key="fuzz-model")
    api = ServeApi(services, tmp_path_factory.mktemp("serve-api") / "serve-api.log")
    yield api
    api.process.terminate()
    api.process.wait(timeout=30)


@pytest.fixture(scope="module")
def headers(services: Services) -> dict[str, str]:
    return {"Authorization": f"Bearer {create_secret(services.sessions, 'fuzzer', ('trace', 'harvest', 'admin'))}"}


def fuzz(server: ServeApi, headers: dict[str, str], operation: Any, mode: GenerationMode) -> list[str]:
    """Send ``EXAMPLES_PER_OPERATION`` generated requests; the failures, as readable lines."""
    failures: list[str] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        phases=[Phase.generate],
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def send(case: schemathesis.Case) -> None:
        response = case.call(base_url=server.url, headers=headers, timeout=30)
        # 503 is "unavailable, try again": the health routes answer it for a model no worker serves.
        if response.status_code >= 500 and response.status_code != 503:
            failures.append(f"{response.status_code} for {case.as_curl_command()}: {response.text[:300]}")

    try:
        send()
    except Unsatisfiable:  # no invalid request exists for an operation without inputs (/healthz)
        assert mode is GenerationMode.NEGATIVE
    return failures


# JSON-like values as a careless or hostile client writes them: NaN and Infinity, NUL characters, nesting.
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | NON_FINITE | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
SPEC_FIELDS = ("model_key", "kind", "priority", "timeout_s", "metadata", "client", "other")


@given(
    spec=st.dictionaries(st.sampled_from(SPEC_FIELDS), JSONISH, max_size=6),
    live_model=st.booleans(),
    deep=st.booleans(),
    payload=st.binary(max_size=64),
)
@settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_no_job_spec_gets_a_server_error(
    server: ServeApi, headers: dict[str, str], spec: dict[str, Any], live_model: bool, deep: bool, payload: bytes
) -> None:
    # The spec is a JSON text inside a form field, which the OpenAPI schema cannot describe for
    # schemathesis: generated here, with Python's json.dumps (which writes NaN and Infinity).
    if live_model:
        spec["model_key"] = "fuzz-model"
    text = json.dumps(spec) if not deep else "[" * 50_000 + "]" * 50_000
    response = httpx.post(
        f"{server.url}/v1/jobs", headers=headers, data={"spec": text}, files={"payload": ("t", payload)}
    )
    assert response.status_code < 500, (text[:300], response.text[:500])


HARVEST_FIELDS = ("model_key", "dataset", "captures", "selection", "dtype", "prompts_per_chunk", "metadata", "x")
DATASETS = st.fixed_dictionaries({}, optional={"prompts": JSONISH, "token_ids": JSONISH, "path": JSONISH})


@given(
    spec=st.dictionaries(st.sampled_from(HARVEST_FIELDS), JSONISH | DATASETS, max_size=6),
    live_model=st.booleans(),
    schedule=st.booleans(),
    deep=st.booleans(),
)
@settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_no_harvest_or_schedule_spec_gets_a_server_error(
    server: ServeApi, headers: dict[str, str], spec: dict[str, Any], live_model: bool, schedule: bool, deep: bool
) -> None:
    # As for jobs: a harvest's spec is JSON text in a form field, a schedule's spec part of a JSON body; both
    # written with Python's json.dumps (NaN, Infinity), which a schema-driven fuzzer never sends.
    if live_model:
        spec["model_key"] = "fuzz-model"
    if schedule:
        text = json.dumps({"name": "fuzz", "cron": "0 3 * * *", "spec": spec}) if not deep else "[" * 50_000
        response = httpx.post(
            f"{server.url}/v1/schedules", headers={**headers, "Content-Type": "application/json"}, content=text
        )
    else:
        text = json.dumps(spec) if not deep else "[" * 50_000 + "]" * 50_000
        response = httpx.post(f"{server.url}/v1/harvests", headers=headers, data={"spec": text})
    assert response.status_code < 500, (text[:300], response.text[:500])


@pytest.mark.parametrize("route", ["/v1/harvests", "/v1/schedules"])
@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_number_in_a_harvest_spec_is_a_422(
    server: ServeApi, headers: dict[str, str], route: str, constant: str
) -> None:
    spec = (
        '{"model_key": "fuzz-model", "dataset": {"prompts": ["a"]}, "captures": [{"module": "model.layers.0"}],'
        f' "metadata": {{"x": {constant}}}}}'
    )
    if route == "/v1/schedules":
        body = f'{{"name": "n", "cron": "0 3 * * *", "spec": {spec}}}'
        response = httpx.post(server.url + route, headers={**headers, "Content-Type": "application/json"}, content=body)
    else:
        response = httpx.post(server.url + route, headers=headers, data={"spec": spec})
    assert response.status_code == 422, response.text
    assert f"{constant} is not JSON" in response.text


@pytest.mark.timeout(600)
def test_no_request_gets_a_server_error(server: ServeApi, headers: dict[str, str]) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    failures = []
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {operation.path for operation in operations}
    assert {"/v1/jobs", "/v1/harvests", "/v1/harvests/{harvest_id}/shards/{index}", "/v1/schedules"} <= paths
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            failures += fuzz(server, headers, operation, mode)
        assert server.process.poll() is None, f"the API process died at {operation.label}"
    assert not failures, "\n".join(failures[:20])
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_an_unreachable_database_is_a_503_that_says_so(services: Services) -> None:
    (closed,) = free_ports(1)
    down = f"postgresql+psycopg://nnqueue:x@127.0.0.1:{closed}/nnqueue?connect_timeout=2"
    with app_client(Settings(_env_file=None, **{**services.settings.model_dump(), "database_url": down})) as api:
        response = api.http.get("/v1/jobs", headers={"Authorization": "Bearer nnq_anything"})
    assert response.status_code == 503 and "the database is unreachable" in response.json()["detail"]
