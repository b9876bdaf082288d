"""Trace jobs under pipeline parallelism: every stage runs each trace's code, values another stage computes are
stand-ins, and each stage's saves go to global rank 0, which merges them and writes the result.

nnsight 0.8.1 runs a request's mediator on every rank (``Requests.add`` in nnsight's
``NNsightGPUModelRunner``) and reports global rank 0's saves alone (``collect_nnsight``'s ``reporting``). Under
pipeline parallelism each stage holds only its layers (vLLM builds the others as ``PPMissingLayer``,
``vllm.model_executor.models.utils.make_layers``), so as shipped: a mediator whose client-side module tree has
another stage's submodules does not even load (``UnknownPersistentIdError``), a read of another stage's layer
parks until the request ends (a dangling read, the trace's error), and a later stage's saves never leave its
process. Here, on an engine with more than one stage:

* `StageObjects`: the runner's persistent-object map resolves a module another stage holds to a stand-in,
  so the trace's module tree loads on every stage;
* `PipelineStageMixin._model_forward`: around the stage's forward, a mediator parked on a location of an
  earlier stage (before the forward) or of a later one (after it; and the logits and samples on every stage
  but the last) is served a *placeholder*. Another stage's module is a ``PPMissingLayer`` or one this stage
  holds but never runs (`other_stages`: a tied ``embed_tokens`` on the last stage). The placeholder is a
  meta tensor shaped as the value (a decoder layer's ``(hidden, residual)`` pair, else ``[tokens, hidden]``),
  so the code runs on to the locations this stage holds. A read out of order stays parked, and fails as it
  does on one engine;
* `gather`: in ``nnqueue_finish_trace`` every stage's reporting rank (tensor-parallel rank 0) sends its
  collected saves, error and weights-guard findings to global rank 0 over vLLM's pipeline group
  (``GroupCoordinator.send_object``, the CPU group); rank 0 merges them (`merge`): per saved name the value
  of the stage that computed it (a value holding a placeholder is another stage's), lists, tuples and dicts
  element by element, so ``[layers[i].output for i in ...]`` gathers across stages. A name whose value mixes
  stages (``layers[30].output - layers[2].output`` across a stage boundary) fails the trace, naming it:
  save the parts and combine them in the client.

Errors: the first real error in stage order is the trace's. An error a placeholder caused (a meta tensor's
data was needed: ``.item()``, printing, a branch on a value) is dropped when some stage ran the code without
error; when every stage failed that way, the trace fails saying the code needs data of another stage's layer.
Interventions that write a value computed on another stage are not supported (the write meets a meta
tensor there).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

ELSEWHERE = "\x00nnqueue: computed on another pipeline stage\x00"  # a placeholder, once saves leave the engine
MIXED_ERROR = "PipelineStageError"
_LATER_PROVIDERS = ("logits", "samples")  # nnsight's VLLM eproperties, served after sampling on the last stage


class StageObjects(dict[str, Any]):
    """nnsight's persistent-object map (``Module:<path>`` -> module) where other stages' modules resolve to a
    stand-in module, made once per path."""

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key) or (isinstance(key, str) and key.startswith("Module:"))

    def __missing__(self, key: str) -> Any:
        if not key.startswith("Module:"):
            raise KeyError(key)
        self[key] = stand_in = torch.nn.Identity()
        return stand_in


@dataclass(frozen=True)
class StageLayout:
    """Which module locations of the nnsight tree live on other stages, and whether before or after this one."""

    earlier: tuple[str, ...]  # envoy paths of missing modules before this stage's first layer
    later: tuple[str, ...]
    decoder_layers: frozenset[str]  # missing paths that are decoder layers (items of the layer list)
    last: bool

    @classmethod
    def of(cls, root: Any, first: bool, last: bool) -> StageLayout:
        earlier, later, decoder_layers = other_stages(
            [(envoy.path, envoy._module) for envoy in root.modules()], first, last
        )
        return cls(earlier=earlier, later=later, decoder_layers=decoder_layers, last=last)

    def elsewhere(self, provider: str, before: bool) -> str | None:
        """The missing module (or eproperty) ``provider`` reads, if it is served at this point, else None."""
        paths = self.earlier if before else self.later
        for path in paths:
            if provider.startswith(path + "."):
                return path
        if not before and not self.last and provider.rsplit(".", 1)[-1] in _LATER_PROVIDERS:
            return provider
        return None


def other_stages(
    named: list[tuple[str, Any]], first: bool, last: bool
) -> tuple[tuple[str, ...], tuple[str, ...], frozenset[str]]:
    """Which of a stage's modules (``(path, module)`` in module order) another stage runs: those before this
    stage's first decoder layer, those after it, and those that are decoder layers.

    Another stage's module is either vLLM's ``PPMissingLayer`` stand-in or a module this stage holds but never
    runs. vLLM's decoder models compute the input embeddings on the first stage only (``if
    get_pp_group().is_first_rank: ... embed_input_ids`` / ``get_input_embeddings``, else the hidden states
    come in ``intermediate_tensors``), and the final norm and head on the last only (the others return
    ``IntermediateTensors`` after their last layer). A model with tied embeddings
    (``tie_word_embeddings``: Llama 3.2 1B) builds a real ``embed_tokens`` on the last stage too, to tie
    ``lm_head`` to (``LlamaModel.__init__``), which that stage never calls: so on a stage other than the
    first, every module before its first decoder layer that is neither an ancestor nor a part of one of its
    layers is an earlier stage's, whatever its class; on a stage other than the last, likewise every module
    after its last layer is a later stage's.
    """
    missing = {path for path, module in named if type(module).__name__ == "PPMissingLayer"}
    lists = {path.rpartition(".")[0] for path in missing if path.rpartition(".")[2].isdigit()}
    held = [
        index
        for index, (path, _) in enumerate(named)
        if path not in missing and path.rpartition(".")[2].isdigit() and path.rpartition(".")[0] in lists
    ]
    first_real, last_real = (held[0], held[-1]) if held else (len(named), len(named))
    layers = [named[index][0] for index in held]

    def runs(path: str) -> bool:  # an ancestor of this stage's layers, one of them, or a part of one
        return any(not path or layer.startswith(path + ".") or (path + ".").startswith(layer + ".") for layer in layers)

    earlier = tuple(
        path
        for index, (path, _) in enumerate(named)
        if index < first_real and (path in missing or (not first and held and not runs(path)))
    )
    later = tuple(
        path
        for index, (path, _) in enumerate(named)
        if index > first_real and (path in missing or (not last and index > last_real and not runs(path)))
    )
    return earlier, later, frozenset(path for path in missing if path.rpartition(".")[0] in lists)


class PipelineStageMixin:
    """Mixed into the model runner (above nnsight's): stand-ins for other stages' modules, placeholders for
    their values. A pass-through on an engine of one stage."""

    nnqueue_stage: StageLayout | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        from vllm.distributed.parallel_state import get_pp_group

        super().load_model(*args, **kwargs)  # type: ignore[misc]
        pipeline = get_pp_group()
        if pipeline.world_size > 1:
            runner: Any = self
            runner.nnsight_persistent_objects = StageObjects(runner.nnsight_persistent_objects)
            self.nnqueue_stage = StageLayout.of(
                runner.nnsight_model, bool(pipeline.is_first_rank), bool(pipeline.is_last_rank)
            )

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        layout = self.nnqueue_stage
        if layout is None or not self._parked():
            return super()._model_forward(*args, **kwargs)  # type: ignore[misc]
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        tokens = int(positions.shape[-1]) if isinstance(positions, torch.Tensor) else 0
        self._serve(layout, tokens, before=True)
        output = super()._model_forward(*args, **kwargs)  # type: ignore[misc]
        self._serve(layout, tokens, before=False)
        return output

    def _parked(self) -> list[Any]:
        runner: Any = self
        interleaver = runner.nnsight_model.interleaver
        return [m for m in interleaver.mediators if m.alive and m.pending is not None and m.pending.provider]

    def _serve(self, layout: StageLayout, tokens: int, before: bool) -> None:
        """Serve placeholders to mediators parked on other stages' locations until none is (each location once)."""
        runner: Any = self
        interleaver = runner.nnsight_model.interleaver
        served: set[str] = set()
        while True:
            due = {
                provider: path
                for provider in {m.pending.provider for m in self._parked()} - served
                if (path := layout.elsewhere(provider, before)) is not None
            }
            if not due:
                return
            for provider, path in due.items():
                served.add(provider)
                interleaver.handle(provider, self._placeholder(layout, provider, path, tokens))

    def _placeholder(self, layout: StageLayout, provider: str, path: str, tokens: int) -> Any:
        runner: Any = self
        config = runner.model_config
        dtype = config.dtype

        def meta(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=kind, device="meta")

        hidden = config.get_hidden_size()
        where = provider[len(path) + 1 :] if provider != path else provider.rsplit(".", 1)[-1]
        if where == "logits":
            return meta(tokens, config.get_vocab_size())
        if where == "samples":
            return meta(tokens, 1, kind=torch.long)
        if path in layout.decoder_layers and where in ("input", "output"):
            pair = (meta(tokens, hidden), meta(tokens, hidden))
            return pair if where == "output" else ((meta(tokens, kind=torch.long), *pair), {})
        return meta(tokens, hidden) if where == "output" else ((meta(tokens, hidden),), {})


# ---------------------------------------------------------------- saves across stages (nnqueue_finish_trace)


@dataclass
class StageReport:
    """What one stage's reporting rank collected for a trace."""

    saves: dict[str, Any]
    error: dict[str, Any] | None
    load_failed: bool
    changed: list[str]  # the parameters the weights guard put back
    state: list[str] = field(default_factory=list)  # the other state the guards put back


def staged() -> bool:
    from vllm.distributed.parallel_state import get_pp_group

    return bool(get_pp_group().world_size > 1)


def strip(value: Any, memo: dict[int, Any] | None = None) -> Any:
    """``value`` with every placeholder (a meta tensor) replaced by `ELSEWHERE`, in the containers `merge` reads."""
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        return ELSEWHERE if value.is_meta else value
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, list):
        stripped: Any = [strip(item, memo) for item in value]
    elif isinstance(value, tuple) and not hasattr(value, "_fields"):
        stripped = tuple(strip(item, memo) for item in value)
    elif type(value) is dict:
        stripped = {name: strip(item, memo) for name, item in value.items()}
    else:
        return value
    memo[id(value)] = stripped
    return stripped


