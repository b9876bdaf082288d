"""The body of ``POST /v1/jobs``: the trace's payload and the job's spec, in either of two shapes.

* ``application/octet-stream``: the payload is the body, the spec (JSON, ASCII: other characters escaped as
  ``\\uXXXX``) is the ``Nnqueue-Spec`` header. What the Python client sends: nothing around the payload to parse.
  A multipart form cost the API a sixth of a submission's CPU (the parser, a spooled file per upload).
* ``multipart/form-data``: a ``spec`` field and a ``payload`` file, as before; any other content type is read
  as a form too, and lacks both (422, as before).

Read on the event loop (:func:`read_submission` is an async dependency), before the route's thread starts. The
payload's size is checked here (413; :class:`nnqueue.api.limits.BodySizeLimit` has cut off a far larger body).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Header, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect

from nnqueue.api.deps import SettingsDep
from nnqueue.api.limits import payload_too_large

SPEC_HEADER = "Nnqueue-Spec"
RAW_CONTENT_TYPE = "application/octet-stream"
SPEC_DESCRIPTION = (
    'A JSON object: {"model_key": str, "kind": "trace", "priority": int = 0, "timeout_s": float | null '
    '(0 < t <= 86400; null: the server default), "metadata": object = {}, "client": {"nnsight": str, '
    '"python": str} | null}. Unknown fields are rejected.'
)
SPEC_HEADER_DESCRIPTION = (
    f"The job's spec when the body is the payload itself ({RAW_CONTENT_TYPE}), in ASCII (other characters escaped "
    f"as \\uXXXX). {SPEC_DESCRIPTION}"
)
PAYLOAD_DESCRIPTION = (
    "The trace: an nnqueue prebuilt trace (what the nnqueue client sends) or an nnsight serialized trace "
    "(RequestModel.serialize, optionally zstd-compressed)."
)


@dataclass(frozen=True)
class Submission:
    """A submission's spec (JSON text, not yet parsed) and payload, and where the spec came from (an error's loc)."""

    spec: str
    payload: bytes
    spec_loc: tuple[str, ...]


async def read_submission(
    request: Request,
    settings: SettingsDep,
    nnqueue_spec: Annotated[str | None, Header(description=SPEC_HEADER_DESCRIPTION)] = None,
) -> Submission:
    """The spec and payload of ``POST /v1/jobs``, from a raw body and its header or from a multipart form."""
    limit = settings.max_payload_bytes
    if request.headers.get("content-type", "").split(";")[0].strip().lower() == RAW_CONTENT_TYPE:
        spec_loc = ("header", SPEC_HEADER.lower())
        if nnqueue_spec is None:
            raise _invalid("missing", spec_loc, "Field required")
        if not nnqueue_spec.isascii():
            raise _invalid("value_error", spec_loc, "the spec must be ASCII: escape other characters as \\uXXXX")
        try:
            body = await request.body()
        except ClientDisconnect:
            raise HTTPException(status.HTTP_400_BAD_REQUEST, "the client left before its body was read") from None
        return Submission(nnqueue_spec, _within(body, limit), spec_loc)
    spec, payload = await _form_fields(request, limit)
    return Submission(spec, payload, ("body", "spec"))


async def _form_fields(request: Request, limit: int) -> tuple[str, bytes]:
    """The form's ``spec`` text and ``payload`` bytes (at most one byte past ``limit`` read); 422 naming each field
    that is missing or of the wrong kind, 400 for a body that is not a form (as FastAPI answered for them)."""
    try:
        form = await request.form()
    except HTTPException:
        raise
    except Exception as error:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "There was an error parsing the body") from error
    try:
        spec, payload = form.get("spec"), form.get("payload")
        errors = []
        if not isinstance(spec, str):
            kind, message = ("missing", "Field required") if spec is None else ("string_type", "Input should be text")
            errors.append(_error(kind, ("body", "spec"), message))
        if not isinstance(payload, UploadFile):
            kind, message = ("missing", "Field required") if payload is None else ("value_error", "Expected a file")
            errors.append(_error(kind, ("body", "payload"), message))
        if errors:
            raise RequestValidationError(errors)
        assert isinstance(spec, str) and isinstance(payload, UploadFile)
        return spec, _within(await payload.read(limit + 1), limit)
    finally:
        await form.close()


def _within(payload: bytes, limit: int) -> bytes:
    if len(payload) > limit:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, payload_too_large(limit))
    return payload


def _error(kind: str, loc: tuple[str, ...], message: str) -> dict[str, Any]:
    return {"type": kind, "loc": loc, "msg": message, "input": None}


def _invalid(kind: str, loc: tuple[str, ...], message: str) -> RequestValidationError:
    return RequestValidationError([_error(kind, loc, message)])


# The request body in the OpenAPI document: read by :func:`read_submission`, not declared as parameters.
OPENAPI_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            RAW_CONTENT_TYPE: {"schema": {"type": "string", "format": "binary", "description": PAYLOAD_DESCRIPTION}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["spec", "payload"],
                    "properties": {
                        "spec": {"type": "string", "description": SPEC_DESCRIPTION},
                        "payload": {"type": "string", "format": "binary", "description": PAYLOAD_DESCRIPTION},
                    },
                }
            },
        },
    }
}
