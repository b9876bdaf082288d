"""Results written the way a worker's engine writes them, for tests that finish jobs without a worker."""

from __future__ import annotations

import hashlib
import io
import uuid
from typing import Any

from nnqueue.storage.keys import SAFETENSORS_FILE, TORCH_FILE, result_key
from nnqueue.storage.object_store import Digest, ObjectStore
from nnqueue.storage.results import TORCH_AND_SAFETENSORS_FORMAT, TORCH_FORMAT, StoredResult


def store_result(store: ObjectStore, job_id: uuid.UUID, saves: dict[str, Any], attempt: int = 1) -> StoredResult:
    """``torch.save`` of the saves, and safetensors when all are tensors, under the attempt's result keys."""
    import torch
    from safetensors.torch import save as safetensors_save

    buffer = io.BytesIO()
    torch.save(saves, buffer)
    key = result_key(job_id, TORCH_FILE, attempt)
    size = store.put_bytes(key, buffer.getvalue())
    sha256 = hashlib.sha256(buffer.getvalue()).hexdigest()
    if not saves or not all(isinstance(value, torch.Tensor) for value in saves.values()):
        return StoredResult(key, size, TORCH_FORMAT, sha256)
    data = safetensors_save(saves)
    store.put_bytes(result_key(job_id, SAFETENSORS_FILE, attempt), data)
    return StoredResult(
        key, size, TORCH_AND_SAFETENSORS_FORMAT, sha256, Digest(len(data), hashlib.sha256(data).hexdigest())
    )


def result_fields(stored: StoredResult) -> dict[str, Any]:
    """The job row's fields for ``stored``, as a worker records them."""
    return {
        "result_key": stored.key,
        "result_size": stored.size,
        "result_format": stored.format,
        "result_sha256": stored.sha256,
        "result_safetensors_size": stored.safetensors.size if stored.safetensors else None,
        "result_safetensors_sha256": stored.safetensors.sha256 if stored.safetensors else None,
    }