def _partial(value: Any) -> bool:
    """Whether ``value`` holds a placeholder anywhere `strip` looks."""
    if isinstance(value, str):
        return value == ELSEWHERE
    if isinstance(value, (list, tuple)):
        return any(_partial(item) for item in value)
    if type(value) is dict:
        return any(_partial(item) for item in value.values())
    return False


def merge_value(values: list[Any]) -> Any:
    """One saved name's value from each stage (in stage order): the first that no placeholder is in, else element
    by element where every stage saved a list, tuple or dict of the same shape, else still partial."""
    for value in values:
        if not _partial(value):
            return value
    candidates = [value for value in values if not (isinstance(value, str) and value == ELSEWHERE)]
    if not candidates:
        return ELSEWHERE
    first = candidates[0]
    if isinstance(first, (list, tuple)) and all(
        type(value) is type(first) and len(value) == len(first) for value in candidates
    ):
        items = [merge_value([value[index] for value in candidates]) for index in range(len(first))]
        return items if isinstance(first, list) else tuple(items)
    if type(first) is dict and all(type(value) is dict and value.keys() == first.keys() for value in candidates):
        return {name: merge_value([value[name] for value in candidates]) for name in first}
    return first


def _artefact(error: dict[str, Any] | None) -> bool:
    """Whether a stage's error came from a placeholder (a meta tensor's data was needed)."""
    return bool(error) and "meta" in str(error.get("message", "")).lower()  # type: ignore[union-attr]


