"""What nnsight's own clients send and expect, read and written without nnsight, torch or unpickling.

nnsight 0.8.1's ``remote=True`` client (``RemoteBackend``) and ``serve=`` client (``LocalServeBackend``) send
a raw serialized trace (``RequestModel.serialize``: cloudpickle protocol 4, zstd-compressed when the client
compresses) and name the model with nnsight's model key. This module turns that into an nnqueue job:

* :func:`resolve_model` maps nnsight's key to nnqueue's model key and the engine kind that can run it:
  ``nnsight.modeling.vllm.vllm.VLLM:<path>`` -> ``<path>`` on a vLLM engine;
  ``nnsight.modeling.transformers.TransformersModel:{"repo_id", "revision", "task"}`` (what ``LanguageModel``
  sends) -> the repo id (``<repo id>@<revision>`` for a revision other than ``main``) on a transformers engine.
* :func:`decompress` undoes the client's zstd, never past the payload limit (no zip bombs).
* :func:`tracer_class` reads which tracer the payload holds (``VLLMTracer``, ``InterleavingTracer``, a
  session's plain ``Tracer``) from the pickle's first global reference, with ``pickletools.genops``, which
  parses opcodes without building any object.
* :func:`response` builds nnsight's ``ResponseModel`` JSON for a job: the status mapping of nnqueue's states
  (QUEUED "position N", RUNNING before invokes are counted -> DISPATCHED, RUNNING "k/n invokes",
  COMPLETED with the result URL, FAILED/CANCELLED -> ERROR with ``raise_deferred``'s text).
* :func:`sign_result` / :func:`verify_result`: result URLs that need no API key. Each job submitted through
  these protocols gets its own random signing key (kept in the job's row, never sent); a URL carries its
  expiry and whether to zstd-compress, signed with HMAC-SHA256 under that key, so any API process can mint
  and check them and a leaked URL opens one result until it expires.

The client's versions (the ``nnsight-version`` and ``python-version`` headers) are recorded like the nnqueue
client's (``meta["client"]``): a worker that cannot rebuild the trace names both sides' versions.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from nnqueue import trace_payload
from nnqueue.db.models import EngineKind, Job, JobStatus
from nnqueue.errors import NNqueueError
from nnqueue.trace_payload import PICKLE_PROTOCOL_4, SESSION_TRACER, ZSTD_MAGIC

VLLM_PREFIX = "nnsight.modeling.vllm.vllm.VLLM:"
# LanguageModel (and TransformersModel) keys; nnsight before 0.8 keyed LanguageModel under its own path.
TRANSFORMERS_PREFIXES = ("nnsight.modeling.transformers.TransformersModel:", "nnsight.modeling.language.LanguageModel:")
TRANSFORMERS_TASKS = frozenset({"text-generation"})
VLLM_TRACER = "nnsight.modeling.vllm.tracer.VLLMTracer"
# What RequestModel.serialize starts with: pickle protocol 4 and its first frame; or a zstd frame.
# A blocking client's job id derives from the session id its websocket was given (see job_id_for_session).
SESSION_NAMESPACE = uuid.UUID("5d0d7f4e-8e3c-4f0a-9a57-3e1f6f0b6c1d")


class ProtocolError(NNqueueError, ValueError):
    """The request cannot become a job; the message says why (a 400 for the client)."""


class PayloadTooLarge(ProtocolError):
    """The payload, once decompressed, is over the limit (a 413)."""


class SessionTaken(ProtocolError):
    """A job already exists for this session id (a 409)."""


@dataclass(frozen=True)
class Target:
    """Where an nnsight model key runs here: nnqueue's model key and the engine kind it needs."""

    model_key: str
    engine: EngineKind
    what: str  # how nnsight calls that model, for messages


