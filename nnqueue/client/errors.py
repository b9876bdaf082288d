"""What the client raises: HTTP failures (with the API's status and detail) and job outcomes.

A job that FAILED on the worker surfaces as :class:`JobFailed`, a ``RuntimeError`` whose message has
the shape of nnsight's ``raise_deferred``: ``"<Type>: <message>"``, then the worker-side traceback
under ``Intervention traceback:``. Code that already matches nnsight's errors from a vLLM engine (which
``raise_deferred`` re-raises as ``RuntimeError``) matches these too. When the original type is a Python
built-in exception, the error is also an instance of it: a ``TypeError`` in intervention code can be
caught with ``except TypeError`` as well as ``except RuntimeError``. An error vLLM itself raised for the
request (``VLLMValidationError`` for a prompt longer than ``max_model_len``, say: vLLM's request checks, which
a local run raises as they are, not through ``raise_deferred``) is an instance of that ``vllm.exceptions``
class, when vLLM is installed here, and reads as vLLM's message alone, as it does locally. Code that wants the parts reads
``type_name``, ``error_message`` and ``traceback``; ``saves`` holds what the trace's other invokes saved.
"""

from __future__ import annotations

import builtins
import functools
from typing import Any, Protocol


class Followed(Protocol):
    """What an error says about a job or a harvest (:class:`~nnqueue.client.job.Job`,
    :class:`~nnqueue.client.harvest.Harvest`): its id and the API's last answer about it. A protocol, so that
    this module, which they import, imports neither of them."""

    info: dict[str, Any]

    @property
    def id(self) -> str: ...


class NNqueueError(Exception):
    """Base class of every error the nnqueue client raises."""


class APIConnectionError(NNqueueError, ConnectionError):
    """The API could not be reached (refused, timed out, DNS, TLS)."""


class APIError(NNqueueError):
    """The API answered with an error status; ``detail`` is its explanation."""

    def __init__(self, status_code: int, detail: Any, *, method: str = "", url: str = "") -> None:
        self.status_code = status_code
        self.detail = detail
        self.method = method
        self.url = url
        where = f" ({method} {url})" if method else ""
        super().__init__(f"{status_code}{where}: {format_detail(detail)}")


class AuthenticationError(APIError):
    """401: the API key is missing, unknown or revoked."""


class NotFoundError(APIError):
    """404: no such job (or one that belongs to another owner)."""


class ConflictError(APIError):
    """409: the job is in the wrong state (cancelling an ended job, a result before completion)."""


class PayloadTooLargeError(APIError):
    """413: the serialized trace is over the server's limit."""


class TooManyJobsError(APIError):
    """429: this key has too many jobs in flight."""


class UnknownModelError(APIError):
    """400 on submit: no live worker serves the model key (the detail names the live ones)."""


class AmbiguousIdError(NNqueueError, LookupError):
    """An id's first characters that start several of the owner's jobs (or harvests): give more of them."""

    def __init__(self, noun: str, prefix: str, matches: list[str], more: bool) -> None:
        self.prefix, self.matches = prefix, matches
        listed = ", ".join(matches) + (", ..." if more else "")
        super().__init__(f"{prefix!r} starts several of your {noun}s ({listed}): give more of the id")


class IntegrityError(APIError):
    """A downloaded result or shard is not what the worker stored: its sha256 (or size) differs from the one the
    worker recorded (the API's job or shard JSON, or the download's ``Digest`` header). The object was changed in
    the store, or on its way; nothing of it was loaded or kept."""

    def __init__(self, what: str, expected: str, actual: str) -> None:
        self.what, self.expected, self.actual = what, expected, actual
        super().__init__(502, f"{what} does not match what the worker stored: got {actual}, expected {expected}")


_BY_STATUS: dict[int, type[APIError]] = {
    401: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLargeError,
    429: TooManyJobsError,
}


def api_error(status_code: int, detail: Any, *, method: str = "", url: str = "") -> APIError:
    cls = _BY_STATUS.get(status_code, APIError)
    if status_code == 400 and method == "POST" and url.rstrip("/").endswith("/v1/jobs"):
        cls = UnknownModelError
    return cls(status_code, detail, method=method, url=url)


def format_detail(detail: Any) -> str:
    """FastAPI's ``detail``: a string, or for 422 a list of ``{"loc": [...], "msg": ...}``."""
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if isinstance(item, dict):
                loc = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
                parts.append(f"{loc}: {item.get('msg', item)}" if loc else str(item.get("msg", item)))
            else:
                parts.append(str(item))
        return "; ".join(parts)
    return str(detail)


class JobFailed(NNqueueError, RuntimeError):
    """The job ended FAILED: the worker's error type, message and traceback, as nnsight re-raises them."""

    def __init__(self, job: Followed | None, type_name: str, message: str, traceback: str = "") -> None:
        self.job = job
        self.type_name = type_name
        self.error_message = message
        self.traceback = traceback
        # What the trace saved before it failed (its other invokes' values), when the job has a result.
        self.saves: dict[str, Any] | None = None
        lines = [f"{type_name}: {message}"]
        if traceback:
            lines += ["", "Intervention traceback:", traceback.rstrip()]
        super().__init__("\n".join(lines))

    def __str__(self) -> str:  # not a built-in base's (KeyError quotes its message)
        return str(self.args[0]) if self.args else ""

    @classmethod
    def from_job(cls, job: Followed) -> JobFailed:
        error = job.info.get("error") or {}
        type_name = error.get("type") or "JobFailed"
        arguments = (
            job,
            type_name,
            error.get("message") or f"job {job.id} failed without an error message",
            error.get("traceback") or "",
        )
        try:
            return failure_class(type_name)(*arguments)
        except TypeError:  # a built-in whose constructor takes other arguments
            return cls(*arguments)


@functools.cache
def failure_class(type_name: str) -> type[JobFailed]:
    """JobFailed, also an instance of the built-in exception ``type_name`` when there is one, or of vLLM's
    error class of that name (``vllm.exceptions``, whose instances then read as their message alone)."""
    namespace: dict[str, Any] = {"__module__": __name__}
    original = getattr(builtins, type_name, None)
    if original is None and (original := _vllm_error(type_name)) is not None:
        # Attributes vLLM's constructor would set (not run here), and vLLM's reading of the error.
        namespace.update(parameter=None, value=None, __str__=lambda self: self.error_message)
    if not isinstance(original, type) or not issubclass(original, Exception) or issubclass(JobFailed, original):
        return JobFailed
    try:
        return type(f"JobFailed[{type_name}]", (JobFailed, original), namespace)
    except TypeError:  # an incompatible layout
        return JobFailed


def _vllm_error(type_name: str) -> type[BaseException] | None:
    """vLLM's exception class ``type_name`` (``vllm.exceptions``), if vLLM is installed and has it."""
    if not type_name.startswith("VLLM"):
        return None
    try:
        from vllm import exceptions
    except ImportError:
        return None
    found = getattr(exceptions, type_name, None)
    return found if isinstance(found, type) and issubclass(found, exceptions.VLLMError) else None


class JobCancelled(NNqueueError):
    """The job ended CANCELLED, so it has no result."""

    def __init__(self, job: Followed) -> None:
        self.job = job
        super().__init__(f"job {job.id} was cancelled")


class WaitTimeout(NNqueueError, TimeoutError):
    """``Job.wait(timeout=...)`` (or ``Harvest.wait``) gave up; the job itself goes on (cancel it to stop it)."""

    def __init__(self, job: Followed, timeout: float) -> None:
        self.job = job
        super().__init__(f"job {job.id} still {job.info.get('status')} after waiting {timeout:g} s")


class HarvestFailed(NNqueueError):
    """The harvest FAILED (the message names the chunk and the cause) or was CANCELLED; ``info`` is its state."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info
        error = info.get("error") or {}
        why = f": {error.get('type')}: {error.get('message')}" if error else ""
        super().__init__(f"harvest {info.get('id')} {info.get('status')}{why}")


class SteeringFailed(NNqueueError):
    """The steering job FAILED (the engine's or vLLM's refusal) or was CANCELLED; ``info`` is its state."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info
        error = info.get("error") or {}
        why = f": {error.get('type')}: {error.get('message')}" if error else ""
        super().__init__(f"steering job {info.get('id')} {info.get('status')}{why}")
