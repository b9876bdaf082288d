"""Sinks: the engine writes an object to a presigned S3 URL (no credentials) or a handoff file, with its digest;
streamed objects (harvest shards) also as a presigned multipart upload."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import urllib.parse
import uuid
from pathlib import Path

import pytest

from nnqueue.enginecore import sink
from nnqueue.settings import S3Settings
from nnqueue.storage.s3 import S3ObjectStore
from tests.utils.outage import Outage

MiB = 1 << 20


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


def test_a_presigned_put_rides_out_an_object_store_outage(s3_settings: S3Settings) -> None:
    endpoint = urllib.parse.urlsplit(s3_settings.endpoint_url)
    with Outage((endpoint.hostname or "127.0.0.1", endpoint.port or 80)) as outage:
        store = S3ObjectStore(
            s3_settings.model_copy(update={"bucket": f"sink-{uuid.uuid4().hex[:8]}", "endpoint_url": outage.url})
        )
        key = "results/job/1/saves.pt"
        target = {"kind": "presigned_put", "url": store.presigned_put_url(key, 60)}
        data = os.urandom(1 << 20)
        path = staged(target, data)
        outage.cut()
        delivered: list[sink.Written] = []
        upload = threading.Thread(target=lambda: delivered.append(sink.deliver(target, path)))
        upload.start()
        time.sleep(3)  # several attempts fail meanwhile
        outage.restore()
        upload.join(timeout=30)
        assert outage.refused >= 3 and delivered and delivered[0].size == len(data)
        assert store.get_bytes(key) == data


@pytest.mark.parametrize(
    "description",
    [None, {"kind": "handoff", "path": "relative/path"}, {"kind": "ftp", "url": "ftp://x"}, {"kind": "presigned_put"}],
)
def test_only_sink_descriptions_are_written_to(description: object) -> None:
    with pytest.raises(sink.SinkError, match="not a sink description"):
        sink.check(description)


def pieces(data: bytes, size: int) -> list[memoryview]:
    view = memoryview(data)
    return [view[start : start + size] for start in range(0, len(data), size)]


@pytest.fixture(scope="module")
def data() -> bytes:
    return os.urandom(11 * MiB + 123)


@pytest.fixture
def store(s3_settings: S3Settings) -> S3ObjectStore:
    return S3ObjectStore(s3_settings.model_copy(update={"bucket": f"sink-{uuid.uuid4().hex[:8]}"}))


def test_a_stream_to_a_handoff_file_is_hashed_and_renamed_whole(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "shard.safetensors"
    written = sink.write_stream({"kind": "handoff", "path": str(path)}, len(data), pieces(data, 3 * MiB + 1))
    assert (written.size, written.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert path.read_bytes() == data

    def failing():  # a failed write leaves neither the file nor its staging file behind
        yield b"abc"
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError):
        sink.write_stream({"kind": "handoff", "path": str(tmp_path / "failed")}, 3, failing())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.safetensors"]


def test_a_stream_to_a_presigned_put(store: S3ObjectStore, data: bytes) -> None:
    key = "harvests/h/shard-00000.safetensors"
    target = {"kind": "presigned_put", "url": store.presigned_put_url(key, 60)}
    written = sink.write_stream(target, len(data), pieces(data, MiB))
    assert written.sha256 == hashlib.sha256(data).hexdigest() and store.get_bytes(key) == data


def test_a_stream_to_a_presigned_multipart_upload(store: S3ObjectStore, data: bytes) -> None:
    key = "harvests/h/shard-00001.safetensors"
    upload = store.presigned_multipart(key, 5, 60)  # more URLs than parts: the frontend presigns an upper bound
    urls = upload.urls
    description = {"kind": "multipart", "part_size": 5 * MiB, "urls": urls}
    written = sink.write_stream(description, len(data), pieces(data, 2 * MiB + 7))
    assert [part["part_number"] for part in written.parts] == [1, 2, 3]
    store.complete_multipart(upload, [part["etag"] for part in written.parts])
    assert store.get_bytes(key) == data

    with pytest.raises(sink.SinkError, match="need 3 parts"):
        sink.write_stream({**description, "urls": urls[:2]}, len(data), pieces(data, MiB))
