"""TRL's vLLM server protocol beside the queue: a trainer's unmodified ``VLLMClient`` (``trl.generation.vllm_client``,
TRL 1.0-1.4; ``trl.extras.vllm_client`` before) generates with this worker's engine and pushes new weights into it
over NCCL, while nnqueue's jobs run between its updates.

Off unless ``NNQUEUE_TRAINER_PORT`` is set. The HTTP server (FastAPI under uvicorn) runs on the worker's engine
loop, so a trainer's ``/generate/`` is an ordinary ``AsyncLLM.generate`` call, batched by vLLM with every job's
requests, and holding the weights gate as a job does (:class:`nnqueue.workers.weights.WeightsGate`). The endpoints
are TRL's ``trl vllm-serve``'s (the paths its client calls, with their trailing slash):

* ``GET /health/``, ``GET /get_world_size/`` (open: the client calls them with bare ``requests``);
* ``POST /generate/``, ``/init_communicator/``, ``/update_named_param/``, ``/reset_prefix_cache/``,
  ``/close_communicator/``: a key of the ``weights`` scope, as ``Authorization: Bearer <key>`` (set it on the
  client's ``session.headers``), else 401/403.

**Weights over NCCL.** ``init_communicator`` joins the trainer's group (``nnqueue_trainer_open`` on every rank,
:mod:`nnqueue.enginecore.weights_update`); the engine's rank 0 listens for the group's store on
``NNQUEUE_TRAINER_NCCL_HOST``:``NNQUEUE_TRAINER_NCCL_PORT`` only, and a request naming another port is refused
(400): nothing else is ever bound. The first ``update_named_param`` of an update pauses the engine's requests (it
answers once the running ones have finished, so the trainer's broadcast never waits behind them); each one then
receives its tensor and loads it through vLLM's loader, in order. ``reset_prefix_cache`` (TRL's trainers call it
after pushing), a ``generate`` or ``close_communicator`` ends the update: if every tensor loaded, the weights guard
takes the new weights as its reference, the prefix cache is reset and the worker serves a new version
``trl-<n>-<random>`` (recorded in its registry row); if one failed (a trainer that went away mid-broadcast: every
collective has a deadline, ``NNQUEUE_TRAINER_TIMEOUT_S``), the previous weights are put back from the guard's copy
and the version stands. An update left open with no call for ``NNQUEUE_TRAINER_UPDATE_IDLE_S`` is rolled back the
same way. Without a weights guard there is no copy to put back: the worker then stops for a fresh start (its
supervisor restarts it on the model's checkpoint version). A trainer-pushed version is this worker's alone: a
worker started later serves the checkpoint (and its swaps), and jobs pinned to a trainer version wait for it.

NCCL needs a CUDA engine reachable from the trainer: the engine's processes use the host's network and may open
TCP sockets when the option is on (:func:`nnqueue.workers.main.isolate`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request, status
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.models import ApiKey
from nnqueue.scheduler import registry
from nnqueue.settings import Settings
from nnqueue.workers.weights import WeightsGate

log = logging.getLogger(__name__)
SCOPE = "weights"
KEY_CACHE_S = 30.0


class GenerateRequest(BaseModel):
    """TRL's ``/generate/`` body (images are not served here)."""

    prompts: list[str] | list[list[int]]
    images: list[Any] | None = None
    n: int = Field(1, ge=1)
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = 0
    structured_outputs_regex: str | None = None
    generation_kwargs: dict[str, Any] = Field(default_factory=dict)


class InitCommunicatorRequest(BaseModel):
    host: str
    port: int
    world_size: int
    client_device_uuid: str = ""


class UpdateNamedParamRequest(BaseModel):
    name: str = Field(min_length=1, max_length=1000)
    dtype: str = Field(min_length=1, max_length=64)
    shape: list[int]


