"""Merging a trace's saves from every pipeline stage (`pipeline_stages.merge`): each name from the stage that
computed it, containers element by element, mixed values and placeholder errors reported; no engine needed."""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING

import pytest

from nnqueue.enginecore.capture_points import capture_points, check_against
from nnqueue.enginecore.harvest_spec import Capture, SpecError

if TYPE_CHECKING:
    import torch

    from nnqueue.enginecore.pipeline_stages import StageReport


@pytest.fixture
def meta() -> torch.Tensor:
    """What a stage saves for a value another stage computed: a placeholder on the meta device."""
    import torch

    return torch.empty(2, 3, device="meta")


def report(saves: dict, error: dict | None = None, changed: list[str] | None = None) -> StageReport:
    from nnqueue.enginecore.pipeline_stages import StageReport, strip

    return StageReport(strip(saves), error, False, changed or [])


def test_each_name_comes_from_the_stage_that_computed_it(meta: torch.Tensor) -> None:
    import torch

    from nnqueue.enginecore.pipeline_stages import merge

    a, b, logits = torch.ones(2, 3), torch.full((2, 3), 2.0), torch.zeros(1, 8)
    stage0 = report({"a": a, "b": meta, "both": [a, meta], "by": {"x": a, "y": meta}, "n": 3, "logits": meta})
    stage1 = report({"a": meta, "b": b, "both": [meta, b], "by": {"x": meta, "y": b}, "n": 3, "logits": logits})
    merged = merge([stage0, stage1])
    assert merged.error is None
    assert merged.saves["a"] is a and merged.saves["b"] is b and merged.saves["logits"] is logits
    assert merged.saves["both"][0] is a and merged.saves["both"][1] is b
    assert merged.saves["by"] == {"x": a, "y": b} and merged.saves["n"] == 3


def test_a_value_of_both_stages_fails_the_trace_and_is_left_out(meta: torch.Tensor) -> None:
    import torch

    from nnqueue.enginecore.pipeline_stages import MIXED_ERROR, merge

    merged = merge([report({"ok": torch.ones(1), "mixed": [meta, meta]}), report({"ok": meta, "mixed": [meta, meta]})])
    assert merged.error is not None and merged.error["type_name"] == MIXED_ERROR
    assert "['mixed'] combine values computed on different pipeline stages" in merged.error["message"]
    assert set(merged.saves) == {"ok"}


def test_errors_real_first_placeholder_ones_dropped_unless_every_stage_failed() -> None:
    from nnqueue.enginecore.pipeline_stages import MIXED_ERROR, merge

    real = {"type_name": "IndexError", "message": "index 9 is out of bounds", "is_control_flow": False}
    artefact = {"type_name": "RuntimeError", "message": "Tensor.item() cannot be called on meta tensors"}
    assert merge([report({}, artefact), report({}, real)]).error == real
    assert merge([report({}, artefact), report({})]).error is None
    both = merge([report({}, artefact), report({}, artefact)]).error
    assert both is not None and both["type_name"] == MIXED_ERROR and "item()" in both["message"]


def test_weights_changed_on_any_stage_are_reported() -> None:
    from nnqueue.enginecore.pipeline_stages import merge

    assert merge([report({}, changed=["a.weight"]), report({}, changed=["z.weight"])]).changed == [
        "a.weight",
        "z.weight",
    ]


def test_strip_marks_only_placeholders(meta: torch.Tensor) -> None:
    import torch

    from nnqueue.enginecore.pipeline_stages import ELSEWHERE, strip

    value = strip({"t": torch.ones(1), "m": meta, "nested": (1, [meta])})
    assert value["m"] == ELSEWHERE and value["nested"] == (1, [ELSEWHERE]) and torch.equal(value["t"], torch.ones(1))


