"""Result sinks on the worker's side: where each store lets the engine write, and committing what it wrote."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from nnqueue.enginecore import sink
from nnqueue.settings import S3Settings
from nnqueue.storage.local import LocalObjectStore
from nnqueue.storage.s3 import S3ObjectStore
from nnqueue.workers.sinks import ResultNotWritten, ResultSinks

JOB = uuid.UUID("12345678-1234-5678-1234-567812345678")


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
