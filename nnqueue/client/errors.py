"""What the client raises: HTTP failures (with the API's status and detail) and job outcomes.

A job that FAILED on the worker raises an instance of the worker's error class, with nothing else of Python's
added (the nnqueue backend, for a vLLM model, raises it as a local vLLM run does instead: `failure_class`): an ``IndexError`` in intervention code raises an ``IndexError`` here, a ``VLLMValidationError`` (vLLM's
refusal of a prompt longer than ``max_model_len``) a ``VLLMValidationError``, nnsight's ``OutOfOrderError`` that
class. It reads as the worker's message alone, as the error does where it was raised; the job's id and the
worker-side traceback are its notes (shown under the traceback) and its attributes. The class is a subclass made
here of the worker's class and of :class:`JobFailed`, so ``except JobFailed`` catches every failed job. The worker
sends only the class's name, which the client looks up in a fixed list of modules (`failure_class`); where it is
not found there (nnqueue's own failures: ``InterventionStalled``, ``EngineCrash``, ...) the error is
:class:`JobFailed` itself, whose message has the shape of nnsight's ``raise_deferred``: ``"<Type>: <message>"``,
then the traceback under ``Intervention traceback:``. Code that wants the parts reads ``type_name``,
``error_message`` and ``traceback``; ``saves`` holds what the trace's other invokes saved.
"""

from __future__ import annotations

import functools
import importlib
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


class JobFailed(NNqueueError):
    """The job ended FAILED: the worker's error type, message and traceback.

    What the client raises is an instance of the worker's error class where this process can name it (see
    `failure_class`), and of this class too; where it cannot, this class itself, whose message has the shape of
    nnsight's ``raise_deferred`` (``"<Type>: <message>"`` and the worker-side traceback)."""

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

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    @classmethod
    def from_job(cls, job: Followed, *, deferred: bool = False) -> JobFailed:
        """The error for ``job``, which FAILED. ``deferred``: as a local vLLM run raises it, where nnsight re-raises
        the engine's errors with ``raise_deferred`` (a ``RuntimeError``) but vLLM's own as they are
        (`failure_class`)."""
        error = job.info.get("error") or {}
        type_name = error.get("type") or "JobFailed"
        message = error.get("message") or f"job {job.id} failed without an error message"
        traceback = error.get("traceback") or ""
        raised = failure_class(type_name, deferred)
        try:
            # The worker's class is not constructed with its own arguments (which it may not take as a message):
            # only made, as BaseException.__new__ makes any, then filled in as a JobFailed.
            failure: JobFailed = raised.__new__(raised, message)
            JobFailed.__init__(failure, job, type_name, message, traceback)
        except TypeError:  # a class whose __new__ checks its arguments (ExceptionGroup)
            failure = (DeferredJobFailed if deferred else JobFailed)(job, type_name, message, traceback)
        failure.add_note(f"job {job.id} failed on the worker")
        if traceback and type(failure).__str__ is not JobFailed.__str__:  # a message without the traceback
            failure.add_note("Intervention traceback:\n" + traceback.rstrip())
        return failure


class DeferredJobFailed(JobFailed, RuntimeError):
    """A failed vLLM trace whose error class this process cannot name, from the nnqueue backend: a
    ``RuntimeError``, as nnsight's ``raise_deferred`` raises an engine's error in a local run."""


# Where the client looks for the worker's error class by its name (the worker sends only the name): Python's
# built-ins, then nnsight's modules that define the errors a trace raises, then vLLM's (`vllm.exceptions`, only for
# a name starting with ``VLLM``: importing vLLM takes seconds). A fixed list: no module the server names is imported.
NNSIGHT_ERROR_MODULES = (
    "nnsight.intervention.interleaver",
    "nnsight.intervention.serialization",
    "nnsight.intervention.source",
    "nnsight.tracing.tracer",
)


@functools.cache
def failure_class(type_name: str, deferred: bool = False) -> type[JobFailed]:
    """What a job that failed with ``type_name`` raises here: a subclass of the worker's error class and of
    :class:`JobFailed`, reading as the worker's message alone; JobFailed itself where that class is not found
    (`find_error_class`), is not an ``Exception`` (``KeyboardInterrupt``), is one JobFailed already is
    (``Exception``), or cannot be mixed.

    ``deferred`` (the nnqueue backend, for a vLLM model): a local run raises vLLM's own errors
    (``vllm.exceptions``) as they are, and every other error of the engine as nnsight's ``raise_deferred`` does,
    a ``RuntimeError`` reading ``"<Type>: <message>"`` and the traceback. So every other error is a
    :class:`DeferredJobFailed` that reads so, and is also an instance of the worker's class where there is one:
    the one class a local vLLM run lacks, kept so that ``except IndexError`` works as it does through the
    Client API and for other models."""
    original = find_error_class(type_name)
    namespace: dict[str, Any]
    if deferred and (original is None or original.__module__ != "vllm.exceptions"):
        if original is None or issubclass(DeferredJobFailed, original):
            return DeferredJobFailed
        namespace = {"__module__": __name__, "__str__": JobFailed.__str__}  # not the worker's class's (KeyError's)
        return _mixed(f"JobFailed[{type_name}]", (original, DeferredJobFailed), namespace, DeferredJobFailed)
    if original is None or issubclass(JobFailed, original):
        return JobFailed
    namespace = {
        # Named as the worker's class, so that a traceback reads as the worker's does.
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
        # As the worker's error reads (a KeyError's message arrives quoted already); the notes carry the rest.
        "__str__": lambda self: self.error_message,
    }
    if original.__module__ == "vllm.exceptions":
        namespace.update(parameter=None, value=None)  # what vLLM's constructor would set (not run here)
    return _mixed(type_name, (original, JobFailed), namespace, JobFailed)


def _mixed(name: str, bases: tuple[type, ...], namespace: dict[str, Any], fallback: type[JobFailed]) -> type[JobFailed]:
    """The class ``name`` of ``bases``, or ``fallback`` where they cannot make one."""
    try:
        return type(name, bases, namespace)
    except TypeError:  # an incompatible layout
        return fallback


def find_error_class(type_name: str) -> type[Exception] | None:
    """The ``Exception`` class named ``type_name`` in the modules the client looks in (``NNSIGHT_ERROR_MODULES``),
    defined there; None if none has it or the module is not installed."""
    if not type_name.isidentifier():
        return None
    places = ["builtins", *NNSIGHT_ERROR_MODULES]
    if type_name.startswith("VLLM"):
        places.append("vllm.exceptions")
    for place in places:
        try:
            module = importlib.import_module(place)
        except ImportError:
            continue
        found = getattr(module, type_name, None)
        if isinstance(found, type) and issubclass(found, Exception) and found.__module__ == place:
            return found
    return None


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
