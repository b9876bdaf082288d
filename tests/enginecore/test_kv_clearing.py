"""nnqueue.enginecore.kv_clearing on the session's in-process engine: at a trust-domain switch (the guards' RPC
``nnqueue_verify_state``) the keys and values that finished requests left in the KV cache are zeroed, where a
trace read them in a red-team round, and a request still running keeps its own."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.utils.engines import InProcessEngine, run, run_prebuilt
from tests.utils.payloads import PROMPTS, PrebuiltBackend

if TYPE_CHECKING:
    from nnsight.modeling.vllm import VLLM


def kv_written(engine: InProcessEngine, client: VLLM, tmp_path: Path, name: str) -> int:
    """How many values of the first layer's KV cache are not zero, as a trace reads them once its own prompt's are
    written: its own, and whatever earlier requests left."""
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        import torch as t

        layer = client.model.layers[0]
        layer.output[0].shape  # waits for the layer (hidden states, residual): its attention wrote the prompt
        cache = layer.self_attn.attn._module.kv_cache
        kv = cache[0] if isinstance(cache, (list, tuple)) else cache
        written = t.tensor(int((kv != 0).sum())).save()
    report, saves = run_prebuilt(engine, backend.payload, tmp_path, name)
    assert report.error is None, report.error
    return int(saves["written"])


def switch(engine: InProcessEngine) -> Any:
    return run(engine, engine.model.vllm_entrypoint.collective_rpc("nnqueue_verify_state"))


def test_a_switch_zeroes_what_finished_requests_left_in_the_kv_cache(
    inprocess_engine: InProcessEngine, client_model: VLLM, tmp_path: Path
) -> None:
    backend = PrebuiltBackend()
    with client_model.trace(PROMPTS[1], temperature=0.0, max_tokens=8, ignore_eos=True, backend=backend):
        pass  # another owner's request: its keys and values stay in blocks freed when it finishes
    assert run_prebuilt(inprocess_engine, backend.payload, tmp_path, "earlier")[0].error is None
    with_earlier = kv_written(inprocess_engine, client_model, tmp_path, "before")
    [answer] = switch(inprocess_engine)
    zeroed, of_all = answer.pop("zeroed")[0].split(" of ")  # what the worker logs as its own record
    assert answer == {"weights": [], "state": [], "lazy": []} and 0 < int(zeroed) <= int(of_all)
    alone = kv_written(inprocess_engine, client_model, tmp_path, "after")
    switch(inprocess_engine)
    assert with_earlier > alone == kv_written(inprocess_engine, client_model, tmp_path, "again") > 0


def test_a_request_running_across_a_switch_keeps_its_keys_and_values(inprocess_engine: InProcessEngine) -> None:
    """A harvest's or a steering job's requests run through switches (they carry no user code): zeroing their
    blocks would change what they compute next."""
    from vllm import SamplingParams

    llm = inprocess_engine.model.vllm_entrypoint
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def tokens(request_id: str, switch_at: int | None) -> list[int]:
        out: Any = None
        async for out in llm.generate(PROMPTS[1], params, request_id=request_id):
            if switch_at is not None and len(out.outputs[0].token_ids) == switch_at:
                await llm.collective_rpc("nnqueue_verify_state")
        return list(out.outputs[0].token_ids)

    assert run(inprocess_engine, tokens("kv-clearing-across", 8)) == run(
        inprocess_engine, tokens("kv-clearing-plain", None)
    )