class KeyCheck:
    """Whether a bearer secret is a live key with the ``weights`` scope (the API's key table, sha256 of the secret
    as ``nnqueue.api.auth.hash_secret`` stores it), remembered for ``KEY_CACHE_S``."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions
        self._seen: dict[str, tuple[float, list[str] | None]] = {}

    def scopes(self, secret: str) -> list[str] | None:
        digest = hashlib.sha256(secret.encode()).hexdigest()
        cached = self._seen.get(digest)
        if cached is not None and time.monotonic() - cached[0] < KEY_CACHE_S:
            return cached[1]
        with self.sessions() as session:
            key = session.scalar(select(ApiKey).where(ApiKey.key_hash == digest, ApiKey.revoked_at.is_(None)))
            scopes = list(key.scopes) if key is not None else None
        self._seen[digest] = (time.monotonic(), scopes)
        return scopes

    async def __call__(self, request: Request) -> None:
        header = request.headers.get("authorization", "")
        secret = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
        if not secret:
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "an API key with the 'weights' scope is needed")
        scopes = await asyncio.to_thread(self.scopes, secret)
        if scopes is None:
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "unknown or revoked API key")
        if SCOPE not in scopes:
            raise HTTPException(status.HTTP_403_FORBIDDEN, "this API key lacks the 'weights' scope")


@dataclass
class TrainerUpdates:
    """A trainer's NCCL updates of this worker's engine (see the module doc). Used on the engine loop."""

    llm: Any  # the worker's AsyncLLM
    gate: WeightsGate
    settings: Settings
    report: Callable[[str, dict[str, Any]], Awaitable[None]]  # record the version the worker serves
    broken: Callable[[], None]  # the weights changed and cannot be put back: stop the worker
    updates: int = 0
    _chain: asyncio.Future[Any] | None = None  # the RPCs of the open update, in order
    _failures: list[str] = field(default_factory=list)
    _began: float | None = None  # loop time the open update paused requests (None: no update open)
    _last_call: float = 0.0
    _watch: asyncio.Task[None] | None = None
    _open_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def world_size(self) -> int:
        return int(self.llm.vllm_config.parallel_config.world_size)

    async def init_communicator(self, body: InitCommunicatorRequest) -> None:
        port, nccl_port = body.port, self.settings.trainer_nccl_port
        if nccl_port is None:
            raise HTTPException(status.HTTP_409_CONFLICT, "this worker takes no NCCL weight updates")
        if port != nccl_port:
            raise HTTPException(
                status.HTTP_400_BAD_REQUEST, f"this worker's NCCL group listens on port {nccl_port} only, not {port}"
            )
        if body.world_size != self.world_size + 1:
            raise HTTPException(
                status.HTTP_400_BAD_REQUEST,
                f"world size {body.world_size}: this engine has {self.world_size} rank(s), plus the trainer",
            )
        await self.finish()
        args = (self.settings.trainer_nccl_host, nccl_port, body.world_size, self.settings.trainer_timeout_s)
        self._then("nnqueue_trainer_open", args)  # not awaited: the trainer joins the group meanwhile

    async def update_named_param(self, body: UpdateNamedParamRequest) -> None:
        async with self._open_lock:
            if self._began is None:
                self._began = await self.gate.pause()
                self._failures = []
                self._watch = asyncio.ensure_future(self._close_when_idle())
        self._last_call = asyncio.get_running_loop().time()
        self._then("nnqueue_trainer_receive", (body.name, body.dtype, list(body.shape)))

    async def finish(self) -> str:
        """End the open update (commit or roll back); the version served after."""
        async with self._open_lock:
            if self._began is None:
                return self.gate.version
            began, self._began = self._began, None
            if self._watch is not None and self._watch is not asyncio.current_task():
                self._watch.cancel()
            if self._chain is not None:
                await asyncio.gather(self._chain, return_exceptions=True)
            if self._failures:
                await self._roll_back(began)
            else:
                await self._commit(began)
            return self.gate.version

    async def close_communicator(self) -> None:
        await self.finish()
        await self.llm.collective_rpc("nnqueue_trainer_close")

    async def _commit(self, began: float) -> None:
        await self.llm.collective_rpc("nnqueue_weights_commit")
        await self.llm.reset_prefix_cache()
        self.updates += 1
        version = f"trl-{self.updates}-{secrets.token_hex(4)}"
        source = {"source": "trainer", "update": self.updates, "previous": self.gate.version}
        await self.gate.resume(began, version, source)
        log.info("trainer update %d applied: serving %s", self.updates, version)
        await self.report(version, source)

    async def _roll_back(self, began: float) -> None:
        restored = all(await self.llm.collective_rpc("nnqueue_weights_rollback"))
        cause = "; ".join(self._failures[:3])
        if not restored:
            log.critical(
                "a trainer update failed (%s) and no weights guard holds the previous weights: stopping", cause
            )
            await self.gate.resume(began)
            self.broken()
            return
        await self.llm.reset_prefix_cache()
        log.error("a trainer update failed and was rolled back, still serving %s: %s", self.gate.version, cause)
        await self.gate.resume(began)
        await self.report(self.gate.version, {**self.gate.source, "error": f"trainer update rolled back: {cause}"})

    def _then(self, method: str, args: tuple[Any, ...]) -> None:
        """Run ``collective_rpc(method, args)`` after the RPCs already asked for; failures end the update."""
        previous = self._chain

        async def run() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            try:
                answers = await self.llm.collective_rpc(method, args=args)
            except Exception as error:  # noqa: BLE001 - recorded; the update is rolled back when it ends
                self._failures.append(f"{method}: {type(error).__name__}: {error}")
                return
            errors = [str(answer["error"]) for answer in answers if isinstance(answer, dict) and answer.get("error")]
            if errors:
                log.error("%s failed: %s", method, errors[0])
                self._failures.append(f"{method}: {errors[0]}")

        self._chain = asyncio.ensure_future(run())

    async def _close_when_idle(self) -> None:
        idle_s = self.settings.trainer_update_idle_s
        loop = asyncio.get_running_loop()
        while self._began is not None:
            await asyncio.sleep(min(idle_s, 1.0))
            if self._began is not None and loop.time() - self._last_call > idle_s:
                self._failures.append(f"no call from the trainer for {idle_s:g} s in the middle of an update")
                await self.finish()


def create_app(
    updates: TrainerUpdates, sessions: sessionmaker[Session], model_name: str, generate: Callable[..., Awaitable[Any]]
) -> FastAPI:
    """The protocol's routes; ``generate(prompts, sampling_params)`` runs the requests on the engine (gated)."""
    app = FastAPI(title="nnqueue worker: TRL's vLLM server protocol")
    keyed = [Depends(KeyCheck(sessions))]

    @app.get("/health/")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/get_world_size/")
    async def get_world_size() -> dict[str, int]:
        return {"world_size": updates.world_size}

    @app.post("/generate/", dependencies=keyed)
    async def generate_route(body: GenerateRequest) -> dict[str, Any]:
        if body.images and any(image is not None for image in body.images):
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "images are not served by nnqueue workers")
        await updates.finish()  # a trainer that generates has finished pushing
        return await generate(body.prompts, sampling_params(body))

    @app.post("/init_communicator/", dependencies=keyed)
    async def init_communicator(body: InitCommunicatorRequest) -> dict[str, str]:
        await updates.init_communicator(body)
        return {"message": "Request received, initializing communicator"}

    @app.post("/update_named_param/", dependencies=keyed)
    async def update_named_param(body: UpdateNamedParamRequest) -> dict[str, str]:
        await updates.update_named_param(body)
        return {"message": "Request received, updating named parameter"}

    @app.post("/reset_prefix_cache/", dependencies=keyed)
    async def reset_prefix_cache() -> dict[str, str]:
        version = await updates.finish()
        await updates.llm.reset_prefix_cache()
        return {"message": "Request received, resetting prefix cache status: True", "weights_version": version}

    @app.post("/close_communicator/", dependencies=keyed)
    async def close_communicator() -> dict[str, str]:
        await updates.close_communicator()
        return {"message": "Request received, closing communicator"}

    app.state.model_name = model_name
    return app


