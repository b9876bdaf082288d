"""The reference a queued trace is compared with: the same trace run by nnsight's own flow on the in-process engine."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.utils.engines import InProcessEngine
    from tests.utils.payloads import TraceBackend


class InProcessBackend:
    """Run the trace on the session's in-process engine the way nnsight runs one on its own engine (a backend as
    ``tests.utils.payloads``' are: called with the tracer, no subclass of nnsight's ``Backend``).

    nnsight's synchronous path, step for step (``VLLMTracer.execute`` around ``VLLM._call``): build the
    mediators and attach them to the requests, generate (final outputs only, as vLLM's ``LLM.generate``
    makes every request), collect each finished request's saves from the engine (``acollect`` + ``attach``,
    what ``NNsightLLMEngine.step`` does per finished request), merge them with ``VLLM._collect`` (which
    raises the first deferred error), and push the saves into the trace's frame even when it raises. Only
    the generate is the async engine's. ``saves`` is what was pushed.
    """

    def __init__(self, engine: InProcessEngine) -> None:
        self.engine = engine
        self.saves: dict[str, Any] = {}

    def __call__(self, tracer: Any) -> None:
        from nnsight.intervention.util import clear_shared_locals
        from nnsight.modeling.vllm import VLLM
        from nnsight.tracing.tracer import _saves, push_result
        from vllm.sampling_params import RequestOutputKind

        model = tracer.envoy
        try:
            mediators, (prompts, params, loras), kwargs = tracer.prepare(tracer.info.code)
            try:
                attached = model._attach_mediators(params, **kwargs)
                for param in params:
                    param.output_kind = RequestOutputKind.FINAL_ONLY
                outputs = self.engine.run(_generate_and_collect(self.engine.model, prompts, params, loras))
                VLLM._collect(attached, outputs)
            finally:
                saved = _saves()
                for mediator in mediators:
                    writes = mediator.lcls.writes()
                    self.saves.update({name: value for name, value in writes.items() if id(value) in saved})
                    push_result(tracer.info.frame, writes)
        finally:
            model.interleaver.cancel()
            clear_shared_locals()


async def _generate_and_collect(engine: Any, prompts: list[Any], params: list[Any], loras: list[Any]) -> list[Any]:
    from nnsight.modeling.vllm.engines.engine import acollect, attach

    async def one(prompt: Any, param: Any, lora: Any) -> Any:
        request_id = f"reference-{uuid.uuid4().hex}"
        async for step in engine.vllm_entrypoint.generate(prompt, param, request_id, lora_request=lora):
            output = step
        entry = await acollect(engine.vllm_entrypoint, request_id, output)
        if entry is not None:
            attach(output, entry)
        return output

    return list(await asyncio.gather(*(one(*request) for request in zip(prompts, params, loras, strict=True))))


def reference_saves(client: Any, engine: InProcessEngine, trace: Callable[[Any, TraceBackend], None]) -> dict[str, Any]:
    """What ``trace(client, backend)`` saves when nnsight runs it on the in-process engine."""
    backend = InProcessBackend(engine)
    trace(client, backend)
    return backend.saves
