"""nnqueue.enginecore.steering's preinstalled points: a taps worker hooks its taps at load (patterns included),
so steering edits are recorded into the CUDA graphs that replay them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nnqueue.enginecore.harvest_spec import SpecError

POINTS = [
    {"module": f"model.layers.{n}", "io": io, "width": 8, "parts": None} for n in range(3) for io in ("input", "output")
]


def expand(names: list[str]) -> list[str]:
    from nnqueue.enginecore.steering import Steering

    return Steering._expand(SimpleNamespace(points=POINTS), names)  # type: ignore[arg-type]


def test_patterns_expand_to_the_points_they_match_and_names_stay() -> None:
    assert expand(["model.layers.*.output"]) == [f"model.layers.{n}.output" for n in range(3)]
    assert expand(["model.layers.1", "model.layers.2.input"]) == ["model.layers.1", "model.layers.2.input"]


def test_a_pattern_that_matches_nothing_is_refused() -> None:
    with pytest.raises(SpecError, match="matches none"):
        expand(["model.mlp.*.output"])
