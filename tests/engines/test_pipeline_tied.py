"""Pipeline parallelism with tied embeddings (Llama 3.2 1B's ``tie_word_embeddings``): vLLM builds a real
``embed_tokens`` on the last stage too, for ``lm_head``, but runs it on the first stage only. A trace reading the
embeddings and a layer of each stage completes, with the embeddings the checkpoint's rows (found on GPU: every
such trace failed with ``OutOfOrderError`` on ``embed_tokens`` when the last stage left it parked)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.utils.engines import InProcessEngine, run_prebuilt, running_pipeline_engine
from tests.utils.payloads import PrebuiltBackend
from tests.utils.tiny_model import TINY_ENGINE_KWARGS


@pytest.fixture(scope="module")
def tied_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("tied") / "tiny-llama-tied"
    shutil.copytree(tiny_model_path, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    for shard in path.glob("*.safetensors"):  # a tied checkpoint has no lm_head of its own
        tensors = {name: value for name, value in load_file(str(shard)).items() if not name.startswith("lm_head.")}
        save_file(tensors, str(shard), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def tied_engine(tied_model_path: Path) -> Iterator[InProcessEngine]:
    with running_pipeline_engine(tied_model_path, **TINY_ENGINE_KWARGS) as engine:
        yield engine


def test_a_trace_of_the_embeddings_and_both_stages_completes(tied_engine, tied_model_path, client_model, tmp_path):
    import torch
    from safetensors.torch import load_file

    ids = [7, 42, 99, 300, 5]
    backend = PrebuiltBackend()
    with client_model.trace(ids, temperature=0.0, max_tokens=1, backend=backend):
        embedded = client_model.model.embed_tokens.output.clone().save()  # stage 0's; stage 1 holds it too
        first = client_model.model.layers[0].output[0].clone().save()
        second = client_model.model.layers[1].output[0].clone().save()
    report, saves = run_prebuilt(tied_engine, backend.payload, tmp_path, "tied")
    assert report.error is None, report.error
    weights = load_file(str(next(tied_model_path.glob("*.safetensors"))))["model.embed_tokens.weight"]
    assert torch.equal(saves["embedded"], weights[ids].to(saves["embedded"].dtype))
    assert saves["first"].shape == saves["second"].shape == (len(ids), weights.shape[1])
    assert not torch.equal(saves["first"], saves["second"])
