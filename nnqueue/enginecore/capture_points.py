"""Which values of a vLLM model a harvest can capture, and how to read one out of a module call.

Names are those of ``named_modules()`` on the model vLLM loaded (``model.layers.16``). A module is a
*decoder layer* when its forward takes ``hidden_states`` and ``residual`` (vLLM's Llama, Qwen, Mistral,
Gemma ... layers: called as ``(positions, hidden_states, residual)``, returning ``(hidden, residual)``);
its parts are the residual stream (their sum, equal to Hugging Face's hidden state) or either half.
Any other module gives its tensor output (element 0 of a tuple, e.g. a norm called with a residual) or,
as input, its ``hidden_states`` argument, else its first one.

Left out: modules the model's forward never calls on the step's tokens (the LM head, the logits
processor, containers), rotary embeddings (they return query/key pairs), and inputs that are token
ids or positions. Under tensor parallelism only values that are whole on every rank are offered (see
`replicated`): a column-parallel layer's output, a row-parallel layer's input, attention heads and
activations are one rank's slice, and the engine's rank 0 writes shards alone.

Under pipeline parallelism each stage offers the modules it holds: vLLM builds the others as
``PPMissingLayer`` stand-ins (``vllm.model_executor.models.utils.make_layers``), which are left out.
Each point then names its ``stage``, and the engine's points are every stage's (`merge_stages`); a
harvest's captures must all live on one stage (`check_against`), whose process captures and writes the
shard (see :mod:`nnqueue.enginecore.harvest_capture`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from nnqueue.enginecore.harvest_spec import DECODER_PARTS, RESIDUAL_STREAM, Capture, SpecError

_NOT_IN_FORWARD = ("ParallelLMHead", "LogitsProcessor", "Sampler")
_NON_ACTIVATION_ARGS = ("input_ids", "positions")


@dataclass(frozen=True)
class Reader:
    """How to pull one capture's value out of a module call (computed once per module).

    ``value_arg``/``residual_arg`` are ``(position, name)`` of the forward's hidden-states and residual
    parameters: a hook sees ``args`` and ``kwargs`` as the caller passed them.
    """

    decoder: bool
    value_arg: tuple[int, str]
    residual_arg: tuple[int, str] | None

    def input_parts(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """(hidden, residual) a module was called with; residual is None for non-decoder modules."""
        value = _argument(args, kwargs, self.value_arg)
        residual = _argument(args, kwargs, self.residual_arg) if self.residual_arg else None
        return value, residual

    @staticmethod
    def output_parts(output: Any) -> tuple[Any, Any]:
        """(hidden, residual) of a decoder layer's output, or (tensor, None) of another module's."""
        if isinstance(output, (tuple, list)):
            return output[0], (output[1] if len(output) > 1 else None)
        return output, None


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], where: tuple[int, str]) -> Any:
    index, name = where
    return args[index] if len(args) > index else kwargs.get(name)


def _parameters(module: Any) -> list[str]:
    # The class's forward, not the instance attribute: nnsight may swap ``module.forward`` mid-trace.
    try:
        return list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):  # a forward Python cannot introspect (a builtin)
        return []


def reader(module: Any) -> Reader:
    names = _parameters(module)
    decoder = "hidden_states" in names and "residual" in names
    value = "hidden_states" if "hidden_states" in names else names[0] if names else ""
    return Reader(
        decoder=decoder,
        value_arg=(names.index(value) if value else 0, value),
        residual_arg=(names.index("residual"), "residual") if decoder else None,
    )


def _excluded(name: str, module: Any) -> bool:
    import torch

    kind = type(module)
    if not name or isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)) or _missing(module):
        return True
    if kind.__name__ in _NOT_IN_FORWARD or "Rotary" in kind.__name__:
        return True
    return "input_ids" in _parameters(module)  # the base model: its output is the final norm's


def _missing(module: Any) -> bool:
    """Whether ``module`` is vLLM's stand-in for a layer another pipeline stage holds."""
    return type(module).__name__ == "PPMissingLayer"


def _input_is_activation(module: Any) -> bool:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if isinstance(module, VocabParallelEmbedding):
        return False
    names = _parameters(module)
    read = reader(module)
    return bool(names) and read.value_arg[1] not in _NON_ACTIVATION_ARGS


