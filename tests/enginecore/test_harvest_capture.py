"""Token selection over a step's flattened tokens, vectorized, against a per-prompt Python reading."""

from __future__ import annotations

import numpy as np
import pytest

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
    from nnqueue.enginecore.harvest_capture import selected

    # Three prompts in one step; the second is the tail of a chunked prefill (positions 6..9 of 10).
    lengths, starts, counts = np.array([1, 10, 7]), np.array([0, 6, 0]), np.array([1, 4, 7])
    owner = np.repeat(np.arange(3), counts)
    position = starts[owner] + np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
    mask = selected(selection, position, np.zeros_like(position), lengths[owner])
    for index, length in enumerate(lengths):
        mine = position[(owner == index) & mask].tolist()
        wanted = [p for p in reference(selection, int(length)) if starts[index] <= p < starts[index] + counts[index]]
        assert mine == wanted


GENERATED = [
    Selection("all", tokens="generated"),
    Selection("first", n=2, tokens="generated"),
    Selection("last", n=3, tokens="generated"),
    Selection("positions", positions=(0, 2, -1), tokens="generated"),
    Selection("last", n=4, skip=2, tokens="both"),
    Selection("positions", positions=(1, -2), skip=2, tokens="both"),
]


@pytest.mark.parametrize("selection", GENERATED, ids=lambda s: f"{s.tokens}-{s.kind}{s.n}")
def test_generated_selections_keep_candidates_until_the_sequence_ends(selection: Selection) -> None:
    from nnqueue.enginecore.harvest_capture import selected

    # A 5-token prompt that ran 6 generated tokens (positions 0..10); while generating, the range's end is only
    # bounded (by 5 + 9, max_tokens 10): what depends on where it ends keeps every candidate, then is settled.
    prompt, ran, bound = 5, 11, 14
    position = np.arange(ran)
    start, stop = selection.span(prompt, 6)
    assert stop == ran and start == (prompt if selection.tokens == "generated" else 0)
    final = selected(selection, position, np.full(ran, start), np.full(ran, stop))
    provisional = selected(selection, position, np.full(ran, start), np.full(ran, bound), final=False)
    first = max(start, selection.skip)
    candidates = list(range(first, stop))
    wanted = {
        "all": candidates,
        "first": candidates[: selection.n],
        "last": candidates[-selection.n :],
        "positions": [p for p in candidates if p in {stop + q if q < 0 else start + q for q in selection.positions}],
    }[selection.kind]
    assert position[final].tolist() == wanted
    assert set(position[final]) <= set(position[provisional])  # nothing selected in the end was left out
    if selection.kind in ("all", "first"):
        assert (provisional == final).all()  # decided as the tokens run


def test_max_rows_counts_generated_positions() -> None:
    assert Selection("all", tokens="generated").max_rows(5, 9) == 9
    assert Selection("all", tokens="both", skip=1).max_rows(5, 9) == 13
    assert Selection("last", n=3, tokens="generated").max_rows(5, 2) == 2
    assert Selection("mean", tokens="generated").max_rows(5, 0) == 0
    assert Selection("all").max_rows(5, 9) == 5


def test_bad_selections_are_refused() -> None:
    for bad in (
        {"kind": "median"},
        {"kind": "first", "n": 0},
        {"kind": "positions"},
        {"kind": "all", "positions": [1]},
    ):
        with pytest.raises(SpecError):
            Selection.from_json(bad)
