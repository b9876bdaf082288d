"""The harvest spec: what a researcher asks for, declaratively (no code runs on the worker).

JSON over HTTP (``POST /v1/harvests``), YAML or JSON in a file for ``nnqueue harvest submit``::

    model_key: smollm2-135m
    dataset: {path: users/alice/corpus.jsonl, field: text, limit: 10000}   # or prompts: [...], token_ids: [[...]]
    max_length: 128
    captures: [{module: model.layers.12}]                 # output residual stream (= HF's hidden state)
    selection: {kind: all}                                # all | first | last (n) | mean | positions
    # generate: {max_tokens: 64, temperature: 0.7, seed: 1}  # then selection.tokens: generated | both
    # outliers: {action: drop, times_median: 10}           # or clip; or max_norm: 1500
    dtype: float32
    prompts_per_chunk: 64

The captures and the token selection are the engine's own vocabulary (:class:`nnqueue.enginecore.harvest_spec.Capture`
and :class:`~nnqueue.enginecore.harvest_spec.Selection`, whose checks pydantic runs), so what the API accepts is
exactly what the engine runs (their checks raise ``SpecError``, a ``ValueError``, which pydantic reports with the
field's location). Pydantic checks the shape here; :mod:`nnqueue.scheduler.harvests` checks it against
the world (the model's capturable points, the dataset's file and column, the size limits) when a harvest is planned.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from nnqueue.enginecore.harvest_spec import (
    Capture,
    Generation,
    Selection,
    check_captures,
    check_dtype,
    check_generation,
)
from nnqueue.errors import NNqueueError
from nnqueue.outliers import Outliers

MAX_CAPTURES = 32
MAX_POSITIONS = 4096


class HarvestRejected(NNqueueError, ValueError):
    """A spec that cannot be harvested; ``status`` is the HTTP status that says why (400, 403, 404, 413, 422)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DatasetSpec(Strict):
    """Exactly one source: inline ``prompts`` or ``token_ids``, one object-store file (``path``) or, for a
    schedule, every file under ``prefix``. Files live under the caller's prefix ``users/<owner>/`` (a file
    uploaded with ``POST /v1/harvests`` lands there too)."""

    prompts: list[str] | None = Field(None, description="Inline text prompts.")
    token_ids: list[list[int]] | None = Field(None, description="Inline prompts, already tokenized.")
    path: str | None = Field(None, max_length=1024, description="An object key under users/<owner>/.")
    prefix: str | None = Field(
        None, max_length=1024, description="Schedules: every file under this key prefix, in key order."
    )
    format: Literal["jsonl", "parquet", "text"] | None = Field(
        None, description="jsonl, parquet or text; default from the extension (.jsonl/.json, .parquet, else text)."
    )
    field: str = Field("text", min_length=1, max_length=200, description="The JSONL field or Parquet column.")
    offset: int = Field(0, ge=0, description="Examples to skip first.")
    limit: int | None = Field(None, ge=1, description="At most this many examples (after offset).")

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        given = [name for name in ("prompts", "token_ids", "path", "prefix") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give one dataset source, not {' and '.join(given)}")
        return self

    @property
    def inline(self) -> list[Any] | None:
        return self.prompts if self.prompts is not None else self.token_ids


def checked_selection(selection: Selection) -> Selection:
    if len(selection.positions) > MAX_POSITIONS:
        raise ValueError(f"a selection lists at most {MAX_POSITIONS} positions, not {len(selection.positions)}")
    return selection


class HarvestSpec(Strict):
    """A harvest: the dataset through ``model_key``, the ``captures`` out, as shards of ``dtype`` tensors.

    The dataset is split into chunks of ``prompts_per_chunk`` prompts; each chunk is run by one worker and
    writes exactly one shard, ``harvests/<id>/shard-<chunk index, 5 digits>.safetensors``, so a chunk
    that runs again (its worker died) overwrites its own shard and nothing else.
    """

    model_key: str = Field(min_length=1, max_length=500)
    dataset: DatasetSpec = Field(
        default_factory=DatasetSpec, description="Where the prompts come from; left out: the file uploaded with it."
    )
    max_length: int | None = Field(
        None, ge=1, le=1_000_000, description="Truncate prompts to this many tokens (default: the engine's limit)."
    )
    add_special_tokens: bool = Field(True, description="Let the tokenizer add its special tokens (BOS).")
    captures: Annotated[list[Capture], AfterValidator(check_captures)] = Field(min_length=1, max_length=MAX_CAPTURES)
    selection: Annotated[Selection, AfterValidator(checked_selection)] = Field(default_factory=Selection)
    dtype: Annotated[str, AfterValidator(check_dtype)] = Field(
        "float32", description="The stored dtype: bfloat16, float16 or float32."
    )
    prompts_per_chunk: int = Field(64, ge=1, le=100_000, description="Prompts per chunk, and so per shard.")
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1, description="Higher runs earlier among an owner's peers.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Anything; kept in the manifest.")
    generate: Generation | None = Field(
        None, description="Let the model generate after each prompt (max_tokens, temperature, seed, ignore_eos)."
    )
    outliers: Outliers | None = Field(
        None,
        description="Drop or clip rows whose norm is over a limit: {action: drop | clip, max_norm: a norm} or"
        " {action, times_median: a multiple of the median norm of each chunk's rows}.",
    )

    weights_version: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="Run only on engines serving this weights version, or 'latest' (resolved at submit); null: any.",
    )

    @model_validator(mode="after")
    def _generated_rows_need_generation(self) -> Self:
        check_generation(self.selection, self.generate)
        return self

    @property
    def generated_positions(self) -> int:
        """At most the generated tokens per prompt that run through the model and can be rows (0: none)."""
        return self.generate.positions if self.generate is not None else 0
