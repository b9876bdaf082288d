"""The prebuilt trace format: what the client writes is what the worker reads, and what it refuses, it names.

The requests a worker builds from a prebuilt payload must equal the ones nnsight builds for a local run of
the same trace (``VLLMTracer.prepare`` + ``VLLM._attach_mediators``: prompts, every sampling setting with the
trace-level ones filled in where an invoke did not name its own, mediator bytes, edit names), plus the trace's
envoy tree, which a format 2 payload carries once for all its mediators; format 1 payloads are still read.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from nnqueue import trace_payload
from nnqueue.trace_payload import Invoke, PayloadError, PrebuiltTrace, UnsupportedTrace
from tests.utils.payloads import PROMPTS, PayloadBackend, PrebuiltBackend


class Requests:
    """What nnsight hands its own engine for a trace: ``_attach_mediators``'s requests, kept instead of run."""

    def __call__(self, tracer: Any) -> None:
        from nnsight.intervention.util import clear_shared_locals

        model = tracer.envoy
        try:
            _, (self.prompts, self.params, _), kwargs = tracer.prepare(tracer.info.code)
            model._attach_mediators(self.params, **kwargs)
        finally:
            model.interleaver.cancel()
            clear_shared_locals()


def mixed_trace(model: Any, backend: Any) -> None:
    ids = model.tokenizer(PROMPTS[1]).input_ids
    with model.trace(temperature=0.5, top_p=0.9, max_tokens=3, seed=7, backend=backend) as tracer:
        with tracer.invoke(PROMPTS[0], max_tokens=5, stop=["."]):  # names its own max_tokens: kept
            a = model.logits.save()
        with tracer.invoke(ids, temperature=1.0):  # temperature=1.0 is vLLM's default, but named: kept
            b = model.logits.save()


def to_requests(trace: PrebuiltTrace, job: str) -> Any:
    """The worker's requests for ``trace`` (``nnqueue.engines.prebuilt`` imports vLLM: only when a test runs)."""
    from nnqueue.engines.prebuilt import to_requests

    return to_requests(trace, job)


def test_the_worker_builds_the_requests_nnsight_builds(client_model: Any) -> None:
    from vllm.sampling_params import RequestOutputKind

    from nnqueue.enginecore.envoy_trees import EXTRA_ARG as ENVOY_TREE

    local, prebuilt = Requests(), PrebuiltBackend()
    mixed_trace(client_model, local)
    mixed_trace(client_model, prebuilt)
    requests = to_requests(trace_payload.decode(prebuilt.payload), "job-1")

    assert requests.request_ids == ["job-1-0", "job-1-1"]
    assert requests.prompts[0] == local.prompts[0] == PROMPTS[0]
    assert requests.prompts[1] == local.prompts[1]  # TokensPrompt: a dict of the token ids
    assert [param.temperature for param in requests.params] == [0.5, 1.0]
    assert [param.max_tokens for param in requests.params] == [5, 3]
    tree = trace_payload.decode(prebuilt.payload).envoys
    assert tree is not None
    for built, expected in zip(requests.params, local.params, strict=True):
        assert built.output_kind is RequestOutputKind.FINAL_ONLY  # as vLLM's offline LLM makes every request
        built.output_kind = expected.output_kind
        mediator = built.extra_args.pop("nnsight_mediator")
        assert mediator[:2] == b"\x80\x04" and len(mediator) > 100
        # The tree, once for the trace (nnsight's own requests carry it in every mediator).
        assert len(mediator) < len(expected.extra_args["nnsight_mediator"]) - len(tree.data) / 2
        assert tree.sha256.encode() in mediator and built.extra_args.pop(ENVOY_TREE) == [tree.sha256, tree.data]
        expected.extra_args = {}
        built.extra_args = {}
        assert msgspec.to_builtins(built) == msgspec.to_builtins(expected)


def test_edit_names_ride_with_the_invoke() -> None:
    trace = PrebuiltTrace([Invoke({"prompt": "x"}, {"max_tokens": 1}, b"mediator", ["probe"])], "0.8.1", "3.11.7")
    [params] = to_requests(trace_payload.decode(trace_payload.encode(trace)), "j").params
    assert params.extra_args == {"nnsight_mediator": b"mediator", "nnsight_edits": ["probe"]}


def test_payload_kinds(client_model: Any) -> None:
    raw, prebuilt = PayloadBackend(), PrebuiltBackend()
    for backend in (raw, prebuilt):
        with client_model.trace(PROMPTS[0], max_tokens=1, backend=backend):
            logits = client_model.logits.save()
    assert trace_payload.payload_kind(prebuilt.payload) == "prebuilt"
    assert trace_payload.payload_kind(raw.payload) == "nnsight"
    assert trace_payload.payload_kind(trace_payload.ZSTD_MAGIC + b"...") == "nnsight"
    assert trace_payload.payload_kind(b"\x80\x04\x95" + (10**6).to_bytes(8, "little")) is None  # frame past the end
    assert trace_payload.payload_kind(b"GIF89a") is None


