"""``/v1/models`` follows worker heartbeats; ``/healthz`` and ``/readyz`` report on the process and its servers."""

from __future__ import annotations

import time
from pathlib import Path

from nnqueue.scheduler import registry
from tests.utils.api import api_client, create_secret, register_worker
from tests.utils.servers import free_ports
from tests.utils.services import Services


def test_models_lists_live_workers_and_drops_one_that_stops_heartbeating(services: Services) -> None:
    stale_after_s = 3.0  # 1.5 s missed a beat on a loaded 2-core machine: the steady worker looked gone too
    # No restart grace: a model whose workers went silent is refused at once (the grace: test_restart_grace_...).
    with api_client(services, worker_stale_after_s=stale_after_s, worker_restart_grace_s=0) as api:
        headers = {"ndif-api-key": create_secret(services.sessions, "alice")}

        def models() -> dict[str, tuple[int, int]]:
            response = api.http.get("/v1/models", headers=headers)
            assert response.status_code == 200
            return {m["model_key"]: (m["workers"], m["capacity"]) for m in response.json()["models"]}

        assert models() == {}
        steady = register_worker(services.sessions, "model-a", capacity=4)
        register_worker(services.sessions, "model-a", capacity=2)
        fading = register_worker(services.sessions, "model-b", capacity=8)
        assert models() == {"model-a": (2, 6), "model-b": (1, 8)}

        deadline = time.monotonic() + stale_after_s + 1
        while time.monotonic() < deadline:  # only `steady` keeps beating
            registry.heartbeat(services.sessions, steady)
            time.sleep(0.2)
        assert models() == {"model-a": (1, 4)}
        unknown = api.submit({"ndif-api-key": headers["ndif-api-key"]}, model_key="model-b")
        assert unknown.status_code == 400 and "live models: 'model-a'" in unknown.json()["detail"]

        registry.heartbeat(services.sessions, fading)  # beating again: live again
        registry.mark_stopped(services.sessions, steady)  # stopped cleanly: gone at once
        assert models() == {"model-b": (1, 8)}


def test_healthz_answers_without_a_key(services: Services) -> None:
    with api_client(services) as api:
        response = api.http.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_readyz_is_200_when_everything_is_reachable(services: Services) -> None:
    with api_client(services) as api:
        response = api.http.get("/readyz")
    assert response.status_code == 200, response.text
    s3 = services.settings.s3
    assert s3 is not None
    assert response.json() == {
        "status": "ready",
        "checks": {"database": "ok", "broker": "ok", "object_store": "ok"},
        "store": f"s3://{s3.bucket} at {s3.endpoint_url}",
        "engines": {},
        "isolation": "no live worker",
    }


def test_readyz_says_what_each_live_workers_engine_runs_as_and_whether_any_is_degraded(services: Services) -> None:
    full = {"engine_user": "nnqueue-engine", "isolation": "full", "traces": "every owner's"}
    kept = {"engine_user": "kept root", "note": "engine processes keep root, because ...", "seccomp": "applied"}
    kept["isolation"] = "degraded: engine processes keep root, because ..."
    worker_ids = [registry.new_worker_id() for _ in range(2)]
    for worker_id, containment in zip(worker_ids, (full, kept), strict=True):
        registry.register(services.sessions, worker_id, "model-c", "queue-model-c", 2, containment=containment)
    with api_client(services) as api:
        both = api.http.get("/readyz")
        registry.mark_stopped(services.sessions, worker_ids[1])  # a stopped worker's engine is not reported
        one = api.http.get("/readyz").json()
        registry.mark_stopped(services.sessions, worker_ids[0])
        none = api.http.get("/readyz").json()
    assert both.status_code == 200  # degraded isolation is visible, not unready
    assert both.json()["engines"] == {worker_ids[0]: full, worker_ids[1]: kept}
    assert both.json()["isolation"] == "degraded"
    assert (one["engines"], one["isolation"]) == ({worker_ids[0]: full}, "full")
    assert (none["engines"], none["isolation"]) == ({}, "no live worker")


def test_readyz_is_503_when_a_shared_database_meets_the_default_local_folder(
    services: Services, tmp_path: Path
) -> None:
    """Postgres is shared by processes on several hosts; a per-host default folder would split the store."""
    with api_client(services, s3=None, store_dir=None, data_dir=tmp_path) as api:
        body = api.http.get("/readyz").json()
    assert body["status"] == "unavailable" and body["store"] == f"local folder {tmp_path / 'objects'}"
    assert body["checks"]["object_store"].startswith("StoreNotShared: the object store is the default local folder")
    assert "NNQUEUE_S3__*" in body["checks"]["object_store"] and body["checks"]["database"] == "ok"

    chosen = tmp_path / "mounted-everywhere"  # set explicitly: trusted to be shared
    with api_client(services, s3=None, store_dir=chosen) as api:
        body = api.http.get("/readyz").json()
    assert body["status"] == "ready" and body["store"] == f"local folder {chosen}"


def test_readyz_is_503_naming_what_is_unreachable(services: Services) -> None:
    [closed_port] = free_ports(1)
    with api_client(services, broker_url=f"redis://127.0.0.1:{closed_port}/0") as api:
        started = time.monotonic()
        response = api.http.get("/readyz")
        elapsed = time.monotonic() - started
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert body["checks"]["database"] == body["checks"]["object_store"] == "ok"
    assert "OperationalError" in body["checks"]["broker"] and "refused" in body["checks"]["broker"]
    assert elapsed < 5  # no retry loop on a dead broker

    [closed_port] = free_ports(1)
    database = f"postgresql+psycopg://nobody@127.0.0.1:{closed_port}/nothing"
    with api_client(services, database_url=database) as api:
        body = api.http.get("/readyz").json()
    assert body["checks"]["broker"] == "ok" and body["checks"]["database"] != "ok"


def test_models_lists_the_taps_every_tapped_worker_of_a_model_serves(services: Services) -> None:
    from nnqueue.enginecore.taps import mark_taps

    points = [
        {"module": f"model.layers.{n}", "io": io, "parts": [], "width": 8}
        for n in range(3)
        for io in ("input", "output")
    ]
    with api_client(services) as api:
        headers = {"ndif-api-key": create_secret(services.sessions, "alice")}
        register_worker(services.sessions, "eager", capture_points=points)
        register_worker(
            services.sessions,
            "tapped",
            capture_points=mark_taps(points, ["model.model.layers.0.output", "model.model.layers.2.output"]),
        )
        register_worker(services.sessions, "tapped", capture_points=mark_taps(points, ["model.model.layers.2.output"]))
        register_worker(services.sessions, "mixed", capture_points=points)
        register_worker(services.sessions, "mixed", capture_points=mark_taps(points, ["model.model.layers.1.input"]))
        response = api.http.get("/v1/models", headers=headers)
    assert response.status_code == 200, response.text
    taps = {model["model_key"]: model["taps"] for model in response.json()["models"]}
    # A job may run on any worker of its model: what every tapped worker serves (an eager one serves all). The
    # suite's other tests register workers of other models in the same database: only these three are compared.
    ours = {key: taps.get(key, "missing") for key in ("eager", "tapped", "mixed")}
    assert ours == {"eager": None, "tapped": ["model.layers.2.output"], "mixed": ["model.layers.1.input"]}
