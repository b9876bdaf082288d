"""The request-body limit: uploads larger than a payload may be are cut off while they stream in.

A submission's body is read before the route runs (:mod:`nnqueue.api.job_body`): a multipart form spooling its
file parts to disk, a raw payload into memory; without this limit a client could fill the disk, or the memory,
with one request. The payload's exact size is then checked against ``NNQUEUE_MAX_PAYLOAD_BYTES``.
"""

from __future__ import annotations

from fastapi import HTTPException, status
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Room in a request body for the multipart framing and the spec field (which Starlette caps at 1 MiB).
FORM_OVERHEAD_BYTES = 2 * 1024 * 1024


class BodySizeLimit:
    """Refuses request bodies that cannot fit a payload of ``max_payload_bytes`` with 413: at once
    when Content-Length says so, otherwise as soon as too many bytes have streamed in, so an upload
    is never buffered or spooled to disk far past the limit."""

    def __init__(self, app: ASGIApp, max_payload_bytes: int) -> None:
        self.app, self.max_payload_bytes = app, max_payload_bytes
        self.max_bytes = max_payload_bytes + FORM_OVERHEAD_BYTES

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await JSONResponse({"detail": self._detail()}, status.HTTP_413_CONTENT_TOO_LARGE)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                # Raised inside the route's body parsing; FastAPI passes HTTPExceptions through.
                raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, self._detail())
            return message

        await self.app(scope, limited_receive, send)

    def _detail(self) -> str:
        return payload_too_large(self.max_payload_bytes)


def payload_too_large(limit: int) -> str:
    return f"payload too large: the limit is {limit} bytes (NNQUEUE_MAX_PAYLOAD_BYTES)"
