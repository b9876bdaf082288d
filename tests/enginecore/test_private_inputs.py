"""A step's inputs as a trace sees them are the step's own copies (nnqueue.enginecore.private_inputs): a view kept
past the step, where no guard looks, does not show later requests' tokens (a third red-team round read another
trust domain's prompt through ``embed_tokens.input`` kept on a library function)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tests.utils.engines import InProcessEngine, run_prebuilt
from tests.utils.payloads import PrebuiltBackend

if TYPE_CHECKING:
    from nnsight.modeling.vllm import VLLM

LONG = "one two three four five six seven eight nine ten " * 3
SECRET = "The vault code of alice is 7731 and the door opens at nine in the morning every day of the week"


def test_the_inputs_and_a_stages_intermediate_tensors_are_copied() -> None:
    import torch

    from nnqueue.enginecore import private_inputs

    class Intermediate:
        def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
            self.tensors = tensors

    buffer, hidden = torch.arange(8), torch.ones(4, 2)
    given = {"input_ids": buffer[:4], "positions": buffer[4:], "intermediate_tensors": Intermediate({"h": hidden})}
    copied = private_inputs.private(given)
    assert torch.equal(copied["input_ids"], buffer[:4]) and torch.equal(copied["positions"], buffer[4:])
    buffer.zero_()
    hidden.zero_()
    assert copied["input_ids"].tolist() == [0, 1, 2, 3] and copied["positions"].tolist() == [4, 5, 6, 7]
    assert (
        copied["intermediate_tensors"].tensors["h"].sum() == 8 and given["intermediate_tensors"].tensors["h"] is hidden
    )


def _trace(client: VLLM, prompt: str, role: str) -> bytes:
    """``plant``: keep a view of this step's input tokens on a library function; ``read``: save what it shows now
    (and remove it); ``innocent``: only run."""
    import nnsight

    backend = PrebuiltBackend()
    with client.trace(prompt, temperature=0.0, max_tokens=1, backend=backend):
        import json

        ids = nnsight.save(client.model.embed_tokens.input.clone())
        if role == "plant":
            json.dumps.nnqueue_kept = client.model.embed_tokens.input  # a place no guard holds
        elif role == "read":
            kept = nnsight.save(json.dumps.nnqueue_kept.clone())
            del json.dumps.nnqueue_kept
        client.logits
    return backend.payload


def test_a_view_of_the_inputs_kept_past_its_step_shows_only_that_step(
    inprocess_engine: InProcessEngine, client_model: VLLM, tmp_path: Path
) -> None:
    import torch

    saves = {}
    for role, prompt in (("plant", LONG), ("innocent", SECRET), ("read", "a")):
        report, saves[role] = run_prebuilt(inprocess_engine, _trace(client_model, prompt, role), tmp_path, role)
        assert report.error is None, report.error
    assert len(saves["innocent"]["ids"]) > 1  # the innocent's tokens overwrote the buffer the plant's view was of
    assert torch.equal(saves["read"]["kept"], saves["plant"]["ids"])