def sampling_params(body: GenerateRequest) -> Any:
    """vLLM's ``SamplingParams`` for a TRL generate request (TRL's server builds the same)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kwargs: dict[str, Any] = {
        "n": body.n,
        "repetition_penalty": body.repetition_penalty,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "max_tokens": body.max_tokens,
        "logprobs": body.logprobs,
    }
    kwargs.update(body.generation_kwargs)
    if body.structured_outputs_regex is not None:
        from vllm.sampling_params import StructuredOutputsParams

        kwargs["structured_outputs"] = StructuredOutputsParams(regex=body.structured_outputs_regex)
    kwargs["output_kind"] = RequestOutputKind.FINAL_ONLY  # one answer per prompt, with all of its n completions
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as error:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"sampling parameters: {error}") from None


async def run_generate(llm: Any, gate: WeightsGate, prompts: list[Any], params: Any) -> dict[str, Any]:
    """Generate for each prompt on the engine, holding the weights still (as a job does): TRL's response."""
    async with gate.serving() as version:
        outputs = await asyncio.gather(*(_one(llm, prompt, params) for prompt in prompts))
    prompt_ids = [list(output.prompt_token_ids or []) for output in outputs]
    completions = [completion for output in outputs for completion in output.outputs]
    logprobs, token_ids = _logprobs(completions) if params.logprobs is not None else (None, None)
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": [list(completion.token_ids) for completion in completions],
        "logprobs": logprobs,
        "logprob_token_ids": token_ids,
        "weights_version": version,
    }


