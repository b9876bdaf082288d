"""What a tapped worker publishes and refuses (nnqueue.enginecore.taps); the engine side runs in
tests/client/test_conformance.py, against a real tapped worker and nnsight's own taps engine."""

from __future__ import annotations

import pytest

from nnqueue.enginecore.taps import UnservableTaps, mark_taps, served_taps, untapped, untapped_message

POINTS = [
    {"module": "model.embed_tokens", "io": "output", "parts": [], "width": 8},
    {"module": "model.layers.0", "io": "input", "parts": ["residual_stream"], "width": 8},
    {"module": "model.layers.0", "io": "output", "parts": ["residual_stream"], "width": 8},
]


def test_the_taps_are_marked_on_the_capture_points_and_read_back() -> None:
    marked = mark_taps(POINTS, ["model.model.layers.0.output"])
    assert [point["tap"] for point in marked] == [False, False, True]
    assert served_taps(marked) == ["model.layers.0.output"]
    assert served_taps(POINTS) is None and served_taps(None) is None  # an eager worker serves every location


def test_a_tap_that_is_no_capture_point_is_refused_by_name() -> None:
    with pytest.raises(UnservableTaps, match=r"\['model\.layers\.0\.self_attn\.source\.attn_0\.output'\]"):
        mark_taps(POINTS, ["model.model.layers.0.output", "model.model.layers.0.self_attn.source.attn_0.output"])


def test_only_module_locations_outside_the_taps_are_refused() -> None:
    taps = ["model.model.layers.0.output"]
    assert untapped("model.model.norm.output", taps)
    assert untapped("model.model.layers.0.skip", taps)
    assert not untapped("model.model.layers.0.output", taps)
    assert not untapped("model.logits", taps)  # an eproperty, served on every step
    assert not untapped("model.model.norm.output", [])  # an eager engine serves everything
    message = untapped_message("model.model.norm.output", taps)
    assert (
        message.startswith("'model.norm.output' is not a tap of this worker") and "['model.layers.0.output']" in message
    )
