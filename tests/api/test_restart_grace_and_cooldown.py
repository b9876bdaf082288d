"""Admission while a worker restarts, and the crash cool-down (nnqueue.scheduler.admission, crash_cooldown).

A model whose last worker stopped less than NNQUEUE_WORKER_RESTART_GRACE_S ago still takes jobs (they queue for
the restarted worker), where it used to answer 400; an owner whose traces crashed engines
NNQUEUE_ENGINE_CRASH_LIMIT times within the window gets 429 with Retry-After for its new traces, on every key. The workers
here are real registry rows; the crashed jobs are rows ended as a worker ends them (nnqueue.workers.engine_health),
and tests/workers/test_engine_restart.py does both with a real engine crash.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import update

from nnqueue.db.models import Job, JobStatus, Worker, utcnow
from nnqueue.db.session import transaction
from nnqueue.scheduler import registry
from tests.utils.api import CAPTURE_POINTS, api_client, register_worker, submit_harvest
from tests.utils.services import Services


def stopped_worker(
    services: Services, model_key: str, ago_s: float, capture_points: list[dict[str, Any]] | None = None
) -> None:
    """A worker of ``model_key`` that stopped ``ago_s`` seconds ago (its last heartbeat then too)."""
    worker_id = register_worker(services.sessions, model_key, capture_points=capture_points)
    registry.mark_stopped(services.sessions, worker_id)
    moment = utcnow() - timedelta(seconds=ago_s)
    with transaction(services.sessions) as session:
        session.execute(update(Worker).where(Worker.id == worker_id).values(heartbeat_at=moment, stopped_at=moment))


def test_a_model_whose_worker_is_restarting_takes_jobs_and_queues_them(services: Services) -> None:
    stopped_worker(services, "restarting", ago_s=20)
    stopped_worker(services, "gone-for-good", ago_s=3600)
    with api_client(services, worker_stale_after_s=3, worker_restart_grace_s=120) as api:
        headers = api.new_key("alice")
        accepted = api.submit(headers, model_key="restarting")
        assert accepted.status_code == 201, accepted.text
        assert services.job(uuid.UUID(accepted.json()["id"])).status is JobStatus.QUEUED
        refused = api.submit(headers, model_key="gone-for-good")
        assert refused.status_code == 400 and "no live worker serves model 'gone-for-good'" in refused.json()["detail"]
    with api_client(services, worker_stale_after_s=3, worker_restart_grace_s=0) as api:
        refused = api.submit(api.new_key("alice"), model_key="restarting")
        assert refused.status_code == 400, "with no grace, a model without a live worker is refused"


def test_a_model_scaled_to_zero_takes_jobs_with_no_worker_at_all(services: Services) -> None:
    """KEDA starts a scaled-to-zero model's workers when its queue grows: the job must be accepted and wait."""
    with api_client(
        services, worker_stale_after_s=3, worker_restart_grace_s=0, scale_to_zero_models=["autoscaled"]
    ) as api:
        headers = api.new_key("alice")
        accepted = api.submit(headers, model_key="autoscaled")
        assert accepted.status_code == 201, accepted.text
        assert services.job(uuid.UUID(accepted.json()["id"])).status is JobStatus.QUEUED
        refused = api.submit(headers, model_key="not-autoscaled")
        assert refused.status_code == 400 and "live models: 'autoscaled'" in refused.json()["detail"]


