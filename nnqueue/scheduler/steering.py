"""Declarative steering jobs: the spec, its checks against the world, and the payload the worker runs.

JSON over HTTP (``POST /v1/steering``, with an optional safetensors file of vectors), YAML or JSON for
``nnqueue steer submit``::

    model_key: llama-8b
    dataset: {prompts: ["The weather today is"]}        # or token_ids, or a file under users/<owner>/
    sampling: {max_tokens: 64, temperature: 0, seed: 0, top_p: 1, logprobs: 5}
    edits:
      - {module: model.layers.16, op: add, coefficient: 4, vector: happy}          # a tensor of the uploaded file
      - module: model.layers.16
        io: input
        op: project_out
        vector: {harvest: <id>, capture: model.layers.16.output, stat: mean,
                 minus: {harvest: <id>, capture: model.layers.16.output}}         # a mean difference
    captures: [{module: model.layers.16}]      # optional: record activations of the steered pass, as a harvest
    selection: {kind: all, tokens: both}       # which tokens become rows (a harvest's selection); dtype: float32

A steering job is a job of kind ``steer`` (it is queued, claimed, cancelled and kept like a trace) that runs no
user code, so a ``harvest``-scope key may submit it. At submit every edit is checked against the capture
points the model's live workers published (`nnqueue.enginecore.capture_points`: the module, io and part, and
each vector's width), vectors named from harvests are read from their manifests' statistics (owned, completed
harvests), the prompts are read as a harvest's are (`harvest_dataset`), and the whole is frozen into the job's
payload: one safetensors file, the vectors as float32 tensors and the rest (prompts, edits, sampling) as JSON in
its metadata (`encode_payload`, read back by the worker with `decode_payload`). ``captures`` (optional) are a
harvest's, checked against the same published points with the harvest's check (`check_against`); the worker
records them in the same generation pass (`nnqueue.engines.steer_runner.run_steering_captured`). Every refusal is a
:class:`~nnqueue.scheduler.harvest_spec.HarvestRejected` whose status and message are the HTTP answer.
"""

from __future__ import annotations

import json
import struct
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from sqlalchemy.orm import Session

from nnqueue.db.models import EngineKind, Harvest, JobKind, JobStatus
from nnqueue.enginecore.capture_points import check_against
from nnqueue.enginecore.harvest_spec import Capture, Selection, SpecError, check_captures, check_dtype
from nnqueue.enginecore.steer_spec import MAX_EDITS, Edit, check_edits
from nnqueue.scheduler.admission import AdmissionPolicy
from nnqueue.scheduler.harvest_dataset import Example, Limits, load_examples, uploaded_examples
from nnqueue.scheduler.harvest_spec import MAX_CAPTURES, DatasetSpec, HarvestRejected, checked_selection
from nnqueue.scheduler.registry import live_capture_points, live_workers
from nnqueue.scheduler.submission import Accepted, accept_job
from nnqueue.storage.object_store import ObjectNotFound, ObjectStore

FORMAT = "nnqueue-steer/1"
METADATA_KEY = "nnqueue_steer"
VECTOR_PREFIX = "vector."
MAX_LOGPROBS = 20


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HarvestStat(Strict):
    """A per-capture statistic of a completed harvest's manifest (``statistics[capture][stat]``)."""

    harvest: uuid.UUID
    capture: str = Field(min_length=1, max_length=1000, description="A capture key, e.g. model.layers.16.output.")
    stat: Literal["mean"] = "mean"


class HarvestVector(HarvestStat):
    """A vector from harvest statistics, optionally minus another's (a mean difference)."""

    minus: HarvestStat | None = None


class EditSpec(Strict):
    module: str = Field(min_length=1, max_length=500)
    io: Literal["input", "output"] = "output"
    part: Literal["residual_stream", "hidden", "residual"] | None = None
    op: Literal["add", "scale", "project_out", "zero", "set"]
    coefficient: float = Field(1.0, allow_inf_nan=False)
    vector: str | HarvestVector | None = Field(
        None, description="A tensor name of the uploaded vectors file, or a harvest statistic."
    )
    apply_to: Literal["prompt", "generated", "both"] = "both"