def resolve_model(nnsight_key: str) -> Target:
    """nnqueue's model key and engine for nnsight's ``model_key``; raises :class:`ProtocolError`."""
    if nnsight_key.startswith(VLLM_PREFIX):
        path = nnsight_key[len(VLLM_PREFIX) :]
        if path:
            return Target(path, EngineKind.VLLM, "VLLM")
    for prefix in TRANSFORMERS_PREFIXES:
        if nnsight_key.startswith(prefix):
            return _transformers_target(nnsight_key[len(prefix) :])
    raise ProtocolError(
        f"unknown model key {nnsight_key[:300]!r}: this server runs nnsight VLLM models ({VLLM_PREFIX}<path>) and "
        f"LanguageModel / TransformersModel models ({TRANSFORMERS_PREFIXES[0]}{{...}})"
    )


def _transformers_target(suffix: str) -> Target:
    try:
        spec = json.loads(suffix)
    except ValueError:
        spec = None
    if not isinstance(spec, dict) or not isinstance(spec.get("repo_id"), str) or not spec["repo_id"]:
        raise ProtocolError(f"a TransformersModel key names a JSON object with a repo_id, not {suffix[:300]!r}")
    task = spec.get("task")
    if task is not None and task not in TRANSFORMERS_TASKS:
        raise ProtocolError(
            f"task {task!r} is not served: transformers engines run text-generation models (LanguageModel)"
        )
    revision = spec.get("revision")
    model_key = spec["repo_id"] if revision in (None, "main") else f"{spec['repo_id']}@{revision}"
    return Target(model_key, EngineKind.TRANSFORMERS, "LanguageModel")


def decompress(blob: bytes, compressed: bool, limit: int) -> bytes:
    """The raw payload: ``blob`` itself, or its zstd frame decompressed, at most ``limit`` bytes."""
    if not compressed:
        return blob
    import zstandard

    if not blob.startswith(ZSTD_MAGIC):
        raise ProtocolError("the request says the payload is compressed, but it is not a zstd frame")
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob), read_across_frames=True) as reader:
            data = reader.read(limit + 1)
    except zstandard.ZstdError as error:
        raise ProtocolError(f"the payload's zstd frame is corrupt: {error}") from None
    if len(data) > limit:
        raise PayloadTooLarge(
            f"payload too large: it decompresses to more than {limit} bytes (NNQUEUE_MAX_PAYLOAD_BYTES)"
        )
    return data


def tracer_class(payload: bytes) -> str:
    """``module.QualName`` of the tracer a raw nnsight payload holds (:func:`nnqueue.trace_payload.tracer_class`);
    raises :class:`ProtocolError` for anything that is not such a pickle."""
    if not payload.startswith(PICKLE_PROTOCOL_4):
        raise ProtocolError(
            "the payload is not an nnsight serialized trace (RequestModel.serialize: pickle protocol 4, or zstd)"
        )
    found = trace_payload.tracer_class(payload)
    if found is None:
        raise ProtocolError("the payload is not an nnsight serialized trace: no tracer at its start")
    return found


def check_runnable(target: Target, tracer: str) -> None:
    """Refuse (:class:`ProtocolError`) a payload the target's engine cannot run: on a vLLM engine, anything but a
    VLLM trace or a session (:mod:`nnqueue.engines.sessions`); anywhere, something other than an nnsight tracer."""
    if not tracer.startswith("nnsight."):
        raise ProtocolError(f"the payload holds a {tracer!r}, not an nnsight trace")
    if target.engine is EngineKind.VLLM and tracer not in (VLLM_TRACER, SESSION_TRACER):
        raise ProtocolError(f"a VLLM model runs VLLM traces (model.trace), not a {tracer}")


def check_env(target: Target, env: dict[str, Any]) -> dict[str, Any]:
    """The per-request environment (``RequestModel.env``) the engine may apply; refuses what it cannot."""
    if not isinstance(env, dict):
        raise ProtocolError("env must be a JSON object")
    if env.get("peft"):
        raise ProtocolError(f"PEFT adapters (env peft={str(env['peft'])[:200]!r}) are not supported by this server")
    allowed = {"attn_implementation"} if target.engine is EngineKind.TRANSFORMERS else set()
    unknown = sorted(set(env) - allowed - {"peft"})
    if unknown:
        raise ProtocolError(f"this server does not apply env {unknown} to {target.what} models")
    return {name: env[name] for name in allowed if env.get(name) is not None}