def test_a_spec_whose_captures_span_stages_is_refused() -> None:
    points = [
        {"module": "model.layers.0", "io": "output", "parts": ["residual_stream"], "width": 8, "stage": 0},
        {"module": "model.layers.1", "io": "output", "parts": ["residual_stream"], "width": 8, "stage": 1},
        {"module": "model.norm", "io": "output", "parts": [], "width": 8, "stage": 1},
    ]
    check_against([Capture("model.layers.1"), Capture("model.norm")], points)  # one stage: fine
    with pytest.raises(SpecError, match=r"one pipeline stage.*'model\.layers\.0\.output': 0.*'model\.norm\.output': 1"):
        check_against([Capture("model.layers.0"), Capture("model.norm")], points)


def llama(stage: int, tied: bool) -> torch.nn.Module:
    """vLLM's module tree of a four-layer Llama on ``stage`` of two (``LlamaForCausalLM``, ``make_layers``)."""
    import torch
    from vllm.model_executor.models.utils import PPMissingLayer

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = torch.nn.Linear(4, 4)

    first, last = stage == 0, stage == 1
    body = torch.nn.Module()
    body.embed_tokens = torch.nn.Embedding(8, 4) if first or (tied and last) else PPMissingLayer()
    body.layers = torch.nn.ModuleList(Block() if index // 2 == stage else PPMissingLayer() for index in range(4))
    body.norm = torch.nn.LayerNorm(4) if last else PPMissingLayer()
    root = torch.nn.Module()
    root.model = body
    root.lm_head = torch.nn.Linear(4, 8) if last else PPMissingLayer()
    return root


@pytest.mark.parametrize("tied", [False, True])
def test_every_module_another_stage_runs_is_served_there(tied: bool) -> None:
    """A tied ``embed_tokens`` is real on the last stage (for ``lm_head``) but runs on the first only: a read of
    it there is served a placeholder before the forward, as for the layers of the first stage."""
    import nnsight

    from nnqueue.enginecore.pipeline_stages import StageLayout

    last = StageLayout.of(nnsight.NNsight(llama(1, tied)), first=False, last=True)
    assert set(last.earlier) == {"model.model.embed_tokens", "model.model.layers.0", "model.model.layers.1"}
    assert last.later == () and last.decoder_layers == {"model.model.layers.0", "model.model.layers.1"}
    assert last.elsewhere("model.model.embed_tokens.output", before=True) == "model.model.embed_tokens"
    assert last.elsewhere("model.model.layers.2.output", before=True) is None
    assert last.elsewhere("model.model.layers.2.mlp.output", before=False) is None
    first = StageLayout.of(nnsight.NNsight(llama(0, tied)), first=True, last=False)
    assert first.earlier == ()
    assert set(first.later) == {"model.model.layers.2", "model.model.layers.3", "model.model.norm", "model.lm_head"}
    assert first.elsewhere("model.model.embed_tokens.output", before=True) is None
    assert first.elsewhere("model.logits", before=False) == "model.logits"


def test_a_report_that_does_not_load_fails_the_trace() -> None:
    """Rank 0 loads each stage's report after receiving them all: one that does not load is that stage's error."""
    import torch

    from nnqueue.enginecore.pipeline_stages import MIXED_ERROR, StageReport, _load

    report = _load(pickle.dumps({"saves": {}, "error": None, "load_failed": False, "changed": [], "extra": 1}))
    assert report.error is not None and report.error["type_name"] == MIXED_ERROR
    assert "collecting a pipeline stage's saves failed" in report.error["message"]
    good = _load(pickle.dumps(StageReport({"a": torch.ones(1)}, None, False, ["w"]).__dict__))
    assert torch.equal(good.saves["a"], torch.ones(1)) and good.changed == ["w"]


def test_a_stage_offers_no_capture_point_it_never_runs() -> None:
    """The last stage's tied ``embed_tokens`` is the first stage's point alone (a harvest of it goes there)."""
    points = {p["module"] for p in capture_points(llama(1, tied=True), 1, stage=1, last=True)}
    assert "model.embed_tokens" not in points and {"model.layers.2", "model.norm", "lm_head"} <= points
    assert "model.embed_tokens" in {p["module"] for p in capture_points(llama(0, tied=True), 1, stage=0, last=False)}
