"""Run one steering job on an engine: begin it on every rank, generate its prompts, collect what was generated.

Runs on the worker's engine loop. Each prompt becomes a ``TokensPrompt`` tagged for the engine's steering
path (`nnqueue.enginecore.steering`) and salted for vLLM's prefix cache with a digest of the job's edits and
vectors (``cache_salt``): a steered prompt never reuses the blocks of an unsteered one, or of one steered
otherwise, while identical steering shares them. The generations come back as vLLM's outputs; nothing is
read from the engine process but those.

Cancelling `run_steering` (or any failure) aborts the job's requests and drops the job on every rank.

`run_steering_captured` also records activations in the same pass: a harvest chunk (`SteerCapture`: a harvest's
captures, selection and dtype) is begun on the engine for the job (`harvest_runner.capture_chunk`), and every
steered request carries both tags in its ``extra_args``, the steering path's and the capture path's
(`nnqueue.enginecore.harvest_capture`), which each read only their own. The engine writes the shard, a harvest
shard's format (one row per selected token: ``prompt_index``, ``token_position``, ``token_id`` and a tensor per
capture; prompt indices are the job's prompt order), to the capture's sink. At a point that is both edited and
captured the capture sees the edited value: steering's hooks run before any other hook of the module
(`nnqueue.enginecore.steering`). Captured requests skip reading vLLM's prefix cache (every token must run through
the model to be captured), as a harvest's do.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nnqueue.enginecore.harvest_capture import TAG as CAPTURE_TAG
from nnqueue.enginecore.harvest_spec import Capture, Selection
from nnqueue.enginecore.harvest_spec import Generation as ChunkGeneration
from nnqueue.enginecore.steer_spec import Edit, check_edits
from nnqueue.enginecore.steering import TAG
from nnqueue.engines.harvest_runner import ChunkResult, ChunkWork, capture_chunk
from nnqueue.engines.outbox import poller
from nnqueue.errors import NNqueueError
from nnqueue.timeline import stamp

__all__ = [
    "Edit",
    "Generation",
    "Sampling",
    "SteerCapture",
    "SteerError",
    "SteerWork",
    "run_steering",
    "run_steering_captured",
]


class SteerError(NNqueueError, RuntimeError):
    """The engine refused the steering job, or aborted one of its prompts; the message says why."""


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters a steering job may set (greedy by default)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # the top-k log-probabilities of each generated token, and the chosen one's
    ignore_eos: bool = False

    def to_vllm(self, extra_args: dict[str, Any], captured: bool = False) -> Any:
        """vLLM's ``SamplingParams``; ``captured``: every token runs through the model (no prefix-cache reads)."""
        from vllm import SamplingParams

        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            logprobs=self.logprobs,
            ignore_eos=self.ignore_eos,
            skip_reading_prefix_cache=captured,
            extra_args=extra_args,
        )

    def generation(self) -> ChunkGeneration:
        """This sampling as a harvest chunk's generation (the capture path bounds each request's rows with it)."""
        return ChunkGeneration(self.max_tokens, self.temperature, self.seed, self.ignore_eos)


@dataclass(frozen=True)
class SteerCapture:
    """What to record while a job steers: a harvest's captures, token selection and stored dtype, and the sink the
    engine writes the shard to (`nnqueue.enginecore.sink`)."""

    captures: Sequence[Capture]
    selection: Selection
    dtype: str
    sink: Mapping[str, Any]


@dataclass(frozen=True)
class SteerWork:
    """One steering job, ready to run: its prompts (token ids), edits, vectors (name -> float32 bytes)."""

    job_id: str
    token_ids: Sequence[Sequence[int]]
    edits: Sequence[Edit]
    vectors: Mapping[str, bytes] = field(default_factory=dict)
    sampling: Sampling = field(default_factory=Sampling)

    def __post_init__(self) -> None:
        if not self.token_ids or not all(self.token_ids):
            raise ValueError("a steering job needs at least one prompt, and no empty one")
        check_edits(list(self.edits))

    def salt(self) -> str:
        """The prefix-cache salt: a digest of what the steering does (edits, vectors), not of who asked."""
        digest = hashlib.sha256(json.dumps([e.to_json() for e in self.edits], sort_keys=True).encode())
        for name in sorted(self.vectors):
            digest.update(name.encode() + b"\0" + bytes(self.vectors[name]))
        return "nnqueue-steer-" + digest.hexdigest()


