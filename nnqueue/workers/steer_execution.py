"""The steering executor: a claimed steering job's frozen spec, run on the worker's engine, its generations stored.

The payload is the one the API froze (`nnqueue.scheduler.steering.decode_payload`: prompts, edits, sampling
and float32 vectors; nothing is unpickled); text prompts are tokenized here, in a thread, with the engine's
tokenizer (special tokens added, as a plain generate does). `nnqueue.engines.steer_runner.run_steering` runs
them on the engine's steering path; the generations (token ids, text, and log-probabilities when asked) are
written as one JSON object, ``generations.json``, through this worker's staged upload
(`nnqueue.workers.sinks.ResultSinks.put_result`: its size and sha256 recorded as a trace result's are). The job
fails with the engine's refusal (an edit it cannot apply) or vLLM's (a prompt over ``max_model_len``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from nnqueue.db.models import Job
from nnqueue.engines.steer_runner import Edit, Sampling, SteerError, SteerWork, run_steering
from nnqueue.scheduler.payloads import PayloadMissing, load_payload
from nnqueue.scheduler.steering import decode_payload
from nnqueue.workers.job_execution import Execution, JobFailure

RESULT_FILE = "generations.json"
RESULT_FORMAT = "nnqueue-steer-result/1"

try:  # vLLM's checks of a request raise these (0.32); older vLLM raises ValueError
    from vllm.exceptions import VLLMClientError as RequestRefused
except ImportError:
    RequestRefused = ValueError  # type: ignore[assignment,misc]


async def execute_steering(executor: Any, job: Job, progress: Callable[[int, int], None]) -> Execution:
    """Run steering ``job`` on ``executor``'s engine (a `VLLMTraceExecutor`: its sessions, store, model, sinks)."""
    try:
        payload = await asyncio.to_thread(load_payload, executor.sessions, executor.store, job)
    except PayloadMissing as missing:
        raise JobFailure("PayloadMissing", str(missing)) from None
    try:
        body, vectors = decode_payload(payload)
        edits = [Edit.from_json(edit) for edit in body["edits"]]
        sampling = Sampling(**body["sampling"])
        token_ids = await asyncio.to_thread(_tokenize, executor.model, body["prompts"])
        work = SteerWork(str(job.id), token_ids, edits, vectors, sampling)
    except (ValueError, KeyError, TypeError) as error:
        raise JobFailure("InvalidPayload", f"the steering job's payload is not usable: {error}") from None
    total = len(token_ids)
    progress(0, total)
    try:
        generations = await run_steering(
            executor.model.vllm_entrypoint, work, on_finished=lambda done: progress(done, total)
        )
    except SteerError as error:
        raise JobFailure("SteerFailed", str(error)) from None
    except RequestRefused as refused:
        raise JobFailure(type(refused).__name__, str(refused)) from None
    data = json.dumps({"format": RESULT_FORMAT, "generations": [g.to_json() for g in generations]}).encode()
    stored = await asyncio.to_thread(executor.sinks.put_result, job.id, job.attempts, RESULT_FILE, data)
    return Execution(total, stored)


def _tokenize(model: Any, prompts: list[Any]) -> list[list[int]]:
    ids = []
    for index, prompt in enumerate(prompts):
        tokens = model.tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
        if not tokens:
            raise ValueError(f"prompt {index} has no tokens")
        ids.append([int(t) for t in tokens])
    return ids
