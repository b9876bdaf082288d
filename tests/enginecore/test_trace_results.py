"""The engine's copies of a trace's saves, and the files written from them (``saves.pt``, ``saves.safetensors``)."""

from __future__ import annotations

import time
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nnqueue.enginecore import outbox
from nnqueue.storage.results import load_result

Pair = namedtuple("Pair", "first second")


@dataclass
class Holder:
    value: Any


class Plain:
    def __init__(self, value: Any) -> None:
        self.value = value


@pytest.mark.parametrize("host_copies", [False, True], ids=["blocking", "host-copies"])
def test_a_snapshot_copies_every_tensor_once_and_compacts_views(host_copies: bool) -> None:
    import torch

    from nnqueue.enginecore.trace_results import HostCopies, snapshot

    copies = HostCopies() if host_copies else None
    buffer = torch.arange(12.0).reshape(3, 4)  # a step's buffer that the next step overwrites
    row = buffer[1]
    saves = {
        "row": row,
        "again": row,
        "nested": {"pair": Pair(buffer, [row]), "holder": Holder(row), "plain": Plain((row, 3))},
        "number": 3,
        "module": torch.nn.Linear(2, 2),
    }
    copied = snapshot(saves, copies)
    if copies is not None:  # CPU tensors are copied at once; CUDA ones by the time `wait` returns
        copies.seal()
        copies.wait()
        copies.release()
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
    import torch
    from safetensors.torch import load_file

    from nnqueue.enginecore.trace_results import write_saves

    shared = torch.ones(2)
    hidden = torch.arange(6.0).reshape(2, 3)
    saves = {"a": shared, "b": shared, "c": torch.arange(3), "hidden": hidden, "last": hidden[-1]}
    written = write_saves(saves, handoff(tmp_path))
    assert set(written) == {"torch", "safetensors"}
    assert written["torch"]["size"] == (tmp_path / "torch").stat().st_size
    loaded = load_result((tmp_path / "torch").read_bytes())
    assert loaded["a"] is loaded["b"]  # torch.save keeps the sharing
    tensors = load_file(tmp_path / "safetensors")  # safetensors, which refuses shared memory, gets copies
    assert set(tensors) == set(saves) and torch.equal(tensors["c"], torch.arange(3))
    assert torch.equal(tensors["last"], hidden[-1]) and torch.equal(tensors["hidden"], hidden)  # a view, copied


def test_other_values_are_written_as_torch_only(tmp_path: Path) -> None:
    import torch

    from nnqueue.enginecore.trace_results import write_saves

    written = write_saves({"tokens": [1, 2, 3], "logits": torch.ones(2)}, handoff(tmp_path))
    assert set(written) == {"torch"} and not (tmp_path / "safetensors").exists()
    assert load_result((tmp_path / "torch").read_bytes())["tokens"] == [1, 2, 3]


def wait_for_entry(trace_id: str, seen: dict[str, dict[str, Any]], timeout: float = 10) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while trace_id not in seen and time.monotonic() < deadline:
        seen.update((entry["id"], entry) for entry in outbox.drain())
        time.sleep(0.01)
    return seen.get(trace_id)


def test_each_result_is_reported_and_a_failed_write_fails_only_its_own(tmp_path: Path) -> None:
    import torch

    from nnqueue.enginecore.trace_collect import CollectedTrace
    from nnqueue.enginecore.trace_results import ResultWriter

    writer, seen = ResultWriter(threads=2), {}
    missing = {"torch": {"kind": "handoff", "path": str(tmp_path / "gone" / "saves.pt")}}
    writer.submit("broken", CollectedTrace({"h": torch.ones(4)}, None, False), missing)
    writer.submit("good", CollectedTrace({"h": torch.zeros(4)}, None, False), {"torch": handoff(tmp_path)["torch"]})

    good, broken = wait_for_entry("good", seen), wait_for_entry("broken", seen)
    assert good is not None and good["write_error"] is None and good["objects"]["torch"]["size"] > 0
    assert broken is not None and "FileNotFoundError" in broken["write_error"] and broken["objects"] == {}


def test_a_saved_value_of_a_class_the_trace_defined_is_refused() -> None:
    """Its pickling would run the trace's code in a writer thread (a dict subclass's ``items``), outside the steps
    the engine's guards check."""

    import torch

    from nnqueue.enginecore.trace_results import snapshot

    class Saved(dict):  # type: ignore[type-arg]
        def items(self):  # type: ignore[no-untyped-def,override]
            raise AssertionError("the trace's code ran while its result was written")

    with pytest.raises(TypeError, match="a class the trace defined"):
        snapshot({"value": Saved(a=torch.ones(1))})
    assert snapshot({"value": {"a": torch.ones(1)}})["value"]["a"].item() == 1.0
    # C's types are no trace's, whether builtins names them or not (NoneType, as in vLLM's RequestOutput fields)
    assert snapshot({"none": None, "ellipsis": ..., "range": range(2)}) == {
        "none": None,
        "ellipsis": ...,
        "range": range(2),
    }
