"""Harvests that capture while the model generates, against nnsight traces of the same generations, bit for bit.

Each prompt is generated twice in the same engine steps: once by an nnsight trace job (prebuilt, as the
nnqueue client builds it; it saves layer 0's residual stream and an MLP's output at every generation step,
and the sampled token ids) and once by a harvest chunk with the same sampling settings (seeded, at a
temperature). vLLM batches all of them together, prefill and decode steps, so the capture path must map
each decode step's rows to the right request and position while other requests share the step. Sampling
with the same seed draws the same tokens, so the two runs see the same sequences and compute the same
values: the shard must equal the trace's saves exactly, and its token ids the sampled ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from nnqueue import trace_payload
from nnqueue.enginecore.harvest_spec import Capture, Generation, Selection
from nnqueue.engines.outbox import poller
from nnqueue.storage.results import load_result
from tests.engines.test_harvest_runner import batched, load, stats
from tests.utils.engines import InProcessEngine, run, running_engine
from tests.utils.payloads import PrebuiltBackend
from tests.utils.tiny_model import TINY_ENGINE_KWARGS

if TYPE_CHECKING:
    from nnqueue.engines.harvest_runner import ChunkWork

LENGTHS = [4, 9, 17]
GENERATION = Generation(max_tokens=7, temperature=0.9, seed=1234, ignore_eos=True)
CAPTURES = [Capture("model.layers.0"), Capture("model.layers.1.mlp.down_proj")]
SELECTIONS = {
    "both": Selection("all", tokens="both"),
    "generated": Selection("all", tokens="generated"),
    "generated_last3": Selection("last", n=3, tokens="generated"),
    "generated_first2": Selection("first", n=2, tokens="generated"),
    "generated_positions": Selection("positions", positions=(0, 2, -1), tokens="generated"),
    "generated_mean": Selection("mean", tokens="generated"),
    "both_last8_skip1": Selection("last", n=8, skip=1, tokens="both"),
    "prompt": Selection("all"),
}


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest, tiny_model_path: Path) -> Iterator[InProcessEngine]:
    """The session's engine on CPU; on a GPU one of its own in eager mode (hooks do not run in replayed CUDA
    graphs), where vLLM's async scheduling leaves the decode tokens' ids on the device only."""
    import torch

    if not torch.cuda.is_available():
        yield request.getfixturevalue("inprocess_engine")
        return
    with running_engine(tiny_model_path, **TINY_ENGINE_KWARGS, enforce_eager=True) as own:
        yield own


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in LENGTHS]


def on_cpu(engine: InProcessEngine) -> bool:
    return engine.model.vllm_entrypoint.vllm_config.device_config.device_type == "cpu"


def trace_payload_of(client_model: Any, ids: list[int], generation: Generation) -> bytes:
    """A trace job generating from ``ids`` as ``generation`` says, saving every step's values and the tokens."""
    import nnsight

    backend = PrebuiltBackend()
    with client_model.trace(
        ids,
        temperature=generation.temperature,
        seed=generation.seed,
        max_tokens=generation.max_tokens,
        ignore_eos=generation.ignore_eos,
        backend=backend,
    ) as tracer:
        residual = nnsight.save(list())
        mlp = nnsight.save(list())
        generated = nnsight.save(list())
        for _ in tracer.iter[:]:
            out = client_model.model.layers[0].output
            residual.append(out[0] + out[1])
            mlp.append(client_model.model.layers[1].mlp.down_proj.output[0])
            generated.append(client_model.samples)
    return backend.payload


