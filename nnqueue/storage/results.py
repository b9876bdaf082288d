"""How a job's saved values are written to and read from the object store.

Every result is ``torch.save({name: value})`` at ``results/<job>/saves.pt``: what nnsight clients load.
When every saved value is a tensor it is also written as safetensors at ``results/<job>/saves.safetensors``
for readers without Python pickles. Keys depend only on the job id, so a redelivered job overwrites
its own result rather than leaving a second one.
"""

from __future__ import annotations

import io
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save as safetensors_save
from torch.utils._pytree import tree_map

from nnqueue.storage.keys import SAFETENSORS_FILE, TORCH_FILE, result_key
from nnqueue.storage.object_store import ObjectStore

TORCH_FORMAT = "torch"
TORCH_AND_SAFETENSORS_FORMAT = "torch+safetensors"


@dataclass(frozen=True)
class StoredResult:
    key: str
    size: int
    format: str


def to_cpu(saves: dict[str, Any]) -> dict[str, Any]:
    """The saves with every tensor, however nested, moved to the CPU (results must load anywhere)."""
    return tree_map(lambda value: value.cpu() if isinstance(value, torch.Tensor) else value, saves)


def write_result(store: ObjectStore, job_id: uuid.UUID, saves: dict[str, Any]) -> StoredResult:
    saves = to_cpu(saves)
    key = result_key(job_id, TORCH_FILE)
    # Spooled to a temporary file, not memory: an all-token harvest can be gigabytes.
    with tempfile.TemporaryFile() as spool:
        torch.save(saves, spool)
        spool.seek(0)
        size = store.put_stream(key, spool)
    if not saves or not all(isinstance(value, torch.Tensor) for value in saves.values()):
        return StoredResult(key, size, TORCH_FORMAT)
    store.put_bytes(
        result_key(job_id, SAFETENSORS_FILE),
        safetensors_save({name: value.detach().contiguous().clone() for name, value in saves.items()}),
    )
    return StoredResult(key, size, TORCH_AND_SAFETENSORS_FORMAT)


def load_result(data: bytes) -> dict[str, Any]:
    """The saves dict of a ``saves.pt`` object. Unpickles: load only results of jobs you trust."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
