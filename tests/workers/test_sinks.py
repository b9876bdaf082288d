"""Result and shard sinks on the worker's side: where each store lets the engine write, and committing what it
wrote (a shard: a handoff file on the local store, a presigned multipart upload on S3)."""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from typing import Any

import pytest

from nnqueue.enginecore import sink
from nnqueue.settings import S3Settings
from nnqueue.storage.local import LocalObjectStore
from nnqueue.storage.s3 import S3ObjectStore
from nnqueue.workers.sinks import MAX_SHARD_PARTS, MIN_PART_BYTES, ResultNotWritten, ResultSinks

JOB = uuid.UUID("12345678-1234-5678-1234-567812345678")
MiB = 1 << 20


def write(spec: dict[str, str], data: bytes) -> int:
    staged = sink.staging_file(spec)
    Path(staged).write_bytes(data)
    return sink.deliver(spec, staged).size


def test_a_local_store_gets_handed_off_files_moved_in(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    sinks = ResultSinks(store, tmp_path / "objects" / ".handoff")
    opened = sinks.open(JOB, 2, timeout_s=60)
    assert {spec["kind"] for spec in opened.specs.values()} == {"handoff"}
    size = write(opened.specs["torch"], b"torch bytes")

    stored = sinks.commit(opened, {"torch": size})
    assert (stored.key, stored.size, stored.format) == (f"results/{JOB}/2/saves.pt", 11, "torch")
    assert store.get_bytes(stored.key) == b"torch bytes" and not Path(opened.specs["torch"]["path"]).exists()


def test_a_wrong_size_or_a_missing_object_is_not_committed(tmp_path: Path) -> None:
    sinks = ResultSinks(LocalObjectStore(tmp_path / "objects"), tmp_path / "handoff")
    opened = sinks.open(JOB, 1, timeout_s=60)
    write(opened.specs["torch"], b"12345")
    with pytest.raises(ResultNotWritten, match="handed off with 5 bytes, reported 6"):
        sinks.commit(opened, {"torch": 6})
    with pytest.raises(ResultNotWritten, match=r"no saves\.pt"):
        sinks.commit(opened, {})
    sinks.discard(opened)
    assert not any((tmp_path / "handoff").rglob("*.pt"))


def test_an_s3_store_hands_out_presigned_urls_and_checks_the_upload(s3_settings: S3Settings) -> None:
    store = S3ObjectStore(s3_settings.model_copy(update={"bucket": f"sinks-{uuid.uuid4().hex[:8]}"}))
    sinks = ResultSinks(store, Path("/nonexistent"))
    opened = sinks.open(JOB, 1, timeout_s=60)
    assert {spec["kind"] for spec in opened.specs.values()} == {"presigned_put"}
    assert "X-Amz-Expires=660" in opened.specs["torch"]["url"]  # the job's timeout and a margin
    sizes = {name: write(opened.specs[name], data) for name, data in (("torch", b"pt"), ("safetensors", b"st!"))}

    stored = sinks.commit(opened, sizes)
    assert stored.format == "torch+safetensors" and store.get_bytes(f"results/{JOB}/1/saves.safetensors") == b"st!"
    with pytest.raises(ResultNotWritten, match="has 2 bytes, reported 3"):
        sinks.commit(opened, {"torch": 3})


def stream(spec: dict[str, Any], data: bytes) -> sink.Written:
    """What the engine's shard writer does with a shard's bytes."""
    return sink.write_stream(spec, len(data), (data[i : i + MiB] for i in range(0, len(data), MiB)))


def test_a_shard_is_handed_off_on_a_local_store_and_moved_in(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    sinks = ResultSinks(store, tmp_path / "objects" / ".handoff")
    opened = sinks.open_shard("harvests/h/shard-00000.safetensors", "h-00000-1.safetensors", 10 * MiB, 600)
    assert opened.spec["kind"] == "handoff" and opened.upload is None
    written = stream(opened.spec, b"shard bytes")
    with pytest.raises(ResultNotWritten, match="handed off with 11 bytes, reported 12"):
        sinks.commit_shard(opened, 12, [])
    sinks.commit_shard(opened, written.size, [])
    assert store.get_bytes(opened.key) == b"shard bytes" and not Path(opened.spec["path"]).exists()

    dropped = sinks.open_shard("harvests/h/shard-00001.safetensors", "h-00001-1.safetensors", MiB, 600)
    stream(dropped.spec, b"abandoned")
    sinks.discard_shard(dropped)
    assert not Path(dropped.spec["path"]).exists() and not store.exists(dropped.key)


def test_a_shard_is_a_presigned_multipart_upload_on_s3_completed_from_its_etags(s3_settings: S3Settings) -> None:
    store = S3ObjectStore(s3_settings.model_copy(update={"bucket": f"sinks-{uuid.uuid4().hex[:8]}"}))
    sinks = ResultSinks(store, Path("/nonexistent"))
    # A bound of 20 MiB in parts of at least 8 MiB: three part URLs; the shard turns out to need two.
    opened = sinks.open_shard("harvests/h/shard-00000.safetensors", "unused", 20 * MiB, 600)
    assert opened.spec["kind"] == "multipart" and opened.spec["part_size"] == MIN_PART_BYTES
    assert len(opened.spec["urls"]) == 3 and opened.upload is not None
    data = random.Random(0).randbytes(9 * MiB + 7)
    written = stream(opened.spec, data)
    assert [part["part_number"] for part in written.parts] == [1, 2]
    with pytest.raises(ResultNotWritten, match=f"has {len(data)} bytes, reported {len(data) + 1}"):
        sinks.commit_shard(opened, len(data) + 1, [part["etag"] for part in written.parts])
    assert store.get_bytes(opened.key) == data  # completed, then found wrong: the record is refused

    big = sinks.open_shard("harvests/h/shard-00001.safetensors", "unused", 100 * 1024 * MiB, 600)
    assert len(big.spec["urls"]) == MAX_SHARD_PARTS and big.spec["part_size"] >= 100 * MiB
    sinks.discard_shard(big)  # aborted: nothing is left of it
    assert not store.exists(big.key)
    assert store._client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []
