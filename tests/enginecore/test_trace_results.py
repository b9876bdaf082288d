"""The engine's copies of a trace's saves, and the files written from them (``saves.pt``, ``saves.safetensors``)."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from nnqueue.enginecore.trace_results import snapshot, write_saves
from nnqueue.storage.results import load_result

Pair = namedtuple("Pair", "first second")


@dataclass
class Holder:
    value: Any


class Plain:
    def __init__(self, value: Any) -> None:
        self.value = value


def test_a_snapshot_copies_every_tensor_once_and_compacts_views() -> None:
    buffer = torch.arange(12.0).reshape(3, 4)  # a step's buffer that the next step overwrites
    row = buffer[1]
    saves = {
        "row": row,
        "again": row,
        "nested": {"pair": Pair(buffer, [row]), "holder": Holder(row), "plain": Plain((row, 3))},
        "number": 3,
        "module": torch.nn.Linear(2, 2),
    }
    copied = snapshot(saves)
    buffer.zero_()

    assert torch.equal(copied["row"], torch.tensor([4.0, 5.0, 6.0, 7.0])) and copied["row"].storage_offset() == 0
    assert copied["row"].untyped_storage().nbytes() == 16  # the row alone, not the whole buffer
    assert copied["again"] is copied["row"] and copied["nested"]["pair"].second[0] is copied["row"]
    assert isinstance(copied["nested"]["pair"], Pair) and copied["nested"]["pair"].first.sum() == 66
    assert copied["nested"]["holder"].value is copied["row"] and copied["nested"]["plain"].value[0] is copied["row"]
    assert copied["number"] == 3 and copied["module"] is saves["module"]
    assert saves["nested"]["holder"].value is row  # the originals are left as they were


def handoff(directory: Path) -> dict[str, dict[str, str]]:
    return {name: {"kind": "handoff", "path": str(directory / name)} for name in ("torch", "safetensors")}


def test_tensors_only_are_written_as_torch_and_safetensors(tmp_path: Path) -> None:
    shared = torch.ones(2)
    saves = {"a": shared, "b": shared, "c": torch.arange(3)}
    written = write_saves(saves, handoff(tmp_path))
    assert set(written) == {"torch", "safetensors"}
    assert written["torch"]["size"] == (tmp_path / "torch").stat().st_size
    loaded = load_result((tmp_path / "torch").read_bytes())
    assert loaded["a"] is loaded["b"]  # torch.save keeps the sharing
    tensors = load_file(tmp_path / "safetensors")  # safetensors, which refuses shared memory, gets copies
    assert set(tensors) == {"a", "b", "c"} and torch.equal(tensors["c"], torch.arange(3))


def test_other_values_are_written_as_torch_only(tmp_path: Path) -> None:
    written = write_saves({"tokens": [1, 2, 3], "logits": torch.ones(2)}, handoff(tmp_path))
    assert set(written) == {"torch"} and not (tmp_path / "safetensors").exists()
    assert load_result((tmp_path / "torch").read_bytes())["tokens"] == [1, 2, 3]
