"""A job's result in the object store: its formats, the record a worker keeps of it, and loading it.

Every trace result is ``torch.save({name: value})`` (``saves.pt``), with CPU tensors: what nnsight clients
load. When the job asked for it (``safetensors: true``) and every saved value is a tensor it is also written as
safetensors (``saves.safetensors``, beside it) for readers without Python pickles. The engine process writes
them (:mod:`nnqueue.enginecore.trace_results`);
the worker uploads them and records where they are, with the size and sha256 of each as uploaded
(:mod:`nnqueue.workers.sinks`), which clients check.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from nnqueue.storage.object_store import Digest

TORCH_FORMAT = "torch"
TORCH_AND_SAFETENSORS_FORMAT = "torch+safetensors"


@dataclass(frozen=True)
class StoredResult:
    key: str
    size: int
    format: str
    sha256: str
    safetensors: Digest | None = None  # the safetensors copy's, when there is one


def load_result(data: bytes) -> dict[str, Any]:
    """The saves dict of a ``saves.pt`` object. Unpickles: load only results of jobs you trust."""
    import torch

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