def traced_and_harvested(
    engine: InProcessEngine,
    client_model: Any,
    tmp_path: Path,
    prompts: list[list[int]],
    selection: Selection,
    name: str,
    generation: Generation = GENERATION,
) -> tuple[list[dict[str, Any]], ChunkWork, Any]:
    """Run a trace per prompt and the harvest chunk together; the traces' saves, the chunk and its result."""
    from nnqueue.engines.harvest_runner import ChunkWork, run_chunk
    from nnqueue.engines.prebuilt import to_requests  # imports vLLM: only when a test runs (fast collection)
    from nnqueue.engines.trace_runner import run_trace

    llm = engine.model.vllm_entrypoint
    traces = []
    for index, ids in enumerate(prompts):
        sinks = {kind: {"kind": "handoff", "path": str(tmp_path / f"{name}-{index}.{kind}")} for kind in ("pt", "st")}
        requests = to_requests(trace_payload.decode(trace_payload_of(client_model, ids, generation)), f"{name}-{index}")
        traces.append(
            run_trace(
                engine.model,
                requests,
                trace_id=f"{name}-{index}",
                sinks={"torch": sinks["pt"], "safetensors": sinks["st"]},
                outbox=poller(llm),
            )
        )
    chunk = ChunkWork(
        chunk_id=name,
        prompt_indices=[10 + i for i in range(len(prompts))],
        token_ids=prompts,
        captures=CAPTURES,
        selection=selection,
        dtype="float32",
        sink={"kind": "handoff", "path": str(tmp_path / f"{name}.safetensors")},
        generation=generation,
    )
    *reports, result = run(engine, batched(llm, *traces, run_chunk(llm, chunk), requests=2 * len(prompts)))
    saves = []
    for index, report in enumerate(reports):
        assert report.error is None and report.write_error is None
        saves.append(load_result((tmp_path / f"{name}-{index}.pt").read_bytes()))
    return saves, chunk, result


def expected(save: dict[str, Any], ids: list[int], selection: Selection) -> tuple[list[int], list[int], dict[str, Any]]:
    """The rows ``selection`` takes of one traced sequence: positions, token ids, values per capture."""
    import torch

    values = {
        "model.layers.0.output": torch.cat(save["residual"]),
        "model.layers.1.mlp.down_proj.output": torch.cat(save["mlp"]),
    }
    sequence = ids + torch.cat(save["generated"]).flatten().tolist()
    ran = len(ids) + len(save["generated"]) - 1  # the last sampled token is never run through the model
    start, stop = selection.span(len(ids), len(save["generated"]) - 1)
    first = max(start, selection.skip)
    candidates = list(range(first, stop))
    if selection.kind == "first":
        positions = candidates[: selection.n]
    elif selection.kind == "last":
        positions = candidates[-selection.n :]
    elif selection.kind == "positions":
        wanted = {stop + p if p < 0 else start + p for p in selection.positions}
        positions = [p for p in candidates if p in wanted]
    else:
        positions = candidates
    assert all(value.shape[0] == ran for value in values.values())
    if selection.kind == "mean":
        return [-1], [-1], {key: value[positions].mean(0, keepdim=True) for key, value in values.items()}
    return positions, [sequence[p] for p in positions], {key: value[positions] for key, value in values.items()}


@pytest.mark.parametrize("name", list(SELECTIONS))
def test_generation_matches_traces_bit_for_bit(engine, client_model, tmp_path, prompts, name) -> None:
    import torch

    selection = SELECTIONS[name]
    saves, chunk, result = traced_and_harvested(engine, client_model, tmp_path, prompts, selection, name)
    shard = load(Path(chunk.sink["path"]))
    assert result.rows == shard["prompt_index"].shape[0] > 0
    generated = GENERATION.max_tokens
    assert all(len(save["generated"]) == generated for save in saves)
    ran = sum(LENGTHS) + len(prompts) * (generated - 1)
    assert result.tokens == (ran if selection.tokens != "prompt" else sum(LENGTHS))
    if selection.kind == "all":  # one prefill step (rows of the prompts unless "generated"), then decode steps
        assert result.steps == {"prompt": 1, "both": generated, "generated": generated - 1}[selection.tokens]
    for ids, index, rows, save in zip(prompts, chunk.prompt_indices, result.prompts, saves, strict=True):
        span = slice(rows.first_row, rows.first_row + rows.rows)
        positions, token_ids, values = expected(save, ids, selection)
        assert rows.prompt_index == index and (shard["prompt_index"][span] == index).all()
        assert shard["token_position"][span].tolist() == positions
        assert shard["token_id"][span].tolist() == token_ids
        # Rows of generated tokens are marked (a mean: when it averages generated tokens only).
        assert (shard["prompt_length"][span] == len(ids)).all()
        marked = [selection.tokens == "generated"] if selection.kind == "mean" else [p >= len(ids) for p in positions]
        assert shard["generated"][span].tolist() == marked
        for key, value in values.items():
            # A mean is summed in float32 per step, then divided: not the trace's order. On a GPU (async scheduling:
            # the decode tokens' ids come from the device) kernels may differ with the batch's shape.
            if selection.kind == "mean" or not on_cpu(engine):
                torch.testing.assert_close(shard[key][span], value, atol=1e-5, rtol=1e-5)
            else:
                assert torch.equal(shard[key][span], value), key
    assert result.generated_rows == int(shard["generated"].sum())
    assert stats(engine)["requests"] == 0


