"""On the transformers engine a job may edit the weights, a module's attribute or its hooks for its own run
(weight-editing research), never into the next job's, of any owner (nnqueue.enginecore.transformers_engine with
nnqueue.enginecore.weights_guard and nnqueue.enginecore.state_guard), in process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nnqueue.enginecore.transformers_engine import Engine, load_model
from nnqueue.storage.results import load_result
from tests.utils.payloads import PayloadBackend

PROMPT = "The Eiffel Tower is in"


def run(engine: Engine, payload: bytes, directory: Path, name: str) -> dict[str, Any]:
    sinks = {kind: {"kind": "handoff", "path": str(directory / f"{name}-{kind}")} for kind in ("torch", "safetensors")}
    answer = engine.run({"job": name, "sinks": sinks}, payload)
    assert answer["error"] is None, answer["error"]
    return load_result(Path(sinks["torch"]["path"]).read_bytes())


def test_a_jobs_weight_edit_lasts_for_that_job_only(tiny_model_path: Path, tmp_path: Path) -> None:
    import torch
    from nnsight import LanguageModel

    engine = Engine(load_model(str(tiny_model_path), {}))
    meta = LanguageModel(str(tiny_model_path))

    def logits(edit: bool) -> bytes:
        backend = PayloadBackend()
        with meta.trace(PROMPT, backend=backend):
            if edit:
                with torch.no_grad():  # the edit, before the forward reaches the norm
                    meta.model.norm.weight[:] = 0
            out = meta.lm_head.output.save()
        return backend.payload

    before = run(engine, logits(edit=False), tmp_path, "before")["out"]
    edited = run(engine, logits(edit=True), tmp_path, "edited")["out"]
    after = run(engine, logits(edit=False), tmp_path, "after")["out"]
    assert before.abs().sum() > 0
    assert torch.equal(edited, torch.zeros_like(edited)), "the edit did not hold for its own job"
    assert torch.equal(after, before), "the edit reached the next job"


def test_a_jobs_change_to_a_modules_attribute_or_hooks_lasts_for_that_job_only(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    import torch
    from nnsight import LanguageModel

    engine = Engine(load_model(str(tiny_model_path), {}))
    engine.take_state()
    norm = engine.model._module.model.norm
    epsilon = norm.variance_epsilon
    meta = LanguageModel(str(tiny_model_path))

    def logits(change: str | None) -> bytes:
        backend = PayloadBackend()
        with meta.trace(PROMPT, backend=backend):
            if change == "attribute":  # issue 33: changed other users' results through a module attribute
                meta.model.norm._module.variance_epsilon = 1e4
            elif change == "hook":
                meta.model.norm._module.register_forward_hook(lambda module, args, output: output * 0)
            out = meta.lm_head.output.save()
        return backend.payload

    before = run(engine, logits(None), tmp_path, "before")["out"]
    for change in ("attribute", "hook"):
        changed = run(engine, logits(change), tmp_path, change)["out"]
        after = run(engine, logits(None), tmp_path, f"after-{change}")["out"]
        assert not torch.equal(changed, before), f"the {change} change did not hold for its own job"
        assert torch.equal(after, before), f"the {change} change reached the next job"
        assert norm.variance_epsilon == epsilon and not norm._forward_hooks
