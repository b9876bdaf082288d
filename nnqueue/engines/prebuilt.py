"""A prebuilt trace payload as the vLLM requests to submit, built without unpickling anything.

The payload's header is validated by :func:`nnqueue.trace_payload.decode`; each invoke's sampling settings
become a ``SamplingParams`` through ``msgspec.convert`` (typed, and vLLM's own checks run in its
``__post_init__``), and its mediator bytes go into ``extra_args`` untouched, for nnsight to load inside
the engine process, with the trace's envoy tree (a format 2 payload: the sha256 it came with and its bytes,
:mod:`nnqueue.enginecore.envoy_trees`), which the engine verifies the first time it sees it. Any problem is a
:class:`~nnqueue.trace_payload.PayloadError` naming the invoke.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind

from nnqueue.enginecore.envoy_trees import EXTRA_ARG as ENVOY_TREE
from nnqueue.trace_payload import PayloadError, PrebuiltTrace

# Fields a payload may set: SamplingParams' public ones but extra_args, which carries the mediator.
SAMPLING_FIELDS = frozenset(
    name for name in SamplingParams.__struct_fields__ if not name.startswith("_") and name != "extra_args"
)


@dataclass(frozen=True)
class TraceRequests:
    """One trace's vLLM requests, in invoke order."""

    request_ids: list[str]
    prompts: list[Any]
    params: list[SamplingParams]


def to_requests(trace: PrebuiltTrace, request_id_prefix: str) -> TraceRequests:
    """The trace's requests, with ids ``f"{request_id_prefix}-{invoke index}"`` (the prefix must be unique
    among requests in flight on the engine)."""
    prompts, params = [], []
    tree = None if trace.envoys is None else [trace.envoys.sha256, trace.envoys.data]
    for index, invoke in enumerate(trace.invokes):
        unknown = sorted(set(invoke.sampling) - SAMPLING_FIELDS)
        if unknown:
            raise PayloadError(f"invoke {index}: sampling settings {unknown} are unknown to this server's vLLM")
        # What vLLM's offline LLM (nnsight's synchronous engine) does to every request: only the finished
        # output is produced, which `tracer.result` is served, and the engine loop is spared one output
        # per generated token. (With n > 1 it holds every sequence's completion.)
        sampling = {**invoke.sampling, "output_kind": RequestOutputKind.FINAL_ONLY.value}
        try:
            param = msgspec.convert(sampling, SamplingParams, strict=False)
        except Exception as error:  # noqa: BLE001 - msgspec's type checks, or vLLM's own (VLLMValidationError, ValueError)
            raise PayloadError(f"invoke {index}: invalid sampling settings: {error}") from None
        extra: dict[str, Any] = {"nnsight_mediator": invoke.mediator}
        if invoke.edits is not None:
            extra["nnsight_edits"] = list(invoke.edits)
        if tree is not None:
            extra[ENVOY_TREE] = tree
        param.extra_args = extra
        params.append(param)
        prompt = invoke.prompt
        prompts.append(
            prompt["prompt"] if "prompt" in prompt else TokensPrompt(prompt_token_ids=prompt["prompt_token_ids"])
        )
    request_ids = [f"{request_id_prefix}-{index}" for index in range(len(prompts))]
    return TraceRequests(request_ids, prompts, params)
