"""Both object-store backends behave the same: each behavioural test runs against S3 (the harness's
real SeaweedFS server, which checks SigV4 signatures) and against a local directory."""

from __future__ import annotations

import hashlib
import io
import os
import random
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import httpx
import pytest

from nnqueue.settings import S3Settings, Settings
from nnqueue.storage import (
    LocalObjectStore,
    ObjectNotFound,
    ObjectStore,
    PresignUnsupported,
    S3ObjectStore,
    object_store_from_settings,
)
from nnqueue.storage.object_store import ObjectStoreError
from nnqueue.storage.s3 import MIN_PART_SIZE
from tests.utils import servers

MiB = 1024 * 1024


@pytest.fixture
def s3_store(s3_settings: S3Settings) -> S3ObjectStore:
    return S3ObjectStore(s3_settings)


@pytest.fixture
def local_store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects")


@pytest.fixture(params=["s3", "local"])
def store(request: pytest.FixtureRequest) -> ObjectStore:
    return request.getfixturevalue(f"{request.param}_store")


@pytest.fixture
def key() -> str:
    return f"tests/{uuid.uuid4().hex}/object.bin"


class GeneratorReader(io.RawIOBase):
    """A non-seekable binary stream over an iterator of byte chunks."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:  # any writable buffer (a bytearray, a memoryview)
        while not self._pending:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._pending = memoryview(chunk)
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def stream_of(chunks: Iterator[bytes]) -> BinaryIO:
    return io.BufferedReader(GeneratorReader(chunks), buffer_size=MiB)


def random_chunks(count: int, digest: hashlib._Hash, seed: int = 0) -> Iterator[bytes]:
    """``count`` chunks of 1 MiB pseudo-random bytes, fed into ``digest`` as they are produced."""
    rng = random.Random(seed)
    for _ in range(count):
        chunk = rng.randbytes(MiB)
        digest.update(chunk)
        yield chunk


def failing_chunks(good: int) -> Iterator[bytes]:
    yield from (b"x" * MiB for _ in range(good))
    raise RuntimeError("upstream stream broke")


# --- behaviour shared by both backends ------------------------------------------------------------


def test_roundtrip(store: ObjectStore, key: str) -> None:
    data = b"payload \x00\xff" * 100
    assert store.put_bytes(key, data) == len(data)
    assert store.get_bytes(key) == data
    assert store.size(key) == len(data)
    assert store.exists(key)
    with store.open_stream(key) as stream:
        assert stream.read() == data


def test_empty_object(store: ObjectStore, key: str) -> None:
    assert store.put_bytes(key, b"") == 0
    assert store.exists(key)
    assert store.size(key) == 0
    assert store.get_bytes(key) == b""
    assert store.get_bytes(key, 0, 10) == b""


def test_overwrite_replaces_object(store: ObjectStore, key: str) -> None:
    store.put_bytes(key, b"first version, longer")
    store.put_bytes(key, b"second")
    assert store.get_bytes(key) == b"second"
    assert store.size(key) == len(b"second")


def test_missing_key(store: ObjectStore, key: str) -> None:
    assert not store.exists(key)
    for read in (
        lambda: store.get_bytes(key),
        lambda: store.get_bytes(key, 2, 5),
        lambda: store.get_bytes(key, 3, 3),
        lambda: store.size(key),
        lambda: store.open_stream(key),
    ):
        with pytest.raises(ObjectNotFound) as error:
            read()
        assert error.value.key == key


def test_delete_is_idempotent(store: ObjectStore, key: str) -> None:
    store.put_bytes(key, b"doomed")
    store.delete(key)
    assert not store.exists(key)
    with pytest.raises(ObjectNotFound):
        store.get_bytes(key)
    store.delete(key)
    store.delete(f"{key}-never-existed")


def test_delete_prefix_removes_the_folder_and_nothing_beside_it(store: ObjectStore) -> None:
    base = f"tests/{uuid.uuid4().hex}"
    inside = [f"{base}/job/saves.pt", f"{base}/job/1/saves.pt", f"{base}/job/2/saves.safetensors"]
    beside = [f"{base}/job2/saves.pt", f"{base}/jo"]
    for key in inside + beside:
        store.put_bytes(key, b"x")
    assert store.delete_prefix(f"{base}/job/") == 3
    assert [store.exists(key) for key in inside + beside] == [False, False, False, True, True]
    assert store.delete_prefix(f"{base}/job/") == 0  # nothing left: not an error
    for bad in ("", "/", f"{base}/job"):
        with pytest.raises(ValueError, match="folder prefix"):
            store.delete_prefix(bad)


RANGES = [(None, None), (0, 10), (10, 20), (None, 7), (1000, None), (1020, 5000), (1024, None), (2000, 3000), (5, 5)]


def test_ranged_reads_are_half_open_like_slices(store: ObjectStore, key: str) -> None:
    data = bytes(range(256)) * 4
    store.put_bytes(key, data)
    for start, end in RANGES:
        assert store.get_bytes(key, start, end) == data[start:end], (start, end)


@pytest.mark.parametrize(("start", "end"), [(-1, None), (10, 5), (0, -1)])
def test_invalid_range_is_rejected(store: ObjectStore, key: str, start: int, end: int | None) -> None:
    store.put_bytes(key, b"0123456789abcdef")
    with pytest.raises(ValueError, match="invalid byte range"):
        store.get_bytes(key, start, end)


def test_large_stream_roundtrip(store: ObjectStore, key: str, request: pytest.FixtureRequest) -> None:
    size_mib = 64
    written = hashlib.sha256()
    assert store.put_stream(key, stream_of(random_chunks(size_mib, written))) == size_mib * MiB
    assert store.size(key) == size_mib * MiB

    read = hashlib.sha256()
    with store.open_stream(key) as stream:
        while chunk := stream.read(MiB):
            read.update(chunk)
    assert read.hexdigest() == written.hexdigest()
    assert store.get_bytes(key, 40 * MiB, 40 * MiB + 5) == written_bytes_at(40 * MiB, 5)

    if isinstance(store, S3ObjectStore):
        # A multipart upload's ETag is "<md5 of part md5s>-<number of parts>".
        client = servers.s3_client_for(request.getfixturevalue("s3_settings"))
        etag = client.head_object(Bucket=store.bucket, Key=key)["ETag"]
        assert etag.strip('"').endswith(f"-{size_mib * MiB // MIN_PART_SIZE}")


def written_bytes_at(offset: int, length: int, seed: int = 0) -> bytes:
    """The bytes ``random_chunks(seed=seed)`` produced at ``offset`` (within one chunk)."""
    rng = random.Random(seed)
    for _ in range(offset // MiB):
        rng.randbytes(MiB)
    inner = offset % MiB
    return rng.randbytes(MiB)[inner : inner + length]


def test_failed_stream_leaves_previous_object(store: ObjectStore, key: str, request: pytest.FixtureRequest) -> None:
    store.put_bytes(key, b"previous")
    # 20 MiB is past the S3 multipart threshold, so the failure happens mid multipart upload.
    with pytest.raises(RuntimeError, match="upstream stream broke"):
        store.put_stream(key, stream_of(failing_chunks(good=20)))
    assert store.get_bytes(key) == b"previous"
    if isinstance(store, S3ObjectStore):  # the failed multipart upload was aborted, not left to linger
        client = servers.s3_client_for(request.getfixturevalue("s3_settings"))
        assert client.list_multipart_uploads(Bucket=store.bucket, Prefix=key).get("Uploads", []) == []
    with pytest.raises(RuntimeError):
        store.put_stream(f"{key}.new", stream_of(failing_chunks(good=2)))
    assert not store.exists(f"{key}.new")


def test_concurrent_reader_never_sees_partial_object(store: ObjectStore, key: str) -> None:
    versions = [bytes([ord("a") + i]) * (2 * MiB) for i in range(2)]
    store.put_bytes(key, versions[0])
    stop = threading.Event()

    def overwrite() -> None:
        for i in range(20):
            store.put_stream(key, stream_of(iter([versions[i % 2][:MiB], versions[i % 2][MiB:]])))
        stop.set()

    writer = threading.Thread(target=overwrite)
    writer.start()
    reads = 0
    try:
        while not stop.is_set():
            assert store.get_bytes(key) in versions
            reads += 1
    finally:
        writer.join()
    assert reads > 0


BAD_KEYS = ["", "/abs", "a//b", "a/", "..", "a/../b", ".", "a/./b", "a\\b", "a\x00b", "k" * 1025]


@pytest.mark.parametrize("bad_key", BAD_KEYS)
def test_invalid_keys_are_rejected(store: ObjectStore, bad_key: str) -> None:
    for call in (
        lambda: store.put_bytes(bad_key, b"x"),
        lambda: store.put_stream(bad_key, io.BytesIO(b"x")),
        lambda: store.get_bytes(bad_key),
        lambda: store.open_stream(bad_key),
        lambda: store.size(bad_key),
        lambda: store.exists(bad_key),
        lambda: store.delete(bad_key),
    ):
        with pytest.raises(ValueError, match="invalid object key"):
            call()


# --- S3: presigned URLs and the bucket --------------------------------------------------------------


def test_presigned_url_serves_object(s3_store: S3ObjectStore, key: str) -> None:
    s3_store.put_bytes(key, b"presigned body")
    response = httpx.get(s3_store.presigned_get_url(key, expires_in=60))
    assert response.status_code == 200
    assert response.content == b"presigned body"


def test_presigned_url_names_the_public_endpoint(s3_settings: S3Settings, key: str) -> None:
    """Behind a Docker network the store is http://minio:9000 to the API but localhost:9000 to its clients."""
    endpoint = s3_settings.endpoint_url or ""
    host = urlsplit(endpoint).hostname or ""
    other = {"127.0.0.1": "localhost", "localhost": "127.0.0.1"}.get(host)
    if other is None:
        pytest.skip(f"needs the S3 endpoint on this machine by 127.0.0.1 or localhost, not {endpoint!r}")
    public = endpoint.replace(host, other, 1)
    store = S3ObjectStore(s3_settings.model_copy(update={"public_endpoint_url": public}))
    store.put_bytes(key, b"for a client outside")
    url = store.presigned_get_url(key, expires_in=60)
    assert url.startswith(f"{public}/")
    response = httpx.get(url)
    assert response.status_code == 200 and response.content == b"for a client outside"


def test_presigned_url_expires(s3_store: S3ObjectStore, key: str) -> None:
    s3_store.put_bytes(key, b"short-lived")
    url = s3_store.presigned_get_url(key, expires_in=1)
    time.sleep(2)
    assert httpx.get(url).status_code == 403


def test_tampered_presigned_url_is_refused(s3_store: S3ObjectStore, key: str) -> None:
    s3_store.put_bytes(key, b"secret")
    s3_store.put_bytes(f"{key}.other", b"other secret")
    url = s3_store.presigned_get_url(key, expires_in=60)
    signature = httpx.URL(url).params["X-Amz-Signature"]
    forged = signature[:-1] + ("0" if signature[-1] != "0" else "1")
    assert httpx.get(url.replace(signature, forged)).status_code == 403
    assert httpx.get(url.replace(key, f"{key}.other")).status_code == 403


@pytest.mark.parametrize("expires_in", [0, -5, 7 * 24 * 3600 + 1])
def test_presigned_url_expiry_bounds(s3_store: S3ObjectStore, key: str, expires_in: int) -> None:
    with pytest.raises(ValueError, match="expires_in"):
        s3_store.presigned_get_url(key, expires_in)


def test_bucket_is_created_on_first_use_by_racing_stores(s3_settings: S3Settings) -> None:
    settings = s3_settings.model_copy(update={"bucket": f"nnqueue-new-{uuid.uuid4().hex[:12]}"})
    errors: list[BaseException] = []

    def put(i: int) -> None:
        try:
            S3ObjectStore(settings).put_bytes(f"racer-{i}", b"x")
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert all(S3ObjectStore(settings).exists(f"racer-{i}") for i in range(4))