def one_invoke(header_fields: dict[str, Any] | None = None, blobs: bytes = b"abc", **fields: Any) -> bytes:
    invoke = {"prompt": {"prompt": "x"}, "sampling": {}, "mediator": [0, 3], "edits": None, **fields}
    header = {"format": 1, "nnsight": "0.8.1", "python": "3.11.7", "invokes": [invoke], **(header_fields or {})}
    import json

    encoded = json.dumps(header).encode()
    return trace_payload.MAGIC + len(encoded).to_bytes(8, "big") + encoded + blobs


SHA = "ab" * 32


def with_tree(**envoys: Any) -> bytes:
    """A format 2 payload: a 4-byte tree, then the 3-byte mediator."""
    tree = {"sha256": SHA, "blob": [0, 4], **envoys}
    return one_invoke({"format": 2, "envoys": tree}, b"TREEabc", mediator=[4, 3])


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (one_invoke(), None),
        (one_invoke()[:-1], "are not the next blob"),
        (one_invoke() + b"x", "1 bytes after the last mediator"),
        (one_invoke(mediator=[1, 2]), "are not the next blob"),
        (one_invoke(mediator=["0", 3]), "mediator must be [offset, length]"),
        (one_invoke(prompt={"prompt": 3}), "prompt must be a string"),
        (one_invoke(prompt={"prompt_token_ids": [1, -2]}), "prompt_token_ids must be"),
        (one_invoke(prompt={"multi_modal_data": {}}), "prompt must be"),
        (one_invoke(sampling={"_eos_token_id": 2}), "public SamplingParams fields"),
        (one_invoke(sampling={"extra_args": {}}), "must not carry extra_args"),
        (one_invoke(sampling={"extra_args": {"nnqueue_harvest": {"chunk": "c", "prompt": 0}}}), "reserved for nnqueue"),
        (one_invoke(edits="probe"), "edits must be null or a list"),
        (one_invoke(surprise=1), "must be an object with prompt, sampling, mediator and edits"),
        (trace_payload.MAGIC + (2).to_bytes(8, "big") + b"[]", "header must be a JSON object"),
        (trace_payload.MAGIC + (12).to_bytes(8, "big") + b'{"x": NaN}  ', "header holds NaN"),
        (with_tree(), None),
        (one_invoke({"format": 3}), "format 3 is not supported by this server .it reads formats 1, 2"),
        (one_invoke({"format": True}), "format True is not supported"),
        (one_invoke({"envoys": None}), "a format 1 header has no 'envoys'"),
        (with_tree(sha256="AB" * 32), "sha256 must be 64 lowercase hex digits"),
        (with_tree(blob=[4, 3]), "are not the first blob"),
        (with_tree(blob=[0, 3]), "are not the next blob"),  # the tree's bytes and the mediator's overlap
        (with_tree(surprise=1), "envoys must be null or an object with sha256 and blob"),
    ],
)
def test_a_malformed_payload_is_refused_naming_what_is_wrong(payload: bytes, reason: str | None) -> None:
    if reason is None:
        trace = trace_payload.decode(payload)
        assert trace.invokes[0].mediator == b"abc"
        assert trace.envoys in (None, trace_payload.EnvoyTree(SHA, b"TREE"))
        assert trace_payload.decode(trace_payload.encode(trace)) == trace
        return
    with pytest.raises(PayloadError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        trace_payload.decode(payload)


@pytest.mark.parametrize(
    ("sampling", "reason"),
    [
        ({"temperatur": 0.5}, r"sampling settings \['temperatur'\] are unknown to this server's vLLM"),
        ({"temperature": "hot"}, "invalid sampling settings: Expected `float`"),
        ({"temperature": -1.0}, "invalid sampling settings: temperature must be non-negative"),
        ({"n": 2, "temperature": 0.0}, "invalid sampling settings: n must be 1 when using greedy sampling"),
    ],
)
def test_invalid_sampling_settings_are_refused_by_vllms_own_checks(sampling: dict[str, Any], reason: str) -> None:
    trace = trace_payload.decode(trace_payload.encode(PrebuiltTrace([Invoke({"prompt": "x"}, sampling, b"m")])))
    with pytest.raises(PayloadError, match=reason):
        to_requests(trace, "j")


def test_what_the_format_cannot_carry_is_refused_on_the_client(client_model: Any) -> None:
    from vllm.lora.request import LoRARequest

    with pytest.raises(UnsupportedTrace, match="LoRA adapter"):
        with client_model.trace(PROMPTS[0], lora_request=LoRARequest("a", 1, "/nowhere"), backend=PrebuiltBackend()):
            client_model.logits.save()
    with pytest.raises(UnsupportedTrace, match="multimodal prompts are not supported"):
        with client_model.trace({"prompt": "x", "multi_modal_data": {}}, backend=PrebuiltBackend()):
            client_model.logits.save()


def test_a_trace_cannot_set_nnqueues_own_extra_args() -> None:
    from vllm.sampling_params import SamplingParams

    params = SamplingParams(extra_args={"nnsight_mediator": b"m", "nnqueue_harvest": {"chunk": "c", "prompt": 0}})
    with pytest.raises(UnsupportedTrace, match=r"invoke 0: extra_args \['nnqueue_harvest'\] use the 'nnqueue_' prefix"):
        trace_payload.from_vllm_requests(["x"], [params], [None])
