"""Sinks: the engine writes an object to a presigned S3 URL (no credentials) or a handoff file, with its digest."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import pytest

from nnqueue.enginecore import sink
from nnqueue.settings import S3Settings
from nnqueue.storage.s3 import S3ObjectStore


def staged(target: dict[str, str], data: bytes) -> str:
    path = sink.staging_file(target)
    Path(path).write_bytes(data)
    return path


def test_a_handoff_sink_gets_the_whole_file_and_its_digest(tmp_path: Path) -> None:
    target = {"kind": "handoff", "path": str(tmp_path / "saves.pt")}
    data = os.urandom(3 << 20)
    path = staged(target, data)
    assert Path(path).parent == tmp_path  # beside the target: delivering is a rename
    written = sink.deliver(target, path)
    assert (tmp_path / "saves.pt").read_bytes() == data and not os.path.exists(path)
    assert (written.size, written.sha256) == (len(data), hashlib.sha256(data).hexdigest())


def test_a_presigned_put_uploads_without_credentials(s3_settings: S3Settings) -> None:
    store = S3ObjectStore(s3_settings.model_copy(update={"bucket": f"sink-{uuid.uuid4().hex[:8]}"}))
    key = "results/job/1/saves.pt"
    target = {"kind": "presigned_put", "url": store.presigned_put_url(key, 60)}
    data = os.urandom(3 << 20)
    path = staged(target, data)
    written = sink.deliver(target, path)
    assert store.get_bytes(key) == data and written.size == len(data) and not os.path.exists(path)

    tampered = {"kind": "presigned_put", "url": target["url"].replace("X-Amz-Signature=", "X-Amz-Signature=0")}
    with pytest.raises(sink.SinkError, match="refused the upload: HTTP 403"):
        sink.deliver(tampered, staged(tampered, b"not mine"))
    assert store.get_bytes(key) == data


@pytest.mark.parametrize(
    "description",
    [None, {"kind": "handoff", "path": "relative/path"}, {"kind": "ftp", "url": "ftp://x"}, {"kind": "presigned_put"}],
)
def test_only_sink_descriptions_are_written_to(description: object) -> None:
    with pytest.raises(sink.SinkError, match="not a sink description"):
        sink.check(description)
