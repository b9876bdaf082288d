"""Result and shard sinks on the worker's side: the engine leaves files (results) or writes into a pipe
(shards); the worker uploads them itself, records the size and sha256 of what it uploaded, and hands the engine
nothing that reaches the store."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from nnqueue.enginecore import sink
from nnqueue.settings import S3Settings
from nnqueue.storage.local import LocalObjectStore
from nnqueue.storage.object_store import ObjectStore
from nnqueue.storage.s3 import S3ObjectStore
from nnqueue.workers.sinks import ResultNotWritten, ResultSinks

JOB = uuid.UUID("12345678-1234-5678-1234-567812345678")
MiB = 1 << 20


def write(spec: dict[str, str], data: bytes) -> int:
    staged = sink.staging_file(spec)
    Path(staged).write_bytes(data)
    return sink.deliver(spec, staged).size


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return LocalObjectStore(tmp_path / "objects")
    s3_settings: S3Settings = request.getfixturevalue("s3_settings")
    return S3ObjectStore(s3_settings.model_copy(update={"bucket": f"sinks-{uuid.uuid4().hex[:8]}"}))


def test_results_are_handed_off_as_files_and_uploaded_by_the_worker_with_their_digest(
    store: ObjectStore, tmp_path: Path
) -> None:
    sinks = ResultSinks(store, tmp_path / "handoff")
    opened = sinks.open(JOB, 2)
    assert {spec["kind"] for spec in opened.specs.values()} == {"handoff"}
    assert "http" not in repr(opened.specs)  # nothing the engine gets reaches the store
    sizes = {
        name: write(opened.specs[name], data) for name, data in (("torch", b"torch bytes"), ("safetensors", b"st"))
    }

    stored = sinks.commit(opened, sizes)
    assert (stored.key, stored.size, stored.format) == (f"results/{JOB}/2/saves.pt", 11, "torch+safetensors")
    assert stored.sha256 == hashlib.sha256(b"torch bytes").hexdigest()
    assert stored.safetensors is not None and stored.safetensors.sha256 == hashlib.sha256(b"st").hexdigest()
    assert store.get_bytes(stored.key) == b"torch bytes"
    assert not any(Path(spec["path"]).exists() for spec in opened.specs.values())

    # What the engine could do afterwards: write its handoff path again. The committed object is a copy.
    Path(opened.specs["torch"]["path"]).write_bytes(b"forged bytes")
    assert store.get_bytes(stored.key) == b"torch bytes"


def test_a_wrong_size_a_link_or_a_missing_file_is_not_committed(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    sinks = ResultSinks(store, tmp_path / "handoff")
    opened = sinks.open(JOB, 1)
    write(opened.specs["torch"], b"12345")
    with pytest.raises(ResultNotWritten, match="handed off with 5 bytes, reported 6"):
        sinks.commit(opened, {"torch": 6})
    with pytest.raises(ResultNotWritten, match=r"no saves\.pt"):
        sinks.commit(opened, {})
    with pytest.raises(ResultNotWritten, match=r"1 object\(s\) it was given no sink for"):
        sinks.commit(opened, {"torch": 5, "../../elsewhere": 5})  # an engine's report names objects it was given
    secret = tmp_path / "secret"
    secret.write_bytes(b"root's")
    os.unlink(opened.specs["torch"]["path"])
    os.symlink(secret, opened.specs["torch"]["path"])  # the engine points the worker at a file it cannot read
    with pytest.raises(ResultNotWritten, match="was not handed off"):
        sinks.commit(opened, {"torch": 6})
    sinks.discard(opened)
    with pytest.raises(ResultNotWritten, match="was not handed off"):
        sinks.commit(opened, {"torch": 5})
    assert not store.exists(f"results/{JOB}/1/saves.pt")


def stream(spec: dict[str, Any], data: bytes) -> sink.Written:
    """What the engine's shard writer does with a shard's bytes."""
    return sink.write_stream(spec, len(data), (data[i : i + MiB] for i in range(0, len(data), MiB)))


async def run_shard(sinks: ResultSinks, key: str, data: bytes) -> Any:
    """The engine writes the shard into the pipe while the worker uploads it, as a chunk runs."""
    opened = await asyncio.to_thread(sinks.open_shard, key, f"{uuid.uuid4().hex}.safetensors", 2 * len(data) + 1)
    upload = asyncio.ensure_future(asyncio.to_thread(sinks.upload_shard, opened))
    written = await asyncio.to_thread(stream, opened.spec, data)
    await upload
    return opened, written


def test_a_shard_is_uploaded_while_the_engine_writes_it(store: ObjectStore, tmp_path: Path) -> None:
    sinks = ResultSinks(store, tmp_path / "handoff")
    data = random.Random(0).randbytes(19 * MiB + 7)  # more than two parts of a multipart upload on S3
    key = "harvests/h/shard-00000.safetensors"
    opened, written = asyncio.run(run_shard(sinks, key, data))
    assert opened.spec["kind"] == "pipe" and not store.exists(key)  # read whole, not committed yet
    with pytest.raises(ResultNotWritten, match=f"arrived with {len(data)} bytes, reported {len(data) + 1}"):
        sinks.commit_shard(opened, len(data) + 1)
    assert not store.exists(key) and not Path(opened.spec["path"]).exists()

    opened, written = asyncio.run(run_shard(sinks, key, data))
    digest = sinks.commit_shard(opened, written.size)
    assert (digest.size, digest.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert store.get_bytes(key) == data and not Path(opened.spec["path"]).exists()


def test_an_abandoned_shard_stops_its_upload_and_leaves_nothing(store: ObjectStore, tmp_path: Path) -> None:
    sinks = ResultSinks(store, tmp_path / "handoff")
    key = "harvests/h/shard-00001.safetensors"
    never = sinks.open_shard(key, "never.safetensors", MiB)  # the engine never opens it
    waiting = threading.Thread(target=sinks.upload_shard, args=(never,))
    waiting.start()
    never.stop.set()
    waiting.join(timeout=5)
    assert not waiting.is_alive()
    sinks.discard_shard(never)

    half = sinks.open_shard(key, "half.safetensors", 64 * MiB)
    uploading = threading.Thread(target=sinks.upload_shard, args=(half,))
    uploading.start()
    fd = os.open(half.spec["path"], os.O_WRONLY)  # an engine that writes part of a shard and hangs
    os.write(fd, random.Random(1).randbytes(9 * MiB))
    half.stop.set()
    uploading.join(timeout=5)
    assert not uploading.is_alive()
    sinks.discard_shard(half)
    os.close(fd)
    assert not store.exists(key) and not any(Path(half.spec["path"]).parent.iterdir())
    if isinstance(store, S3ObjectStore):
        assert store._client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []
