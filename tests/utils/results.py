"""Results written the way a worker's engine writes them, for tests that finish jobs without a worker."""

from __future__ import annotations

import io
import uuid
from typing import Any

from nnqueue.storage.keys import SAFETENSORS_FILE, TORCH_FILE, result_key
from nnqueue.storage.object_store import ObjectStore
from nnqueue.storage.results import TORCH_AND_SAFETENSORS_FORMAT, TORCH_FORMAT, StoredResult


def store_result(store: ObjectStore, job_id: uuid.UUID, saves: dict[str, Any], attempt: int = 1) -> StoredResult:
    """``torch.save`` of the saves, and safetensors when all are tensors, under the attempt's result keys."""
    import torch
    from safetensors.torch import save as safetensors_save

    buffer = io.BytesIO()
    torch.save(saves, buffer)
    key = result_key(job_id, TORCH_FILE, attempt)
    size = store.put_bytes(key, buffer.getvalue())
    if not saves or not all(isinstance(value, torch.Tensor) for value in saves.values()):
        return StoredResult(key, size, TORCH_FORMAT)
    store.put_bytes(result_key(job_id, SAFETENSORS_FILE, attempt), safetensors_save(saves))
    return StoredResult(key, size, TORCH_AND_SAFETENSORS_FORMAT)
