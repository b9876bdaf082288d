"""Objects streamed through the API: for stores that cannot presign URLs (the local store), ``?inline=1``
downloads, and the results nnsight's clients fetch. Shared by the job, harvest and nnsight routers.

Where the worker recorded an object's sha256 (results, shards), its answers carry it, streamed or redirected:
``Digest: sha-256=<base64>`` (RFC 3230) and ``Repr-Digest: sha-256=:<base64>:`` (RFC 9530), and a streamed
object's ``ETag`` is its hex sha256. A client checks the bytes it got against it (the job's or shard's JSON has
the same value), so an object changed in the store after the worker stored it is detected."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

from fastapi import HTTPException, status
from fastapi.responses import RedirectResponse, StreamingResponse

from nnqueue.storage.object_store import ObjectNotFound, ObjectStore, PresignUnsupported

STREAM_CHUNK = 1 << 20


def digest_headers(sha256: str | None) -> dict[str, str]:
    """The headers that name an object's recorded sha256 (hex), or none for an object recorded without one."""
    if not sha256:
        return {}
    encoded = base64.b64encode(bytes.fromhex(sha256)).decode()
    return {"Digest": f"sha-256={encoded}", "Repr-Digest": f"sha-256=:{encoded}:"}


def object_response(
    store: ObjectStore,
    key: str,
    expiry_s: int,
    *,
    filename: str,
    sha256: str | None,
    inline: bool,
    what: str = "the result",
) -> StreamingResponse | RedirectResponse:
    """A redirect to the object's presigned URL (valid ``expiry_s``) with its digest headers, or its bytes
    (`stream_object`) when ``inline`` or the store cannot presign (a local store)."""
    if not inline:
        try:
            url = store.presigned_get_url(key, expiry_s)
            return RedirectResponse(url, status_code=status.HTTP_302_FOUND, headers=digest_headers(sha256))
        except PresignUnsupported:
            pass
    return stream_object(store, key, filename=filename, what=what, sha256=sha256)


def stream_object(
    store: ObjectStore, key: str, filename: str, what: str = "the result", sha256: str | None = None
) -> StreamingResponse:
    """The object's bytes as an attachment named ``filename``, with its recorded ``sha256`` (hex) in ``Digest``
    and ``ETag``; 410 when it is no longer in the store."""
    try:
        size = store.size(key)
        reader = store.open_stream(key)
    except ObjectNotFound:
        raise HTTPException(status.HTTP_410_GONE, f"{what} is no longer in the object store") from None
    return StreamingResponse(
        read_chunks(reader),
        media_type="application/octet-stream",
        headers={
            "Content-Length": str(size),
            "Content-Disposition": f'attachment; filename="{filename}"',
            **digest_headers(sha256),
            **({"ETag": f'"{sha256}"'} if sha256 else {}),
        },
    )


def read_chunks(reader: Any) -> Iterator[bytes]:
    """``reader``'s bytes a chunk at a time (a store's stream, or any readable context manager), closed at the end."""
    with reader:
        while chunk := reader.read(STREAM_CHUNK):
            yield chunk