# --- local directory specifics ----------------------------------------------------------------------


def test_local_presign_is_unsupported(local_store: LocalObjectStore, key: str) -> None:
    local_store.put_bytes(key, b"x")
    with pytest.raises(PresignUnsupported, match="stream the object through the API"):
        local_store.presigned_get_url(key, expires_in=60)


def test_local_keys_map_under_root_and_leave_no_temp_files(local_store: LocalObjectStore) -> None:
    local_store.put_bytes("results/job-1/logits", b"data")
    with pytest.raises(RuntimeError):
        local_store.put_stream("results/job-1/hidden", stream_of(failing_chunks(good=1)))
    assert (local_store.root / "results/job-1/logits").read_bytes() == b"data"
    assert sorted(p.name for p in (local_store.root / "results/job-1").iterdir()) == ["logits"]


def test_local_key_naming_a_directory_is_not_an_object(local_store: LocalObjectStore) -> None:
    local_store.put_bytes("results/job-1/logits", b"data")
    assert not local_store.exists("results/job-1")
    with pytest.raises(ObjectNotFound):
        local_store.get_bytes("results/job-1")
    with pytest.raises(ObjectNotFound):
        local_store.size("results/job-1")


# --- choosing the backend from settings ---------------------------------------------------------------


def test_object_store_from_settings(tmp_path: Path, s3_settings: S3Settings) -> None:
    local = object_store_from_settings(Settings(_env_file=None, data_dir=tmp_path))
    assert isinstance(local, LocalObjectStore)
    assert local.root == (tmp_path / "objects").resolve()

    s3 = object_store_from_settings(Settings(_env_file=None, data_dir=tmp_path, s3=s3_settings))
    assert isinstance(s3, S3ObjectStore)
    assert s3.bucket == s3_settings.bucket