def test_generation_that_ends_early(engine, tmp_path) -> None:
    """A sequence that reaches the engine's length limit ends before max_tokens: its last rows are where it
    ended, the chunk completes once the engine reports the request finished."""
    from nnqueue.engines.harvest_runner import ChunkWork, run_chunk

    llm = engine.model.vllm_entrypoint
    limit = llm.model_config.max_model_len
    ids = [[5 + i % 400 for i in range(limit - 4)], [7, 8, 9]]
    chunk = ChunkWork(
        chunk_id="early",
        prompt_indices=[0, 1],
        token_ids=ids,
        captures=[Capture("model.layers.0")],
        selection=Selection("last", n=2, tokens="generated"),
        dtype="float32",
        sink={"kind": "handoff", "path": str(tmp_path / "early.safetensors")},
        generation=Generation(max_tokens=12, temperature=0.0, ignore_eos=True),
    )
    result = run(engine, run_chunk(llm, chunk))
    shard = load(Path(chunk.sink["path"]))
    # The long prompt generated 4 tokens (to the limit): positions limit - 4 .. limit - 2 ran; its last 2 are rows.
    assert shard["token_position"].tolist() == [limit - 3, limit - 2, 3 + 12 - 3, 3 + 12 - 2]
    assert [p.rows for p in result.prompts] == [2, 2]
    assert result.tokens == (limit - 1) + (3 + 11)
    assert stats(engine)["requests"] == 0


def test_generated_selection_needs_generation() -> None:
    from nnqueue.engines.harvest_runner import ChunkWork

    with pytest.raises(ValueError, match="needs 'generate'"):
        ChunkWork("x", [0], [[1, 2]], [Capture("model.layers.0")], Selection(tokens="generated"), "float32", {})


def test_aborted_generation_frees_everything(engine, tmp_path, prompts) -> None:
    from nnqueue.engines.harvest_runner import ChunkWork, run_chunk

    llm = engine.model.vllm_entrypoint
    chunk = ChunkWork(
        chunk_id="aborted",
        prompt_indices=[0, 1, 2],
        token_ids=prompts,
        captures=CAPTURES,
        selection=Selection("all", tokens="both"),
        dtype="float32",
        sink={"kind": "handoff", "path": str(tmp_path / "aborted.safetensors")},
        generation=Generation(max_tokens=200, ignore_eos=True),
    )

    async def cancelled_while_generating() -> None:
        task = asyncio.ensure_future(run_chunk(llm, chunk))
        while (await llm.collective_rpc("nnqueue_harvest_stats"))[0]["buffered_bytes"] == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(engine, cancelled_while_generating())
    assert stats(engine) | {"hooked_points": 0} == {
        "chunks": 0,
        "requests": 0,
        "buffered_bytes": 0,
        "writing": 0,
        "hooked_points": 0,
    }
    assert llm.get_num_unfinished_requests() == 0
    assert not Path(chunk.sink["path"]).exists()


def test_engine_refuses_generated_rows_without_generation(engine) -> None:
    llm = engine.model.vllm_entrypoint
    spec = {
        "chunk": "refused",
        "captures": [Capture("model.layers.0").to_json()],
        "selection": Selection(tokens="generated").to_json(),
        "dtype": "float32",
        "prompts": [0],
        "sink": {"kind": "handoff", "path": "/nonexistent"},
    }
    answer = run(engine, llm.collective_rpc("nnqueue_harvest_begin", args=(spec,)))[0]
    assert "needs 'generate'" in answer["error"]
    assert stats(engine)["chunks"] == 0