class SamplingSpec(Strict):
    max_tokens: int = Field(16, ge=1, le=1 << 20)
    temperature: float = Field(0.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=(1 << 63) - 1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Top-k log-probabilities per token.")
    ignore_eos: bool = False


class SteerSpec(Strict):
    """The ``spec`` form field of ``POST /v1/steering``, a JSON object. Unknown fields are rejected."""

    model_key: str = Field(min_length=1, max_length=500, pattern=r"^[^\x00]+$")
    dataset: DatasetSpec = Field(default_factory=DatasetSpec)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    edits: list[EditSpec] = Field(min_length=1, max_length=MAX_EDITS)
    priority: int = Field(0, ge=-(1 << 31), le=(1 << 31) - 1)
    timeout_s: float | None = Field(None, gt=0, le=7 * 24 * 3600)
    metadata: dict[str, Any] = Field(default_factory=dict)
    captures: Annotated[list[Capture], AfterValidator(check_captures)] | None = Field(
        None,
        max_length=MAX_CAPTURES,
        description="Record these values (a harvest's captures) in the steered generation pass; null: none.",
    )
    selection: Annotated[Selection, AfterValidator(checked_selection)] = Field(
        default_factory=lambda: Selection(tokens="both"),
        description="Which tokens of each sequence become rows of the captures (a harvest's selection).",
    )
    dtype: Annotated[str, AfterValidator(check_dtype)] = Field("float32", description="The captures' stored dtype.")

    @model_validator(mode="after")
    def _selection_without_captures(self) -> Self:
        if self.captures is None and ("selection" in self.model_fields_set or "dtype" in self.model_fields_set):
            raise ValueError("selection and dtype are for captures; give captures too")
        return self

    def capture_json(self) -> dict[str, Any] | None:
        """What the worker records, as the payload holds it; None without captures."""
        if self.captures is None:
            return None
        captures = [capture.to_json() for capture in self.captures]
        return {"captures": captures, "selection": self.selection.to_json(), "dtype": self.dtype}


@dataclass(frozen=True)
class SteerSubmission:
    """Who submits, their limits, and what came with the spec (a vectors file, a dataset file)."""

    owner: str
    limits: Limits
    stale_after_s: float
    max_vector_bytes: int
    admission: AdmissionPolicy
    default_timeout_s: float
    inline_payload_max_bytes: int = 0
    api_key_id: int | None = None
    vectors: bytes | None = None
    dataset: tuple[str, bytes] | None = None  # (filename, bytes)


def accept_steering(session: Session, store: ObjectStore, spec: SteerSpec, submission: SteerSubmission) -> Accepted:
    """Check ``spec`` and add its QUEUED job to the caller's transaction; raises :class:`HarvestRejected` (or
    admission's refusals). The caller commits, then queues the job (`submission.queue_job`)."""
    points = _capture_points(session, spec.model_key, submission.stale_after_s)
    edits = _edits(spec)
    _check_points(edits, points)
    if spec.captures is not None:
        try:
            check_against(spec.captures, points)
        except SpecError as error:
            raise HarvestRejected(422, f"{spec.model_key!r}: {error}") from None
    uploaded = _uploaded_vectors(submission)
    vectors = _vectors(session, store, spec, submission.owner, uploaded)
    _check_widths(edits, vectors, {(p["module"], p["io"]): p.get("width") for p in points})
    prompts = _prompts(store, spec, submission)
    body = {
        "format": FORMAT,
        "prompts": prompts,
        "edits": [edit.to_json() for edit in edits],
        "sampling": spec.sampling.model_dump(),
        "capture": spec.capture_json(),
    }
    return accept_job(
        session,
        store,
        admission=submission.admission,
        inline_payload_max_bytes=submission.inline_payload_max_bytes,
        owner=submission.owner,
        api_key_id=submission.api_key_id,
        model_key=spec.model_key,
        payload=encode_payload(body, vectors),
        kind=JobKind.STEER,
        engine=EngineKind.VLLM,
        timeout_s=submission.default_timeout_s if spec.timeout_s is None else spec.timeout_s,
        priority=spec.priority,
        meta={"metadata": spec.metadata, "steer": {"prompts": len(prompts), "edits": len(edits)}},
    )


def _capture_points(session: Session, model_key: str, stale_after_s: float) -> list[dict[str, Any]]:
    points = live_capture_points(session, model_key, stale_after_s)
    if points is None:
        live = sorted({worker.model_key for worker in live_workers(session, stale_after_s)})
        raise HarvestRejected(
            400, f"no live worker serves model {model_key!r}; live models: {', '.join(live) or 'none'}"
        )
    if not points:
        raise HarvestRejected(400, f"the live workers of model {model_key!r} run no steering (vLLM workers do)")
    return points


def _edits(spec: SteerSpec) -> list[Edit]:
    """The engine's edits, vectors named: an uploaded tensor by its name, a harvest's by its place in the spec."""
    try:
        edits = [
            Edit(
                module=e.module,
                op=e.op,
                io=e.io,
                part=e.part,
                coefficient=e.coefficient,
                vector=e.vector if isinstance(e.vector, str) or e.vector is None else f"harvest.{index}",
                apply_to=e.apply_to,
            )
            for index, e in enumerate(spec.edits)
        ]
        check_edits(edits)
    except SpecError as error:
        raise HarvestRejected(422, str(error)) from None
    return edits


def _uploaded_vectors(submission: SteerSubmission) -> dict[str, np.ndarray]:
    if submission.vectors is None:
        return {}
    limit = submission.max_vector_bytes
    if len(submission.vectors) > limit:
        raise HarvestRejected(
            413, f"the vectors file is over {limit} bytes (NNQUEUE_STEER_MAX_VECTOR_BYTES); send fewer vectors"
        )
    try:
        from safetensors.numpy import load

        tensors = load(submission.vectors)
    except Exception as error:  # noqa: BLE001 - whatever the file's bytes are, the answer is a 422
        raise HarvestRejected(422, f"the vectors file is not a safetensors file: {error}") from None
    out = {}
    for name, tensor in tensors.items():
        if tensor.ndim != 1 or tensor.dtype.kind != "f":
            raise HarvestRejected(422, f"vector {name!r} must be a 1-D float tensor, not {tensor.dtype} {tensor.shape}")
        out[name] = tensor.astype(np.float32)
    return out


def _vectors(
    session: Session, store: ObjectStore, spec: SteerSpec, owner: str, uploaded: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The vectors the edits use, by the engine's names; refuses a missing name or an unusable harvest."""
    vectors: dict[str, np.ndarray] = {}
    for index, edit in enumerate(spec.edits):
        if edit.vector is None:
            continue
        if isinstance(edit.vector, str):
            if edit.vector not in uploaded:
                sent = sorted(uploaded) or "none"
                raise HarvestRejected(422, f"edit {index} names vector {edit.vector!r}; the vectors file has {sent}")
            vectors[edit.vector] = uploaded[edit.vector]
            continue
        value = _harvest_stat(session, store, edit.vector, owner)
        if edit.vector.minus is not None:
            other = _harvest_stat(session, store, edit.vector.minus, owner)
            if other.shape != value.shape:
                raise HarvestRejected(
                    422, f"edit {index}: the two statistics have {value.size} and {other.size} values"
                )
            value = value - other
        vectors[f"harvest.{index}"] = value
    for name, value in vectors.items():
        if not np.isfinite(value).all():
            raise HarvestRejected(422, f"vector {name!r} has NaN or infinite values")
    return vectors


def _harvest_stat(session: Session, store: ObjectStore, ref: HarvestStat, owner: str) -> np.ndarray:
    harvest = session.get(Harvest, ref.harvest)
    if harvest is None or harvest.owner != owner:
        raise HarvestRejected(404, f"no harvest {ref.harvest} of yours")
    if harvest.status is not JobStatus.COMPLETED or harvest.manifest_key is None:
        raise HarvestRejected(
            409, f"harvest {ref.harvest} is {harvest.status.value}; its statistics come when it completes"
        )
    try:
        manifest = json.loads(store.get_bytes(harvest.manifest_key))
    except ObjectNotFound:
        raise HarvestRejected(410, f"the manifest of harvest {ref.harvest} is no longer in the object store") from None
    statistics = manifest.get("statistics") or {}
    if ref.capture not in statistics:
        raise HarvestRejected(422, f"harvest {ref.harvest} captured no {ref.capture!r}; it has {sorted(statistics)}")
    return np.asarray(statistics[ref.capture][ref.stat], dtype=np.float32)


def _check_points(edits: list[Edit], points: list[dict[str, Any]]) -> None:
    """422 naming the edits at points the model's workers did not publish (and the modules they did)."""
    try:
        check_against([Capture(e.module, e.io, e.part) for e in edits], points)
    except SpecError as error:
        raise HarvestRejected(422, f"not steerable: {error}") from None


def _check_widths(edits: list[Edit], vectors: dict[str, np.ndarray], widths: dict[tuple[str, str], int | None]) -> None:
    for edit in edits:
        if edit.vector is None:
            continue
        width = widths.get(edit.point)
        if width is None:
            raise HarvestRejected(
                422, f"{edit.module}.{edit.io} does not publish its width, so it takes no vector: only scale and zero"
            )
        size = vectors[edit.vector].size
        if size != width:
            raise HarvestRejected(
                422, f"vector {edit.vector!r} has {size} values; {edit.module}.{edit.io} has {width} features"
            )


def _prompts(store: ObjectStore, spec: SteerSpec, submission: SteerSubmission) -> list[Example]:
    limits = submission.limits
    if submission.dataset is not None:
        if spec.dataset.inline is not None or spec.dataset.path or spec.dataset.prefix:
            raise HarvestRejected(
                422, "a dataset file was uploaded, so the spec's dataset must not name another source"
            )
        filename, data = submission.dataset
        if len(data) > limits.max_bytes:
            raise HarvestRejected(413, f"the dataset upload is over {limits.max_bytes} bytes")
        return uploaded_examples(data, filename, spec.dataset, limits)
    if spec.dataset.prefix is not None:
        raise HarvestRejected(422, "a steering job reads prompts, token_ids or one file (path), not a prefix")
    return load_examples(store, spec.dataset, submission.owner, limits)


def encode_payload(body: dict[str, Any], vectors: dict[str, np.ndarray]) -> bytes:
    """One safetensors file: ``vector.<name>`` float32 tensors, and ``body`` as JSON in its metadata."""
    from safetensors.numpy import save

    tensors = {VECTOR_PREFIX + name: np.ascontiguousarray(v, dtype=np.float32) for name, v in vectors.items()}
    return save(tensors, metadata={METADATA_KEY: json.dumps(body)})


def decode_payload(data: bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The body and the vectors (name -> float32 bytes) of `encode_payload`'s file; raises ``ValueError``."""
    from safetensors.numpy import load

    if len(data) < 8:
        raise ValueError("not a steering payload: too short")
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    body = json.loads((header.get("__metadata__") or {})[METADATA_KEY])
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} payload")
    vectors = {
        name[len(VECTOR_PREFIX) :]: np.ascontiguousarray(v, dtype=np.float32).tobytes()
        for name, v in load(data).items()
        if name.startswith(VECTOR_PREFIX)
    }
    return body, vectors