def merge(reports: list[StageReport]) -> StageReport:
    """Every stage's report (stage order) as one: see the module doc."""
    names = list(dict.fromkeys(name for report in reports for name in report.saves))
    saves: dict[str, Any] = {}
    mixed: list[str] = []
    for name in names:
        value = merge_value([report.saves[name] for report in reports if name in report.saves])
        if _partial(value):
            mixed.append(name)
        else:
            saves[name] = value
    errors = [report.error for report in reports]
    real = [error for error in errors if error is not None and not _artefact(error)]
    error = real[0] if real else None
    if error is None and errors and all(_artefact(e) for e in errors):
        first = errors[0] or {}
        error = _stage_error(
            "the trace's code combines values of different pipeline stages of the engine, or needs the data of a"
            f" value another stage computes ({first.get('message')}); save each part and combine them in the client"
        )
    if error is None and mixed:
        error = _stage_error(
            f"{mixed} combine values computed on different pipeline stages of the engine; save each part and"
            " combine them in the client"
        )
    return StageReport(
        saves=saves,
        error=error,
        load_failed=any(report.load_failed for report in reports),
        changed=sorted({name for report in reports for name in report.changed}),
        state=sorted({name for report in reports for name in report.state}),
    )


def failed(error: Exception) -> StageReport:
    """A stage's report when collecting its saves failed."""
    return StageReport({}, _stage_error(f"collecting a pipeline stage's saves failed: {error!r}"), False, [])


