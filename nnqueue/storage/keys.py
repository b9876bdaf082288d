"""Object keys: where a job's payload and its named results live in the object store."""

from __future__ import annotations

from uuid import UUID

# The names of a job's results (see nnqueue.storage.results, which writes them).
TORCH_FILE = "saves.pt"
SAFETENSORS_FILE = "saves.safetensors"


def payload_key(job_id: str | int | UUID) -> str:
    """``payloads/<job>``: the serialized intervention a client submitted."""
    return f"payloads/{_segment(str(job_id), 'job id')}"


def result_key(job_id: str | int | UUID, name: str) -> str:
    """``results/<job>/<name>``: one named output of a job."""
    return f"results/{_segment(str(job_id), 'job id')}/{_segment(name, 'result name')}"


def _segment(value: str, what: str) -> str:
    """One path segment of a key: non-empty, no ``/``, and not a ``..`` that could climb out."""
    if not value or "/" in value or ".." in value or "\x00" in value:
        raise ValueError(f"invalid {what} {value!r}: must be non-empty without '/', '..' or NUL")
    return value