def test_list_keys_by_prefix(store: ObjectStore) -> None:
    base = f"tests/{uuid.uuid4().hex}"
    for name in ("b/2.txt", "a.jsonl", "b/1.txt", "bb/3.txt"):
        store.put_bytes(f"{base}/{name}", b"x")
    assert store.list_keys(f"{base}/b/") == [f"{base}/b/1.txt", f"{base}/b/2.txt"]
    assert store.list_keys(f"{base}/b") == [f"{base}/b/1.txt", f"{base}/b/2.txt", f"{base}/bb/3.txt"]
    assert store.list_keys(f"{base}/") == [f"{base}/{name}" for name in ("a.jsonl", "b/1.txt", "b/2.txt", "bb/3.txt")]
    assert store.list_keys(f"{base}/nothing/") == []


@pytest.mark.parametrize("size", [0, 3, MIN_PART_SIZE, 2 * MIN_PART_SIZE + 5])
def test_a_staged_write_appears_whole_at_commit_with_its_digest(store: ObjectStore, key: str, size: int) -> None:
    data = random.Random(size).randbytes(size)
    store.put_bytes(key, b"before")
    writer = store.open_writer(key, size_hint=size)
    for start in range(0, size, MiB + 3):
        writer.write(memoryview(data)[start : start + MiB + 3])
    assert store.get_bytes(key) == b"before"  # nothing shows before the commit, even with parts uploaded
    digest = writer.commit()
    assert (digest.size, digest.sha256) == (size, hashlib.sha256(data).hexdigest())
    assert store.get_bytes(key) == data


def test_an_aborted_staged_write_leaves_the_object_as_it_was(store: ObjectStore, key: str) -> None:
    store.put_bytes(key, b"before")
    writer = store.open_writer(key)
    writer.write(random.Random(0).randbytes(2 * MIN_PART_SIZE + 1))  # two parts uploaded on S3
    writer.abort()
    assert store.get_bytes(key) == b"before"
    if isinstance(store, S3ObjectStore):
        assert store._client.list_multipart_uploads(Bucket=store.bucket, Prefix=key).get("Uploads", []) == []
    else:
        assert [path.name for path in (store.root / key).parent.iterdir()] == ["object.bin"]