async def _one(llm: Any, prompt: Any, params: Any) -> Any:
    request = {"prompt_token_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
    final = None
    async for output in llm.generate(request, params, request_id=f"trl-{secrets.token_hex(8)}"):
        final = output
    assert final is not None
    return final


def _logprobs(completions: list[Any]) -> tuple[list[Any], list[Any]]:
    """Per completion, per token, the logprobs sorted best first and their token ids (TRL's ``extract_logprobs``)."""
    values, ids = [], []
    for completion in completions:
        seq_values, seq_ids = [], []
        for position in completion.logprobs or []:
            ranked = sorted(position.items(), key=lambda item: -item[1].logprob)
            seq_ids.append([token for token, _ in ranked])
            seq_values.append([None if entry.logprob != entry.logprob else entry.logprob for _, entry in ranked])
        values.append(seq_values)
        ids.append(seq_ids)
    return values, ids


async def serve(
    llm: Any,
    gate: WeightsGate,
    settings: Settings,
    sessions: sessionmaker[Session],
    worker_id: str,
    model_name: str,
    broken: Callable[[], None],
) -> Any:
    """Start the protocol's server on the running (engine) loop; returns the uvicorn server (``should_exit`` stops
    it)."""
    import uvicorn

    async def report(version: str, source: dict[str, Any]) -> None:
        await asyncio.to_thread(registry.set_weights, sessions, worker_id, version, source)

    updates = TrainerUpdates(llm, gate, settings, report, broken)

    async def generate(prompts: list[Any], params: Any) -> dict[str, Any]:
        return await run_generate(llm, gate, prompts, params)

    app = create_app(updates, sessions, model_name, generate)
    port = settings.trainer_port
    assert port is not None
    config = uvicorn.Config(app, host=settings.trainer_host, port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    # Bound here, so that a port already taken fails the worker at start (uvicorn would exit the process).
    listening = socket.create_server((settings.trainer_host, port), reuse_port=False)
    app.state.serving = asyncio.ensure_future(server.serve(sockets=[listening]))
    log.info("serving TRL's vLLM server protocol on %s:%d", settings.trainer_host, port)
    return server