@dataclass(frozen=True)
class Generation:
    """One prompt's generation: its token ids, text, why it stopped, and per token its log-probability and the
    top-k (when asked)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "logprobs": self.logprobs,
            "top_logprobs": (
                None if self.top_logprobs is None else [{str(k): v for k, v in t.items()} for t in self.top_logprobs]
            ),
        }


async def run_steering(llm: Any, work: SteerWork, on_finished: Callable[[int], None] | None = None) -> list[Generation]:
    """Run ``work`` on ``llm`` (an ``AsyncLLM`` whose workers mix in ``NNqueueRPC``); a `Generation` per prompt,
    in prompt order. ``on_finished(done)`` is called as prompts finish."""
    return await _steer(llm, work, _request_ids(work), on_finished, lambda _index: {})


async def run_steering_captured(
    llm: Any, work: SteerWork, capture: SteerCapture, on_finished: Callable[[int], None] | None = None
) -> tuple[list[Generation], ChunkResult]:
    """`run_steering`, recording ``capture`` in the same pass: the generations, and the shard the engine wrote to
    ``capture.sink`` (its rows, size, sha256). Raises `SteerError`, or `HarvestError` when the capture failed."""
    chunk = ChunkWork(
        chunk_id=work.job_id,
        prompt_indices=range(len(work.token_ids)),
        token_ids=work.token_ids,
        captures=capture.captures,
        selection=capture.selection,
        dtype=capture.dtype,
        sink=capture.sink,
        metadata={"steering_job_id": work.job_id},
        generation=work.sampling.generation(),
    )
    request_ids = _request_ids(work)

    def steered(key: str) -> Awaitable[list[Generation]]:
        return _steer(llm, work, request_ids, on_finished, lambda index: {CAPTURE_TAG: {"chunk": key, "prompt": index}})

    return await capture_chunk(llm, chunk, request_ids, steered)


def _request_ids(work: SteerWork) -> list[str]:
    return [f"nnqs-{uuid.uuid4().hex[:12]}-{i}" for i in range(len(work.token_ids))]


async def _steer(
    llm: Any,
    work: SteerWork,
    request_ids: list[str],
    on_finished: Callable[[int], None] | None,
    tags: Callable[[int], dict[str, Any]],
) -> list[Generation]:
    """Begin the job on every rank, generate its prompts (prompt ``i``'s request also tagged ``tags(i)``), end it."""
    key = f"{work.job_id}/{uuid.uuid4().hex[:8]}"
    spec = {"job": key, "edits": [e.to_json() for e in work.edits], "vectors": dict(work.vectors)}
    done = 0

    async def generate(index: int, request_id: str, ids: Sequence[int]) -> Generation:
        nonlocal done
        extra_args = {TAG: {"job": key}, **tags(index)}
        generation = await _generate(llm, request_id, ids, work, extra_args)
        done += 1
        if on_finished is not None:
            on_finished(done)
        return generation

    calls = poller(llm)  # the begin and end go with the other jobs' calls of the moment, in one RPC
    try:
        answers = await calls.call("nnqueue_steer_begin", spec)
        refused = [a for a in answers if not isinstance(a, dict) or a.get("job") != key]
        if refused:
            raise SteerError(f"the engine refused steering job {work.job_id}: {_reason(refused[0])}")
        stamp("submitted")
        generations = await asyncio.gather(
            *(generate(i, r, ids) for i, (r, ids) in enumerate(zip(request_ids, work.token_ids, strict=True)))
        )
        stamp("last_output")
    except BaseException:
        await asyncio.shield(llm.abort(request_ids))
        await asyncio.shield(calls.call("nnqueue_steer_end", key))
        raise
    ends = await calls.call("nnqueue_steer_end", key)
    stamp("written")
    errors = [end.get("error") for end in ends if isinstance(end, dict) and end.get("error")]
    if errors or not all(isinstance(end, dict) and end.get("ended") for end in ends):
        raise SteerError(f"steering job {work.job_id} failed on the engine: {errors[0] if errors else ends!r:.2000}")
    return list(generations)


async def _generate(
    llm: Any, request_id: str, token_ids: Sequence[int], work: SteerWork, extra_args: dict[str, Any]
) -> Generation:
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(token_ids), cache_salt=work.salt())
    params = work.sampling.to_vllm(extra_args, captured=CAPTURE_TAG in extra_args)
    final = None
    async for output in llm.generate(prompt, params, request_id):
        stamp("first_output")
        final = output
    if final is None or not final.outputs:
        raise SteerError(f"request {request_id} ended without output")
    out = final.outputs[0]
    if out.finish_reason == "abort":
        raise SteerError(f"request {request_id} was aborted by the engine")
    ids = list(out.token_ids)
    chosen, top = None, None
    if work.sampling.logprobs is not None and out.logprobs is not None:
        chosen = [float(step[token].logprob) for step, token in zip(out.logprobs, ids, strict=True)]
        top = [{int(t): float(lp.logprob) for t, lp in step.items()} for step in out.logprobs]
    return Generation(ids, out.text or "", out.finish_reason, chosen, top)


def _reason(answer: Any) -> str:
    if isinstance(answer, dict) and "error" in answer:
        return str(answer["error"])[:2000]
    return f"unexpected answer {answer!r:.200}"