def replicated(module: Any, io: str, decoder: bool) -> bool:
    """Whether ``module``'s ``io`` is the whole value on every tensor-parallel rank.

    True for decoder layers, norms, the embedding's output, a row-parallel layer's output when it
    all-reduces, a column-parallel layer's input, and any linear layer vLLM built unsharded
    (``tp_size == 1``, e.g. ``disable_tp``). Everything else is treated as one rank's slice: a
    column-parallel output, a row-parallel input, attention heads, activations, containers whose last
    step is sharded; capture the row-parallel output or the next norm's input instead.
    """
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if decoder or type(module).__name__.endswith(("Norm", "RMSNorm", "LayerNorm")):
        return True
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.tp_size == 1:
        return True
    if isinstance(module, VocabParallelEmbedding):
        return io == "output"
    if isinstance(module, RowParallelLinear):
        return io == "output" and module.reduce_results
    if isinstance(module, ColumnParallelLinear):
        return io == "input" or module.gather_output
    return False


def capture_points(model: Any, tp_size: int = 1, stage: int | None = None, last: bool = True) -> list[dict[str, Any]]:
    """Every capturable point of ``model``: ``{"module", "io", "parts", "width"}``, in module order.

    ``parts`` lists the decoder-layer parts a capture may name (``residual_stream`` first, the
    default), or is empty for a plain tensor. The first decoder layer's input has no residual.
    ``width`` is the value's features where the module says (`width`), else None: for size estimates.
    ``stage``: this pipeline stage's index, added to every point (pipeline parallelism only), and ``last``
    whether it is the last stage: modules this stage holds but another runs (a tied ``embed_tokens`` on the
    last stage: `pipeline_stages.other_stages`) are left out.
    """
    points: list[dict[str, Any]] = []
    first_decoder = True
    named = list(model.named_modules())
    elsewhere: set[str] = set()
    if stage is not None:
        from nnqueue.enginecore.pipeline_stages import other_stages

        earlier, later, _ = other_stages(named, stage == 0, last)
        elsewhere = {*earlier, *later}
    for name, module in named:
        if _missing(module):  # a layer of an earlier stage: none of this stage's is the model's first
            first_decoder = False
        if _excluded(name, module) or any(name == path or name.startswith(path + ".") for path in elsewhere):
            continue
        read = reader(module)
        for io in ("input", "output"):
            if io == "input" and not _input_is_activation(module):
                continue
            if tp_size > 1 and not replicated(module, io, read.decoder):
                continue
            parts: list[str] = []
            if read.decoder:
                parts = [p for p in DECODER_PARTS if not (io == "input" and first_decoder and p == "residual")]
            point = {"module": name, "io": io, "parts": parts, "width": width(module, io, read.decoder)}
            points.append(point if stage is None else {**point, "stage": stage})
        first_decoder = first_decoder and not read.decoder
    return points


def merge_stages(answers: list[Any]) -> list[dict[str, Any]]:
    """The engine's points from every rank's answer (lists from each stage's reporting rank, None elsewhere),
    in stage order: vLLM numbers ranks stage by stage, so answers come in that order."""
    return [point for answer in answers if isinstance(answer, list) for point in answer]


def held(captures: list[Capture], points: list[dict[str, Any]]) -> list[Capture]:
    """The captures whose module and io are among ``points`` (one stage's)."""
    offered = {(p["module"], p["io"]) for p in points}
    return [capture for capture in captures if (capture.module, capture.io) in offered]


def width(module: Any, io: str, decoder: bool) -> int | None:
    """The features of a module's value as its attributes name them (vLLM's layers: ``hidden_size``,
    ``input_size``/``output_size``; torch's ``in_features``/``out_features``, ``embedding_dim``), else None."""
    names: tuple[str, ...] = ("hidden_size",) if decoder else ()
    if io == "output":
        names += ("output_size", "out_features", "embedding_dim", "hidden_size")
    else:
        names += ("input_size", "in_features", "hidden_size")
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_against(captures: list[Capture], points: list[dict[str, Any]]) -> None:
    """Raise `SpecError` naming every capture that is not among ``points`` (and what is)."""
    offered = {(p["module"], p["io"]): p["parts"] for p in points}
    bad = []
    for capture in captures:
        parts = offered.get((capture.module, capture.io))
        if parts is None or (capture.part is not None and capture.part not in parts):
            bad.append(capture.key + (f" (part {capture.part})" if capture.part else ""))
    if bad:
        modules = sorted({module for module, _ in offered})
        raise SpecError(f"not capturable on this model: {bad}; capturable modules: {modules}")
    stage_of = {(p["module"], p["io"]): p["stage"] for p in points if "stage" in p}
    stages = {stage_of[c.module, c.io] for c in captures if (c.module, c.io) in stage_of}
    if len(stages) > 1:
        where = {c.key: stage_of[c.module, c.io] for c in captures}
        raise SpecError(
            f"a harvest's captures must live on one pipeline stage of the engine, these are on stages {where};"
            " submit one harvest per stage"
        )


def default_part(read: Reader, capture: Capture) -> str | None:
    """The part a capture reads: the residual stream for a decoder layer unless it names one."""
    if not read.decoder:
        return None
    return capture.part or RESIDUAL_STREAM