def client_versions(nnsight_version: str | None, python_version: str | None) -> dict[str, str] | None:
    """What the nnqueue client reports as ``meta["client"]``, from nnsight's headers (``python-version`` is
    the whole ``sys.version``: its first word is the version)."""
    if not nnsight_version and not python_version:
        return None
    python = (python_version or "").split(" ", 1)[0]
    return {"nnsight": (nnsight_version or "?")[:64], "python": (python or "?")[:64]}


def job_id_for_session(session_id: str) -> uuid.UUID:
    """The job id of a blocking request: derived from the session id the websocket handed out, so the
    subscription finds its job in the database from any API process; a client cannot pick an existing id."""
    if not session_id or len(session_id) > 200:
        raise ProtocolError("invalid session_id: use the one /subscribe sent")
    return uuid.uuid5(SESSION_NAMESPACE, session_id)


def new_session_id() -> str:
    return secrets.token_urlsafe(24)


def new_signing_key() -> str:
    return secrets.token_urlsafe(32)


# -- status updates ---------------------------------------------------------------------------------------


def response(
    job: Job, *, status: str | None = None, description: str = "", data: Any = None, position: int | None = None
) -> dict[str, Any]:
    """nnsight's ``ResponseModel`` (``id``, ``status``, ``description``, ``data``) for ``job``'s state."""
    if status is None:
        status, description = _status(job, position)
    body: dict[str, Any] = {"id": str(job.id), "status": status, "description": description}
    if data is not None:
        body["data"] = data
    return body


def _status(job: Job, position: int | None) -> tuple[str, str]:
    if job.status is JobStatus.QUEUED:
        return "QUEUED", f"position {position}" if position is not None else "waiting for a worker"
    if job.status is JobStatus.RUNNING:
        if job.progress_total is None:
            return "DISPATCHED", "running on a worker"
        return "RUNNING", f"{job.progress_done}/{job.progress_total} invokes"
    if job.status is JobStatus.COMPLETED:
        return "COMPLETED", "done"
    return "ERROR", error_text(job)


def error_text(job: Job) -> str:
    """An ended job's failure, as nnsight's ``raise_deferred`` words it (``Type: message``, then the traceback)."""
    if job.status is JobStatus.CANCELLED:
        return f"JobCancelled: {job.error_message or f'job {job.id} was cancelled'}"
    lines = [f"{job.error_type or 'JobFailed'}: {job.error_message or ''}"]
    if job.error_traceback:
        lines += ["", "Intervention traceback:", job.error_traceback.rstrip()]
    return "\n".join(lines)


def deferred_error(job: Job) -> dict[str, Any] | None:
    """A failed or cancelled job's error as nnsight's ``DeferredError`` dict (what ``serve=`` clients re-raise)."""
    if job.status is JobStatus.CANCELLED:
        return {
            "type_name": "JobCancelled",
            "message": job.error_message or f"job {job.id} was cancelled",
            "traceback": "",
            "is_control_flow": False,
        }
    if job.status is not JobStatus.FAILED:
        return None
    return {
        "type_name": job.error_type or "JobFailed",
        "message": job.error_message or "",
        "traceback": job.error_traceback or "",
        "is_control_flow": False,
    }


# -- result URLs ------------------------------------------------------------------------------------------


def signing_key(job: Job) -> str | None:
    ndif = job.meta.get("ndif") if isinstance(job.meta, dict) else None
    key = ndif.get("url_key") if isinstance(ndif, dict) else None
    return key if isinstance(key, str) else None


def sign_result(key: str, job_id: uuid.UUID, expires: int, compress: bool) -> str:
    message = f"{job_id}:{expires}:{int(compress)}".encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def verify_result(key: str | None, job_id: uuid.UUID, expires: int, compress: bool, signature: str) -> bool:
    """Whether ``signature`` is this job's for that expiry and compression, and the expiry has not passed."""
    if key is None or expires < time.time():
        return False
    return hmac.compare_digest(sign_result(key, job_id, expires, compress), signature)