def _stage_error(message: str) -> dict[str, Any]:
    return {"type_name": MIXED_ERROR, "message": message, "traceback": "", "is_control_flow": False}


def gather(report: StageReport) -> StageReport | None:
    """On every stage's reporting rank: send this stage's report to global rank 0; there, receive the others'
    and return the merged report (None on the other stages). Call on tensor-parallel rank 0 of every stage,
    for every trace, in the same order (every rank runs the same RPCs in order), whatever happened to the
    trace there (`failed` when collecting failed): a stage that skipped it would leave rank 0 waiting on its
    send, or feed its next trace's report to this one.

    Rank 0 receives every stage's bytes before loading any, so a report that does not load (a saved object
    the protected unpickler refuses) fails the trace and leaves the other stages' sends matched."""
    from vllm.distributed.parallel_state import get_pp_group

    from nnqueue.enginecore import protected, trace_results

    group = get_pp_group()
    if group.rank_in_group != 0:
        try:
            with protected.running_user_code():  # a saved object's own pickling is the trace's code
                data = pickle.dumps(
                    StageReport(
                        trace_results.snapshot(report.saves),
                        report.error,
                        report.load_failed,
                        report.changed,
                        report.state,
                    ).__dict__
                )
        except Exception as error:  # noqa: BLE001  (rank 0 waits for this stage: it always gets an answer)
            data = pickle.dumps(failed(error).__dict__)
        group.send_object(data, dst=0)
        return None
    received = [group.recv_object(src=stage) for stage in range(1, group.world_size)]
    return merge([report, *(_load(data) for data in received)])


def _load(data: bytes) -> StageReport:
    """A stage's report as `gather` sent it; a report that does not load is that stage's failure."""
    from nnqueue.enginecore import protected

    try:
        return StageReport(**protected.RestrictedUnpickler(io.BytesIO(data)).load())
    except Exception as error:  # noqa: BLE001  (the trace fails; the engine and the other reports go on)
        return failed(error)
