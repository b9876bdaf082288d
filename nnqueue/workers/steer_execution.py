"""The steering executor: a claimed steering job's frozen spec, run on the worker's engine, its generations stored.

The payload is the one the API froze (`nnqueue.scheduler.steering.decode_payload`: prompts, edits, sampling
and float32 vectors; nothing is unpickled); text prompts are tokenized here, in a thread, with the engine's
tokenizer (special tokens added, as a plain generate does). `nnqueue.engines.steer_runner.run_steering` runs
them on the engine's steering path; the generations (token ids, text, and log-probabilities when asked) are
written as one JSON object, ``generations.json``, through this worker's staged upload
(`nnqueue.workers.sinks.ResultSinks.put_result`: its size and sha256 recorded as a trace result's are). The job
fails with the engine's refusal (an edit it cannot apply) or vLLM's (a prompt over ``max_model_len``).

A job with ``captures`` records them in the same generation pass
(`nnqueue.engines.steer_runner.run_steering_captured`): the engine writes one harvest-format shard to a handoff
file of this worker's (`ResultSinks.staged_shard`, bounded as a harvest chunk's shard is), which is checked and
uploaded beside ``generations.json`` as ``activations.safetensors`` (`ResultSinks.commit_shard`); its size and
sha256 are recorded in the job's ``result_safetensors_*`` columns, the generations' in ``result_*``. A capture
the engine could not make fails the job (``CaptureFailed``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from typing import Any

from nnqueue.db.models import Job
from nnqueue.enginecore.harvest_spec import Capture, Selection, check_captures, check_dtype
from nnqueue.engines.harvest_runner import ChunkResult, HarvestError
from nnqueue.engines.steer_runner import (
    Edit,
    Generation,
    Sampling,
    SteerCapture,
    SteerError,
    SteerWork,
    run_steering,
    run_steering_captured,
)
from nnqueue.engines.trace_report import WrittenObject
from nnqueue.scheduler.steering import decode_payload
from nnqueue.storage.keys import ACTIVATIONS_FILE, result_key
from nnqueue.storage.object_store import Digest, ObjectNotFound
from nnqueue.timeline import stamp
from nnqueue.workers.chunk_execution import shard_bound
from nnqueue.workers.job_execution import Execution, JobFailure
from nnqueue.workers.sinks import ResultNotWritten, ShardSink

RESULT_FILE = "generations.json"
RESULT_FORMAT = "nnqueue-steer-result/1"

try:  # vLLM's checks of a request raise these (0.32); older vLLM raises ValueError
    from vllm.exceptions import VLLMClientError as RequestRefused
except ImportError:
    RequestRefused = ValueError  # type: ignore[assignment,misc]


async def execute_steering(executor: Any, job: Job, progress: Callable[[int, int], None]) -> Execution:
    """Run steering ``job`` on ``executor``'s engine (a `VLLMTraceExecutor`: its sessions, store, model, sinks)."""
    payload = await executor.payloads.load(job)
    stamp("payload")
    try:
        body, vectors = decode_payload(payload)
        edits = [Edit.from_json(edit) for edit in body["edits"]]
        sampling = Sampling(**body["sampling"])
        token_ids = await asyncio.to_thread(_tokenize, executor.model, body["prompts"])
        work = SteerWork(str(job.id), token_ids, edits, vectors, sampling)
    except (ValueError, KeyError, TypeError) as error:
        raise JobFailure("InvalidPayload", f"the steering job's payload is not usable: {error}") from None
    stamp("built")
    total = len(token_ids)
    progress(0, total)

    def finished(done: int) -> None:
        progress(done, total)

    capture = body.get("capture")
    try:
        if capture is None:
            generations = await run_steering(executor.model.vllm_entrypoint, work, on_finished=finished)
            activations = None
        else:
            generations, activations = await _steer_and_capture(executor, job, work, capture, finished)
    except SteerError as error:
        raise JobFailure("SteerFailed", str(error)) from None
    except HarvestError as error:
        raise JobFailure("CaptureFailed", str(error)) from None
    except RequestRefused as refused:
        raise JobFailure(type(refused).__name__, str(refused)) from None
    data = json.dumps({"format": RESULT_FORMAT, "generations": [g.to_json() for g in generations]}).encode()
    stored = await asyncio.to_thread(executor.sinks.put_result, job.id, job.attempts, RESULT_FILE, data)
    stamp("committed")
    return Execution(total, dataclasses.replace(stored, safetensors=activations))


async def _steer_and_capture(
    executor: Any, job: Job, work: SteerWork, capture: dict[str, Any], finished: Callable[[int], None]
) -> tuple[list[Generation], Digest]:
    """Steer and capture in one pass; the generations, and the activations file as uploaded (size, sha256)."""
    llm = executor.model.vllm_entrypoint
    try:
        captures = check_captures([Capture.from_json(c) for c in capture["captures"]])
        selection = Selection.from_json(capture["selection"])
        dtype = check_dtype(capture["dtype"])
    except (ValueError, KeyError, TypeError) as error:
        raise JobFailure("InvalidPayload", f"the steering job's captures are not usable: {error}") from None
    bound = shard_bound(
        work.token_ids,
        llm.model_config,
        captures=len(captures),
        selection=selection,
        dtype=dtype,
        generated=work.sampling.generation().positions,
    )
    key = result_key(job.id, ACTIVATIONS_FILE, job.attempts)
    name = f"{job.id}-{job.attempts}-{ACTIVATIONS_FILE}"
    async with executor.sinks.staged_shard(key, name, bound) as sink:
        generations, result = await run_steering_captured(
            llm, work, SteerCapture(captures, selection, dtype, sink.spec), finished
        )
        digest = await _commit(executor, sink, result)
    return generations, digest


async def _commit(executor: Any, sink: ShardSink, result: ChunkResult) -> Digest:
    try:
        return await asyncio.to_thread(executor.sinks.commit_shard, sink, WrittenObject(result.bytes, result.sha256))
    except (ResultNotWritten, OSError, ObjectNotFound) as error:
        raise JobFailure("ResultWriteFailed", f"the activations did not reach the store: {error}") from None


def _tokenize(model: Any, prompts: list[Any]) -> list[list[int]]:
    ids = []
    for index, prompt in enumerate(prompts):
        tokens = model.tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
        if not tokens:
            raise ValueError(f"prompt {index} has no tokens")
        ids.append([int(t) for t in tokens])
    return ids
