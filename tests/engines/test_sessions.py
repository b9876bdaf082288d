"""Sessions as one job: ``with model.session(backend=client.backend())`` (nnsight's ``model.session(remote=True)``:
tests/protocols/test_nnsight_vllm.py).

End to end on the session's shared worker (a real API, worker, engine and builders): each session is compared
with the same session run by nnsight's own flow on the in-process engine (the session in this process, each of its
traces through ``InProcessBackend``), bit for bit.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from nnqueue.client import Client
from nnqueue.client.errors import JobFailed
from nnqueue.client.job import Job
from nnqueue.embedded import ApiServer
from tests.utils.api import create_secret
from tests.utils.engines import InProcessEngine
from tests.utils.reference import InProcessBackend
from tests.utils.services import Services, WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.shared_worker]

CLEAN, CORRUPT = "The Eiffel Tower is in the city of", "The Colosseum is in the city of"


@pytest.fixture(scope="module")
def backend(client: Client, path_worker: WorkerProcess) -> Any:
    return client.backend(progress=False, wait_timeout=180)


def patching(model: Any, session_backend: Any, trace_backend: Any) -> dict[str, Any]:
    """Activation patching in three traces: the clean run's layer-0 output, the corrupted run, and the corrupted
    prompt with the clean output patched in at the last token. Only the session carries ``backend``: its traces
    run where it runs."""
    import nnsight

    kwargs = {"temperature": 0.0, "max_tokens": 1}
    if trace_backend is not None:
        kwargs["backend"] = trace_backend
    with model.session(backend=session_backend):
        with model.trace(CLEAN, **kwargs):
            clean = model.model.layers[0].output[0].save()
            clean_logits = model.logits.save()
        with model.trace(CORRUPT, **kwargs):
            corrupt_logits = model.logits.save()
        with model.trace(CORRUPT, **kwargs):
            model.model.layers[0].output[0][-1, :] = clean[-1, :]
            patched_logits = model.logits.save()
        difference = nnsight.save((patched_logits - corrupt_logits).abs().max())
    return {
        "clean": clean,
        "clean_logits": clean_logits,
        "corrupt_logits": corrupt_logits,
        "patched_logits": patched_logits,
        "difference": difference,
    }


def test_a_three_trace_patching_session_is_one_job_equal_to_the_local_session(
    client: Client, client_model: Any, backend: Any, inprocess_engine: InProcessEngine
) -> None:
    import torch

    before = len(list(client.jobs()))
    queued = patching(client_model, backend, None)
    assert len(list(client.jobs())) == before + 1  # one job for the three traces
    assert backend.job.status() == "completed"
    local = patching(client_model, None, InProcessBackend(inprocess_engine))
    assert set(queued) == set(local)
    for name, value in local.items():
        assert queued[name].dtype == value.dtype and torch.equal(queued[name], value), name
    assert queued["difference"] > 0  # the patch changed the corrupted run: the clean value reached the engine


def test_a_session_whose_second_trace_fails_names_that_trace(client_model: Any, backend: Any) -> None:
    model = client_model
    with pytest.raises(IndexError) as raised:
        with model.session(backend=backend):
            with model.trace(CLEAN, temperature=0.0, max_tokens=1):
                first = model.logits.save()
            with model.trace(CLEAN, temperature=0.0, max_tokens=1):
                second = model.logits[0, 10**6].save()  # out of range, in the engine
    error = raised.value
    assert isinstance(error, JobFailed) and error.job is not None and error.job.status() == "failed"
    line = second_trace_line()
    assert f"the session's trace 2 ({__file__}, line {line}) failed: IndexError" in str(error), str(error)
    assert "first" not in locals()  # a failed session returns nothing, as a local one


def second_trace_line() -> int:
    """The line of the second ``with model.trace`` in `test_a_session_whose_second_trace_fails_names_that_trace`."""
    import inspect

    source, start = inspect.getsourcelines(test_a_session_whose_second_trace_fails_names_that_trace)
    lines = [start + index for index, text in enumerate(source) if "with model.trace(" in text]
    return lines[1]


def test_a_session_cancelled_midway_stops_and_the_worker_serves_the_next_session(
    client: Client, client_model: Any, path_worker: WorkerProcess, tiny_model_path: Path
) -> None:
    model = client_model
    job = a_session_past_its_first_trace(model, client.backend(model_key=str(tiny_model_path), blocking=False), 600)
    deadline = time.monotonic() + 60
    job.cancel()
    while job.status() != "cancelled":
        assert time.monotonic() < deadline, job.info
        time.sleep(0.2)
    # A session needs two builders (its body's, and one to check its traces): the cancelled one's was replaced.
    again = patching(model, client.backend(progress=False, wait_timeout=180), None)
    assert again["difference"] > 0


def test_another_domains_trace_waits_until_the_session_ends(
    client: Client, client_model: Any, path_worker: WorkerProcess, services: Services, api_server: ApiServer
) -> None:
    """Alice's session holds the engine for her trust domain (one per owner by default) from its first trace to its
    end: Bob's trace, submitted between two of its traces, starts only after it."""
    model = client_model
    alices = a_session_past_its_first_trace(model, client.backend(blocking=False), 4)
    with Client(api_server.url, create_secret(services.sessions, "bob")) as bob:
        bobs_backend = bob.backend(blocking=False)
        with model.trace(CORRUPT, temperature=0.0, max_tokens=1, backend=bobs_backend):
            logits = model.logits.save()
        bobs = bobs_backend.job
        assert bobs is not None
        bobs.wait(timeout=180, progress=False)
        alices.wait(timeout=180, progress=False)
        assert alices.info["domain"] != bobs.info["domain"]
        assert bobs.info["started_at"] >= alices.info["finished_at"], (alices.info, bobs.info)


def a_session_past_its_first_trace(model: Any, waiting: Any, sleep_s: float) -> Job:
    """Submit (``waiting``: a non-blocking backend) a session of two traces whose body sleeps ``sleep_s`` between
    them; its job, once the first trace ran."""
    with model.session(backend=waiting):
        with model.trace(CLEAN, temperature=0.0, max_tokens=1):
            first = model.logits.save()
        time.sleep(sleep_s)  # in the builder, between the traces
        with model.trace(CLEAN, temperature=0.0, max_tokens=1):
            second = model.logits.save()
    job = waiting.job
    assert job is not None
    deadline = time.monotonic() + 180
    while job.refresh()["progress"]["done"] < 1:
        assert time.monotonic() < deadline and not job.done, job.info
        time.sleep(0.1)
    return job


def test_a_worker_with_one_builder_refuses_sessions_saying_why() -> None:
    import asyncio

    from nnqueue.enginecore.child_process import ChildError
    from nnqueue.engines.builders import BuilderPool

    async def never(question: bytes) -> bytes:
        raise AssertionError("no trace runs")

    with pytest.raises(ChildError, match=r"has 1 trace builder\(s\) \(NNQUEUE_TRACE_BUILDERS\): a session needs two"):
        asyncio.run(BuilderPool("", {}, 1, 0).run_session(b"", "owner:alice", {}, never))
