"""Token selection over a step's flattened tokens, vectorized, against a per-prompt Python reading."""

from __future__ import annotations

import numpy as np
import pytest

from nnqueue.enginecore.harvest_capture import selected
from nnqueue.enginecore.harvest_spec import Selection, SpecError

SELECTIONS = [
    Selection("all"),
    Selection("mean"),
    Selection("first", n=2),
    Selection("last"),
    Selection("last", n=3),
    Selection("positions", positions=(0, -1, 4, -9, 40)),
]


def reference(selection: Selection, length: int) -> list[int]:
    if selection.kind in ("all", "mean"):
        return list(range(length))
    if selection.kind == "first":
        return list(range(min(selection.n, length)))
    if selection.kind == "last":
        return list(range(max(0, length - selection.n), length))
    return sorted({p + length if p < 0 else p for p in selection.positions} & set(range(length)))


@pytest.mark.parametrize("selection", SELECTIONS, ids=lambda s: f"{s.kind}{s.n}")
def test_selection_over_a_step(selection: Selection) -> None:
    # Three prompts in one step; the second is the tail of a chunked prefill (positions 6..9 of 10).
    lengths, starts, counts = np.array([1, 10, 7]), np.array([0, 6, 0]), np.array([1, 4, 7])
    owner = np.repeat(np.arange(3), counts)
    position = starts[owner] + np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
    mask = selected(selection, position, lengths[owner])
    for index, length in enumerate(lengths):
        mine = position[(owner == index) & mask].tolist()
        wanted = [p for p in reference(selection, int(length)) if starts[index] <= p < starts[index] + counts[index]]
        assert mine == wanted


def test_bad_selections_are_refused() -> None:
    for bad in (
        {"kind": "median"},
        {"kind": "first", "n": 0},
        {"kind": "positions"},
        {"kind": "all", "positions": [1]},
    ):
        with pytest.raises(SpecError):
            Selection.from_json(bad)
