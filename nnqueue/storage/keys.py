"""Object keys: where a job's payload and its named results, and a harvest's files, live in the object store."""

from __future__ import annotations

from uuid import UUID

# The names of a job's results (see nnqueue.storage.results, which writes them).
TORCH_FILE = "saves.pt"
SAFETENSORS_FILE = "saves.safetensors"
ACTIVATIONS_FILE = "activations.safetensors"  # a steering job's captures, beside its generations


def payload_key(job_id: str | int | UUID) -> str:
    """``payloads/<job>``: the serialized intervention a client submitted."""
    return f"payloads/{_segment(str(job_id), 'job id')}"


def result_key(job_id: str | int | UUID, name: str, attempt: int | None = None) -> str:
    """``results/<job>/<name>``: one named output of a job; ``results/<job>/<attempt>/<name>``: of one attempt.

    Trace results are per attempt: the engine writes them straight to the store, so a worker that lost the
    job (it was requeued and claimed elsewhere) must not overwrite the new holder's result.
    """
    job = _segment(str(job_id), "job id")
    where = job if attempt is None else f"{job}/{_segment(str(int(attempt)), 'attempt')}"
    return f"results/{where}/{_segment(name, 'result name')}"


def results_prefix(job_id: str | int | UUID) -> str:
    """``results/<job>/``: the folder holding every result of every attempt of a job."""
    return f"results/{_segment(str(job_id), 'job id')}/"


def sibling_key(key: str, name: str) -> str:
    """The key of the object ``name`` beside ``key`` (the safetensors copy of a ``saves.pt``)."""
    return f"{key.rsplit('/', 1)[0]}/{_segment(name, 'result name')}"


def harvest_key(harvest_id: str | UUID, name: str) -> str:
    """``harvests/<id>/<name>``: a harvest's shards, its frozen dataset and its manifest."""
    return f"harvests/{_segment(str(harvest_id), 'harvest id')}/{_segment(name, 'file name')}"


def shard_name(index: int) -> str:
    """``shard-NNNNN.safetensors``: the one shard chunk ``index`` writes (deterministic, so a re-run overwrites it)."""
    return f"shard-{index:05d}.safetensors"


MANIFEST_FILE = "manifest.json"
DATASET_FILE = "dataset.jsonl"


def _segment(value: str, what: str) -> str:
    """One path segment of a key: non-empty, no ``/``, and not a ``..`` that could climb out."""
    if not value or "/" in value or ".." in value or "\x00" in value:
        raise ValueError(f"invalid {what} {value!r}: must be non-empty without '/', '..' or NUL")
    return value
