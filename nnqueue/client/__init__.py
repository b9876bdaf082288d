"""The nnqueue Python client: submit traces, follow jobs, fetch results; and an nnsight backend; harvests.

    from nnqueue.client import Client
    client = Client("http://127.0.0.1:8000", api_key)        # or Client.from_env(): NNQUEUE_URL, NNQUEUE_API_KEY
    with model.trace("The Eiffel Tower is in", backend=client.backend(), max_tokens=3):
        logits = model.logits.save()

The backend (`NNqueueBackend`, which imports nnsight) loads on first use, so the CLI starts fast. On a
CPU-only machine, importing the client also lets a meta ``VLLM`` build (see :mod:`nnqueue.client.platform`).
"""

from typing import Any

from nnqueue.client import platform
from nnqueue.client.client import Client
from nnqueue.client.errors import (
    AmbiguousIdError,
    APIConnectionError,
    APIError,
    AuthenticationError,
    ConflictError,
    HarvestFailed,
    IntegrityError,
    JobCancelled,
    JobFailed,
    NNqueueError,
    NotFoundError,
    PayloadTooLargeError,
    TooManyJobsError,
    UnknownModelError,
    WaitTimeout,
)
from nnqueue.client.harvest import Harvest
from nnqueue.client.job import Job
from nnqueue.client.settings import ClientSettings

platform.install()

__all__ = [
    "APIConnectionError",
    "APIError",
    "AmbiguousIdError",
    "AuthenticationError",
    "Client",
    "ClientSettings",
    "ConflictError",
    "Harvest",
    "HarvestFailed",
    "IntegrityError",
    "Job",
    "JobCancelled",
    "JobFailed",
    "NNqueueBackend",
    "NNqueueError",
    "NotFoundError",
    "PayloadTooLargeError",
    "TooManyJobsError",
    "UnknownModelError",
    "WaitTimeout",
]


def __getattr__(name: str) -> Any:
    if name == "NNqueueBackend":
        from nnqueue.client.backend import NNqueueBackend

        return NNqueueBackend
    raise AttributeError(f"module 'nnqueue.client' has no attribute {name!r}")
