"""Merging a trace's saves from every pipeline stage (`pipeline_stages.merge`): each name from the stage that
computed it, containers element by element, mixed values and placeholder errors reported; no engine needed."""

from __future__ import annotations

import pytest
import torch

from nnqueue.enginecore.capture_points import check_against
from nnqueue.enginecore.harvest_spec import Capture, SpecError
from nnqueue.enginecore.pipeline_stages import ELSEWHERE, MIXED_ERROR, StageReport, merge, strip

META = torch.empty(2, 3, device="meta")


def report(saves: dict, error: dict | None = None, changed: list[str] | None = None) -> StageReport:
    return StageReport(strip(saves), error, False, changed or [])


def test_each_name_comes_from_the_stage_that_computed_it() -> None:
    a, b, logits = torch.ones(2, 3), torch.full((2, 3), 2.0), torch.zeros(1, 8)
    stage0 = report({"a": a, "b": META, "both": [a, META], "by": {"x": a, "y": META}, "n": 3, "logits": META})
    stage1 = report({"a": META, "b": b, "both": [META, b], "by": {"x": META, "y": b}, "n": 3, "logits": logits})
    merged = merge([stage0, stage1])
    assert merged.error is None
    assert merged.saves["a"] is a and merged.saves["b"] is b and merged.saves["logits"] is logits
    assert merged.saves["both"][0] is a and merged.saves["both"][1] is b
    assert merged.saves["by"] == {"x": a, "y": b} and merged.saves["n"] == 3


def test_a_value_of_both_stages_fails_the_trace_and_is_left_out() -> None:
    merged = merge([report({"ok": torch.ones(1), "mixed": [META, META]}), report({"ok": META, "mixed": [META, META]})])
    assert merged.error is not None and merged.error["type_name"] == MIXED_ERROR
    assert "['mixed'] combine values computed on different pipeline stages" in merged.error["message"]
    assert set(merged.saves) == {"ok"}


def test_errors_real_first_placeholder_ones_dropped_unless_every_stage_failed() -> None:
    real = {"type_name": "IndexError", "message": "index 9 is out of bounds", "is_control_flow": False}
    artefact = {"type_name": "RuntimeError", "message": "Tensor.item() cannot be called on meta tensors"}
    assert merge([report({}, artefact), report({}, real)]).error == real
    assert merge([report({}, artefact), report({})]).error is None
    both = merge([report({}, artefact), report({}, artefact)]).error
    assert both is not None and both["type_name"] == MIXED_ERROR and "item()" in both["message"]


def test_weights_changed_on_any_stage_are_reported() -> None:
    assert merge([report({}, changed=["a.weight"]), report({}, changed=["z.weight"])]).changed == [
        "a.weight",
        "z.weight",
    ]


def test_strip_marks_only_placeholders() -> None:
    value = strip({"t": torch.ones(1), "m": META, "nested": (1, [META])})
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
