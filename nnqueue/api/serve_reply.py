"""nnsight-serve's reply, ``torch.save({"saves": saves, "error": error})``, built without torch or unpickling.

A ``serve=`` client ``torch.load``s the reply and re-raises ``error`` (nnsight's ``DeferredError`` dict). The
job's saves are already ``torch.save({name: value})`` in the store (``saves.pt``, written by the engine), and
this process holds secrets, so it must not load them. Instead the reply is assembled around them:
``torch.save`` writes a zip whose ``<archive>/data.pkl`` is a protocol-2 pickle of the object (tensors are
persistent ids naming the zip's ``<archive>/data/<n>`` records). The reply is the same zip with a new
``data.pkl``: a dict whose ``"saves"`` value is the old pickle's opcodes verbatim and whose ``"error"`` value is
pickled here without a memo, so the old pickle's memo indices stay its own. Every other record is copied.

torch internals relied on (2.x): ``torch.save``'s zip layout (one top-level folder, ``data.pkl``, ``version``,
``byteorder``, ``data/<n>``) and its default pickle protocol 2 (no FRAME opcodes); ``torch.load`` of a zip
finds ``data.pkl`` under the first record's folder.
"""

from __future__ import annotations

import io
import pickle
import shutil
import tempfile
import zipfile
from typing import IO, Any

from nnqueue.errors import NNqueueError
from nnqueue.storage.object_store import ObjectStore

PROTOCOL_2 = b"\x80\x02"
STOP = b"."
SPOOL_BYTES = 64 << 20


class UnexpectedResult(NNqueueError):
    """The stored result is not a ``torch.save`` zip of a protocol-2 pickle."""


def serve_reply(store: ObjectStore, result_key: str | None, error: dict[str, Any] | None) -> IO[bytes]:
    """The reply's bytes in a file positioned at 0: the saves of ``result_key`` (none when None) and ``error``."""
    reply = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115 - returned open; the caller closes it
    if result_key is None:
        _write(reply, "archive", b"}", error, None)
    else:
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as saved:
            with store.open_stream(result_key) as stream:
                shutil.copyfileobj(stream, saved)
            saved.seek(0)
            try:
                archive = zipfile.ZipFile(saved)
            except zipfile.BadZipFile:
                raise UnexpectedResult("the stored result is not a torch.save zip") from None
            with archive:
                folder = archive.namelist()[0].split("/", 1)[0]
                inner = archive.read(f"{folder}/data.pkl")
                if not (inner.startswith(PROTOCOL_2) and inner.endswith(STOP)):
                    raise UnexpectedResult("the stored result's data.pkl is not a protocol-2 pickle")
                _write(reply, folder, inner[len(PROTOCOL_2) : -len(STOP)], error, archive)
    reply.seek(0)
    return reply


def _write(reply: IO[bytes], folder: str, saves_opcodes: bytes, error: Any, source: zipfile.ZipFile | None) -> None:
    wrapper = PROTOCOL_2 + b"}(" + _text("saves") + saves_opcodes + _text("error") + _memoless(error) + b"u" + STOP
    with zipfile.ZipFile(reply, "w", zipfile.ZIP_STORED, allowZip64=True) as out:
        out.writestr(f"{folder}/data.pkl", wrapper)
        if source is None:
            out.writestr(f"{folder}/byteorder", "little")
            out.writestr(f"{folder}/version", "3\n")
            return
        for name in source.namelist():
            if name == f"{folder}/data.pkl":
                continue
            with source.open(name) as record, out.open(zipfile.ZipInfo(name), "w", force_zip64=True) as copy:
                shutil.copyfileobj(record, copy)


def _text(value: str) -> bytes:
    """BINUNICODE: a str in any protocol >= 1."""
    encoded = value.encode()
    return b"X" + len(encoded).to_bytes(4, "little") + encoded


def _memoless(value: Any) -> bytes:
    """``value``'s pickle opcodes (protocol 2, no PROTO, no STOP) without memo writes."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=2)
    pickler.fast = True  # no memo: nothing can clash with the saves' memo indices
    pickler.dump(value)
    return buffer.getvalue()[len(PROTOCOL_2) : -len(STOP)]
