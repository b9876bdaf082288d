"""How the API answers a submission it refuses: one mapping, for every route that submits a trace (``/v1/jobs``,
nnsight's ``remote=True`` and ``serve=`` routes), from the refusals of admission
(:mod:`nnqueue.scheduler.admission`, :mod:`nnqueue.scheduler.crash_cooldown`) and of nnsight's protocol
(:mod:`nnqueue.api.nnsight_protocol`) to an HTTP status with the refusal's message as its detail.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import HTTPException, status

from nnqueue.api import nnsight_protocol as protocol
from nnqueue.errors import NNqueueError
from nnqueue.scheduler.admission import ModelNotServed, TooManyJobsInFlight
from nnqueue.scheduler.crash_cooldown import CrashCooldown
from nnqueue.scheduler.weights import WeightsRejected

# Most specific first: a PayloadTooLarge and a SessionTaken are ProtocolErrors too.
STATUSES: tuple[tuple[type[NNqueueError], int], ...] = (
    (protocol.PayloadTooLarge, status.HTTP_413_CONTENT_TOO_LARGE),
    (protocol.SessionTaken, status.HTTP_409_CONFLICT),
    (CrashCooldown, status.HTTP_429_TOO_MANY_REQUESTS),
    (TooManyJobsInFlight, status.HTTP_429_TOO_MANY_REQUESTS),
    (ModelNotServed, status.HTTP_400_BAD_REQUEST),
    (WeightsRejected, status.HTTP_400_BAD_REQUEST),  # its own status, below
    (protocol.ProtocolError, status.HTTP_400_BAD_REQUEST),
)
REFUSALS = tuple(kind for kind, _ in STATUSES)


def http_refusal(refused: NNqueueError) -> HTTPException:
    """The HTTP answer to ``refused`` (one of :data:`REFUSALS`); a cool-down also says when to retry."""
    code = next(code for kind, code in STATUSES if isinstance(refused, kind))
    if isinstance(refused, WeightsRejected):
        code = refused.status
    headers = None
    if isinstance(refused, CrashCooldown):
        headers = {"Retry-After": str(max(1, math.ceil(refused.retry_after_s)))}
    return HTTPException(code, str(refused), headers=headers)


@contextmanager
def refusals_as_http() -> Iterator[None]:
    """Raise each refusal of the block as its HTTP answer (:func:`http_refusal`)."""
    try:
        yield
    except REFUSALS as refused:
        raise http_refusal(refused) from None
