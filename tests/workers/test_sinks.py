"""Result and shard sinks on the worker's side: the engine leaves files in the worker's handoff directory and
reports their sizes and sha256s; the worker checks each file (no link, one link, the reported size, the engine's
owner), streams it to the store itself, records what it uploaded, and hands the engine nothing that reaches the
store."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time
import uuid
from pathlib import Path

import pytest

from nnqueue.enginecore import sink
from nnqueue.engines.trace_report import WrittenObject
from nnqueue.settings import S3Settings
from nnqueue.storage.local import LocalObjectStore
from nnqueue.storage.object_store import ObjectStore
from nnqueue.storage.s3 import MIN_PART_SIZE, S3ObjectStore
from nnqueue.workers.sinks import ResultNotWritten, ResultSinks, ResultTooLarge, ShardFollower, ShardSink
from tests.storage.test_object_store import uploaded_parts

JOB = uuid.UUID("12345678-1234-5678-1234-567812345678")
MiB = 1 << 20


def write(spec: dict[str, str], data: bytes) -> WrittenObject:
    """What the engine does: write the object to its handoff file, hashing it as it goes."""
    written = sink.write_stream(spec, len(data), [data])
    return WrittenObject(written.size, written.sha256)


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
    assert set(sinks.open(JOB, 2, safetensors=False).specs) == {"torch"}  # the second copy only when asked
    opened = sinks.open(JOB, 2, safetensors=True)
    assert {spec["kind"] for spec in opened.specs.values()} == {"handoff"}
    assert "http" not in repr(opened.specs)  # nothing the engine gets reaches the store
    written = {
        name: write(opened.specs[name], data) for name, data in (("torch", b"torch bytes"), ("safetensors", b"st"))
    }

    stored = sinks.commit(opened, written)
    assert (stored.key, stored.size, stored.format) == (f"results/{JOB}/2/saves.pt", 11, "torch+safetensors")
    assert stored.sha256 == hashlib.sha256(b"torch bytes").hexdigest()
    assert stored.safetensors is not None and stored.safetensors.sha256 == hashlib.sha256(b"st").hexdigest()
    assert store.get_bytes(stored.key) == b"torch bytes"
    assert not any(Path(spec["path"]).exists() for spec in opened.specs.values())

    # What the engine could do afterwards: write its handoff path again. The committed object is a copy.
    Path(opened.specs["torch"]["path"]).write_bytes(b"forged bytes")
    assert store.get_bytes(stored.key) == b"torch bytes"


def test_a_result_over_the_limit_is_refused_naming_it_and_nothing_is_stored(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    sinks = ResultSinks(store, tmp_path / "handoff", max_result_bytes=10)
    opened = sinks.open(JOB, 1, safetensors=False)
    with pytest.raises(
        ResultTooLarge, match=r"11 bytes, over this deployment's limit of 10 bytes per job \(NNQUEUE_MAX"
    ):
        sinks.commit(opened, {"torch": write(opened.specs["torch"], b"eleven byte")})
    assert not store.exists(f"results/{JOB}/1/saves.pt")
    opened = sinks.open(JOB, 2, safetensors=False)
    assert sinks.commit(opened, {"torch": write(opened.specs["torch"], b"ten bytes!")}).size == 10  # at the limit


def test_a_wrong_size_a_link_someone_elses_file_or_a_missing_file_is_not_committed(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    sinks = ResultSinks(store, tmp_path / "handoff")
    opened = sinks.open(JOB, 1, safetensors=True)
    path = opened.specs["torch"]["path"]
    five = write(opened.specs["torch"], b"12345")
    with pytest.raises(ResultNotWritten, match="handed off with 5 bytes, reported 6"):
        sinks.commit(opened, {"torch": WrittenObject(6, five.sha256)})
    with pytest.raises(ResultNotWritten, match=r"no saves\.pt"):
        sinks.commit(opened, {})
    with pytest.raises(ResultNotWritten, match=r"1 object\(s\) it was given no sink for"):
        sinks.commit(opened, {"torch": 5, "../../elsewhere": 5})  # an engine's report names objects it was given
    secret = tmp_path / "secret"
    secret.write_bytes(b"root's")
    os.unlink(path)
    os.symlink(secret, path)  # the engine points the worker at a file it cannot read
    with pytest.raises(ResultNotWritten, match="was not handed off"):
        sinks.commit(opened, {"torch": WrittenObject(6, five.sha256)})
    os.unlink(path)
    os.link(secret, path)  # or links it there
    with pytest.raises(ResultNotWritten, match="not handed off as a file of the engine's own"):
        sinks.commit(opened, {"torch": WrittenObject(6, five.sha256)})
    if os.geteuid() == 0:  # a file of another user's, moved there
        os.unlink(path)
        Path(path).write_bytes(b"theirs")
        os.chown(path, 54321, 54321)
        with pytest.raises(ResultNotWritten, match="not handed off as a file of the engine's own"):
            sinks.commit(opened, {"torch": WrittenObject(6, five.sha256)})
    sinks.discard(opened)
    with pytest.raises(ResultNotWritten, match="was not handed off"):
        sinks.commit(opened, {"torch": five})
    assert not store.exists(f"results/{JOB}/1/saves.pt") and secret.read_bytes() == b"root's"


def test_a_shard_is_uploaded_from_its_handoff_file(store: ObjectStore, tmp_path: Path) -> None:
    sinks = ResultSinks(store, tmp_path / "handoff")
    data = random.Random(0).randbytes(19 * MiB + 7)  # more than two parts of a multipart upload on S3
    key = "harvests/h/shard-00000.safetensors"
    opened = sinks.open_shard(key, f"{uuid.uuid4().hex}.safetensors", len(data))
    assert opened.spec["kind"] == "handoff"
    written = write(opened.spec, data)
    with pytest.raises(ResultNotWritten, match=f"handed off with {len(data)} bytes, reported {len(data) - 1}"):
        sinks.commit_shard(opened, WrittenObject(len(data) - 1, written.sha256))
    assert not store.exists(key) and not Path(opened.spec["path"]).exists()

    opened = sinks.open_shard(key, f"{uuid.uuid4().hex}.safetensors", len(data) - 1)
    write(opened.spec, data)
    with pytest.raises(ResultNotWritten, match="over its bound"):  # larger than the chunk may write
        sinks.commit_shard(opened, written)
    assert not store.exists(key) and not Path(opened.spec["path"]).exists()

    opened = sinks.open_shard(key, f"{uuid.uuid4().hex}.safetensors", len(data))
    written = write(opened.spec, data)
    digest = sinks.commit_shard(opened, written)
    assert (digest.size, digest.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert store.get_bytes(key) == data and not Path(opened.spec["path"]).exists()


def test_an_abandoned_shard_leaves_nothing(store: ObjectStore, tmp_path: Path) -> None:
    """An attempt that fails after the engine wrote part of its shard: the staged file goes with it."""
    sinks = ResultSinks(store, tmp_path / "handoff")
    key = "harvests/h/shard-00001.safetensors"

    async def fail_mid_shard() -> ShardSink:
        async with sinks.staged_shard(key, "half.safetensors", 64 * MiB) as half:
            Path(half.spec["path"]).write_bytes(random.Random(1).randbytes(9 * MiB))  # written, never reported
            raise TimeoutError(half)

    with pytest.raises(TimeoutError) as failed:
        asyncio.run(fail_mid_shard())
    half = failed.value.args[0]
    assert not store.exists(key) and not any(Path(half.spec["path"]).parent.iterdir())


def test_a_shard_goes_up_while_the_engine_writes_it(s3_settings: S3Settings, tmp_path: Path) -> None:
    """The worker follows the engine's staging file: the parts written whole go up before the engine is done, the
    rest after its report; what is stored is the shard, and nothing is left in the handoff folder."""
    store = S3ObjectStore(s3_settings.model_copy(update={"bucket": f"sinks-{uuid.uuid4().hex[:8]}"}))
    sinks = ResultSinks(store, tmp_path, tmp_path)
    data = random.Random(2).randbytes(3 * MIN_PART_SIZE + 7)
    key = "harvests/h/shard-00002.safetensors"
    opened = sinks.open_shard(key, "followed.safetensors", len(data))
    follower = ShardFollower(sinks, opened)
    follower.poll()  # nothing written yet: nothing to follow
    assert follower.file is None

    def engine(file: sink.HashingFile) -> None:
        file.write(data[: 2 * MIN_PART_SIZE + 1])
        file.flush()
        follower.poll()  # mid-write: two parts are whole
        deadline = time.monotonic() + 30
        while uploaded_parts(s3_settings, store, key) != [1, 2]:
            assert time.monotonic() < deadline, "the written parts did not go up"
            time.sleep(0.02)
        file.write(data[2 * MIN_PART_SIZE + 1 :])

    written = sink.write_file(opened.spec, engine)
    digest = follower.commit(WrittenObject(written.size, written.sha256))
    assert (digest.size, digest.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert store.get_bytes(key) == data and list(Path(opened.spec["path"]).parent.iterdir()) == []


def test_a_staging_file_that_is_not_the_engines_own_is_not_followed(tmp_path: Path) -> None:
    """A staging path the engine pointed at someone else's file is never read; the shard it then reports is
    uploaded from its handoff file with every check, as without following."""
    store = LocalObjectStore(tmp_path / "objects")
    sinks = ResultSinks(store, tmp_path / "handoff", tmp_path / "handoff")
    opened = sinks.open_shard("harvests/h/shard-00003.safetensors", "linked.safetensors", 64)
    secret = tmp_path / "secret"
    secret.write_bytes(b"root's")
    os.symlink(secret, sink.staging_path(opened.spec["path"]))
    follower = ShardFollower(sinks, opened)
    follower.poll()
    assert follower.refused and follower.file is None
    os.unlink(sink.staging_path(opened.spec["path"]))
    written = write(opened.spec, b"the shard")
    digest = follower.commit(written)
    assert store.get_bytes(opened.key) == b"the shard" and digest.size == 9


def test_handoff_names_cannot_be_guessed_and_what_was_planted_there_is_removed(tmp_path: Path) -> None:
    """A sixth red-team round planted folders at the names the worker would give a later attempt's files (the job's
    or harvest's id, the attempt): the attempt failed, and so did the harvest. Names carry a part nobody can know
    beforehand, and whatever stands at one when the attempt ends goes, a folder too."""
    sinks = ResultSinks(LocalObjectStore(tmp_path / "store"), tmp_path / "handoff")
    first, second = (sinks.open(JOB, 1, safetensors=True) for _ in range(2))
    assert first.specs["torch"]["path"] != second.specs["torch"]["path"]
    shard = sinks.open_shard("harvests/h/shard-00000.safetensors", "h-00000-1.safetensors", MiB)
    assert Path(shard.spec["path"]).name != "h-00000-1.safetensors"
    planted = [Path(first.specs["torch"]["path"]), Path(sink.staging_path(shard.spec["path"]))]
    for folder in planted:
        (folder / "inside").mkdir(parents=True)
    sinks.discard(first)
    sinks.discard_shard(shard)
    assert not any(path.exists() for path in planted)
