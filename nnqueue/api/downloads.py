"""Objects streamed through the API: for stores that cannot presign URLs (the local store), ``?inline=1``
downloads, and the results nnsight's clients fetch. Shared by the job, harvest and nnsight routers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import HTTPException, status
from fastapi.responses import StreamingResponse

from nnqueue.storage.object_store import ObjectNotFound, ObjectStore

STREAM_CHUNK = 1 << 20


def stream_object(store: ObjectStore, key: str, filename: str, what: str = "the result") -> StreamingResponse:
    """The object's bytes as an attachment named ``filename``; 410 when it is no longer in the store."""
    try:
        size = store.size(key)
        reader = store.open_stream(key)
    except ObjectNotFound:
        raise HTTPException(status.HTTP_410_GONE, f"{what} is no longer in the object store") from None
    return StreamingResponse(
        read_chunks(reader),
        media_type="application/octet-stream",
        headers={"Content-Length": str(size), "Content-Disposition": f'attachment; filename="{filename}"'},
    )


def read_chunks(reader: Any) -> Iterator[bytes]:
    """``reader``'s bytes a chunk at a time (a store's stream, or any readable context manager), closed at the end."""
    with reader:
        while chunk := reader.read(STREAM_CHUNK):
            yield chunk