def take_the_part_thread(store: S3ObjectStore) -> threading.Event:
    """Take the part thread of ``store`` (a store with one) until the returned event is set: the parts of uploads
    started meanwhile wait in its queue, unread."""
    busy, release = threading.Event(), threading.Event()

    def hold() -> None:
        busy.set()
        release.wait()

    store._parts.submit(hold)
    busy.wait()
    return release


def test_a_file_cut_short_while_its_parts_go_up_leaves_the_previous_object(
    s3_settings: S3Settings, key: str, tmp_path: Path
) -> None:
    """A regular file goes up in parts that the store's part threads read when their turn comes: one that finds the
    file ended early fails the upload, which is aborted (the object stays as it was, no multipart upload lingers)."""
    store = S3ObjectStore(s3_settings.model_copy(update={"upload_parts_in_flight": 1}))
    client = servers.s3_client_for(s3_settings)
    store.put_bytes(key, b"previous")
    path = tmp_path / "shard.bin"
    path.write_bytes(random.Random(0).randbytes(3 * MIN_PART_SIZE))  # three parts
    release = take_the_part_thread(store)
    with open(path, "rb") as file:
        upload = store.follow_file(key, file, size_hint=3 * MIN_PART_SIZE)
        upload.advance(3 * MIN_PART_SIZE)  # all three queued behind the held thread, unread
        os.truncate(path, MIN_PART_SIZE + 1)
        release.set()
        with pytest.raises(ObjectStoreError, match=f"the file ended at byte {MIN_PART_SIZE + 1}"):
            upload.finish(3 * MIN_PART_SIZE)
    assert store.get_bytes(key) == b"previous"
    assert client.list_multipart_uploads(Bucket=store.bucket, Prefix=key).get("Uploads", []) == []


def uploaded_parts(s3_settings: S3Settings, store: S3ObjectStore, key: str) -> list[int]:
    """The part numbers that the key's one multipart upload in progress holds so far (none while the uploader has
    not made the bucket yet: it does so on its first request, on its own thread)."""
    client = servers.s3_client_for(s3_settings)
    try:
        uploads = client.list_multipart_uploads(Bucket=store.bucket, Prefix=key).get("Uploads", [])
    except client.exceptions.NoSuchBucket:
        return []
    if not uploads:
        return []
    parts = client.list_parts(Bucket=store.bucket, Key=key, UploadId=uploads[0]["UploadId"]).get("Parts", [])
    return [part["PartNumber"] for part in parts]


def test_a_file_goes_up_while_it_is_written(store: ObjectStore, key: str, request: pytest.FixtureRequest) -> None:
    """`follow_file`: on S3 the parts the file holds whole go up before the writer is done; nothing appears at the
    key before the finish, and an aborted upload leaves nothing."""
    data = random.Random(3).randbytes(2 * MIN_PART_SIZE + 5)
    path = request.getfixturevalue("tmp_path") / "growing.bin"
    with open(path, "wb") as writer, open(path, "rb") as reader:
        upload = store.follow_file(key, reader, size_hint=len(data))
        writer.write(data[: MIN_PART_SIZE + 3])
        writer.flush()
        upload.advance(MIN_PART_SIZE + 3)
        if isinstance(store, S3ObjectStore):  # the first part is stored while the rest is still to be written
            s3_settings = request.getfixturevalue("s3_settings")
            deadline = time.monotonic() + 30
            while uploaded_parts(s3_settings, store, key) != [1]:
                assert time.monotonic() < deadline, "the written part did not go up"
                time.sleep(0.02)
        assert not store.exists(key)
        writer.write(data[MIN_PART_SIZE + 3 :])
        writer.flush()
        upload.advance(len(data))
        assert upload.finish(len(data)) == len(data)
    assert store.get_bytes(key) == data

    with open(path, "rb") as reader:
        dropped = store.follow_file(f"{key}.dropped", reader, size_hint=len(data))
        dropped.advance(len(data))
        dropped.abort()
    assert not store.exists(f"{key}.dropped")
    if isinstance(store, S3ObjectStore):
        assert uploaded_parts(request.getfixturevalue("s3_settings"), store, f"{key}.dropped") == []