def test_harvests_are_taken_while_a_worker_restarts_and_for_a_model_scaled_to_zero(services: Services) -> None:
    """Their capture points are what the last worker published (a harvest's captures are checked against them)."""
    stopped_worker(services, "restarting-h", ago_s=20, capture_points=CAPTURE_POINTS)
    stopped_worker(services, "autoscaled-h", ago_s=86400, capture_points=CAPTURE_POINTS)
    stopped_worker(services, "gone-h", ago_s=3600, capture_points=CAPTURE_POINTS)

    def harvest(model_key: str, module: str = "model.layers.0") -> dict[str, Any]:
        return {"model_key": model_key, "dataset": {"token_ids": [[1, 2, 3]]}, "captures": [{"module": module}]}

    settings = {"worker_stale_after_s": 3, "worker_restart_grace_s": 120, "scale_to_zero_models": ["autoscaled-h"]}
    with api_client(services, **settings) as api:
        key = api.new_key("alice", ("harvest",))
        for model_key in ("restarting-h", "autoscaled-h"):
            accepted = submit_harvest(api.http, key, harvest(model_key))
            assert accepted.status_code == 201, accepted.text
        refused = submit_harvest(api.http, key, harvest("gone-h"))
        assert refused.status_code == 400 and "no live worker serves model 'gone-h'" in refused.text
        unknown = submit_harvest(api.http, key, harvest("autoscaled-h", "model.nowhere"))
        assert unknown.status_code == 422 and "model.nowhere" in unknown.text


# The API takes a key it found clear of crashes for clear this long (CrashCooldowns.max_age_s), and more.
CLEAR_FOR_S = 1.1


def crash(services: Services, job_id: str, ago_s: float = 0.0, error_type: str = "EngineCrash") -> None:
    """End the job as a worker ends the one whose trace crashed its engine (or changed its state alone)."""
    with transaction(services.sessions) as session:
        session.execute(
            update(Job)
            .where(Job.id == uuid.UUID(job_id))
            .values(
                status=JobStatus.FAILED,
                error_type=error_type,
                error_message="this job's trace crashed the engine, alone in the step that failed: ...",
                finished_at=utcnow() - timedelta(seconds=ago_s),
            )
        )


def test_an_owner_whose_traces_crash_engines_cools_down_with_429_on_every_key(services: Services) -> None:
    register_worker(services.sessions, "crashy")
    limits = {"engine_crash_limit": 2, "engine_crash_window_s": 600, "engine_crash_cooldown_s": 300}
    with api_client(services, worker_stale_after_s=3600, **limits) as api:
        mallory, alice = api.new_key("mallory"), api.new_key("alice")
        first = api.submit_ok(mallory, model_key="crashy")["id"]
        crash(services, first)
        second = api.submit_ok(mallory, model_key="crashy")["id"]  # one crash is not enough
        crash(services, second, error_type="StateModified")  # a state change alone in its step counts too
        time.sleep(CLEAR_FOR_S)

        refused = api.submit(mallory, model_key="crashy")
        assert refused.status_code == 429, refused.text
        assert "stalled it or changed its state 2 times within 600 s" in refused.json()["detail"]
        assert 290 <= int(refused.headers["Retry-After"]) <= 300
        assert api.submit(mallory, model_key="crashy").status_code == 429  # remembered, still refused
        assert api.submit(api.new_key("mallory"), model_key="crashy").status_code == 429  # per owner: a new key too
        assert api.submit(alice, model_key="crashy").status_code == 201  # other owners are not concerned
        staller = api.new_key("victor")  # code stopped at the step deadline, twice: the engine held, then restarted
        for ago in (0, 1):
            crash(services, api.submit_ok(staller, model_key="crashy")["id"], ago, "InterventionStalled")

        # Only charged errors count (a job that only shared a step ran again alone); crashes further apart than
        # the window do not count; nor does a cool-down that has passed.
        shared = api.new_key("trent")
        for ago in (0, 1):
            crash(services, api.submit_ok(shared, model_key="crashy")["id"], ago, "StateModifiedInSharedStep")
        spread = api.new_key("oscar")
        for ago in (0, 700):
            crash(services, api.submit_ok(spread, model_key="crashy")["id"], ago_s=ago)
        cooled = api.new_key("peggy")
        for ago in (400, 350):
            crash(services, api.submit_ok(cooled, model_key="crashy")["id"], ago_s=ago)
        time.sleep(CLEAR_FOR_S)
        for key in (shared, spread, cooled):
            assert api.submit(key, model_key="crashy").status_code == 201
        assert api.submit(staller, model_key="crashy").status_code == 429
