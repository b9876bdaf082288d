"""A submitted resource the client follows by its API path: a harvest or a steering job.

Both are answered by the API under ``/v1/<collection>/{id}`` with the same status fields and cancelled by
``POST .../cancel``, so their handles share one reading of ``info`` and one way to refresh and cancel; each
subclass adds how it waits and what its results are. (:class:`~nnqueue.client.job.Job` predates this and keeps
its own surface: ``status()`` there asks the API.)
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

from nnqueue.client.transport import Transport
from nnqueue.client.waiting import TERMINAL


class Resource:
    """``info`` is the API's last answer about it; `refresh` updates it. ``PATH`` is its collection's path."""

    PATH: ClassVar[str]

    def __init__(self, transport: Transport, info: dict[str, Any]) -> None:
        self.transport, self.info = transport, info

    @property
    def id(self) -> str:
        return str(self.info["id"])

    @property
    def status(self) -> str:
        return str(self.info.get("status"))

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.status} model={self.info.get('model_key')!r}>"

    def refresh(self) -> Self:
        self.info = self.transport.get_json(f"{self.PATH}/{self.id}")
        return self

    def cancel(self) -> Self:
        """Cancel it: queued work never runs, running work is aborted."""
        self.info = self.transport.request("POST", f"{self.PATH}/{self.id}/cancel").json()
        return self
