"""The object store on S3 or an S3-compatible server (SeaweedFS, MinIO, ...), through boto3.

A regular file (a worker's handoff file: a harvest shard, a trace result) goes up in parts that the store's part
threads read at their offsets (``pread``) and send in parallel, ``S3Settings.upload_parts_in_flight`` at once for all
of this process's uploads together: one upload alone (the last shard of a harvest) gets every thread, many share
them first come first served. Request bodies are sent unsigned (``UNSIGNED-PAYLOAD``, what boto3 does over HTTPS
anyway) with their CRC32 checksum, which the store checks: over plain HTTP boto3 would otherwise hash every byte
with SHA-256 once more for the signature, the costliest step of an upload on the worker's cores. What was uploaded
is still checked end to end: the object's sha256 is recorded where it was written and clients check it.
"""

from __future__ import annotations

import math
import os
import stat
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, BinaryIO

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError

from nnqueue.settings import S3Settings
from nnqueue.storage.object_store import (
    FileUpload,
    ObjectNotFound,
    ObjectReader,
    ObjectStore,
    ObjectStoreError,
    ObjectWriter,
    validate_expiry,
    validate_key,
    validate_range,
)

MiB = 1024 * 1024
# Objects above MULTIPART_THRESHOLD are uploaded in parts of at least MIN_PART_SIZE. S3 allows at most
# 10,000 parts, so with a size hint the part size grows to stay under MAX_PARTS.
MULTIPART_THRESHOLD = 16 * MiB
MIN_PART_SIZE = 8 * MiB
MAX_PARTS = 9_000
S3_MAX_PARTS = 10_000
# The most keys one DeleteObjects request may name.
S3_MAX_DELETE_KEYS = 1000
# s3transfer buffers up to ~10 parts of a non-seekable stream, so memory use is bounded by
# about 10 x part size, never the whole object.
MAX_CONCURRENCY = 4
# Pooled connections beyond the part threads' own: staged writers, reads, small requests.
SPARE_CONNECTIONS = 16
_NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound"}


class S3ObjectStore(ObjectStore):
    """Objects in one bucket, which is created on first use if it does not exist."""

    def __init__(self, settings: S3Settings) -> None:
        self.bucket = settings.bucket
        self._client: Any = _client(settings, settings.endpoint_url)
        # Threads start on first use; a store that never uploads a file has none.
        self.parts_in_flight = settings.upload_parts_in_flight
        self._parts = ThreadPoolExecutor(self.parts_in_flight, thread_name_prefix="nnqueue-s3-part")
        # Presigning is local (no request); a URL for clients must name the address they reach the store at.
        public = settings.public_endpoint_url
        self._presigner: Any = _client(settings, public) if public and public != settings.endpoint_url else self._client
        self._bucket_ready = False
        self._bucket_lock = threading.Lock()

    def put_bytes(self, key: str, data: bytes) -> int:
        self._call("put_object", key, Body=data)
        return len(data)

    def put_stream(self, key: str, fileobj: BinaryIO, size_hint: int | None = None) -> int:
        self._ensure_bucket()
        span = _file_span(fileobj)
        if span is not None:
            offset, size = span
            return _FileParts(self, validate_key(key), fileobj, size, offset).finish(size)
        counted = _CountingReader(fileobj)
        # Managed transfer: multipart above the threshold, parts read one at a time from the stream
        # and uploaded concurrently; a failure aborts the multipart upload so no object appears.
        self._client.upload_fileobj(counted, self.bucket, validate_key(key), Config=_transfer_config(size_hint))
        return counted.bytes_read

    def follow_file(self, key: str, fileobj: BinaryIO, size_hint: int | None = None) -> FileUpload:
        # Nothing here waits on the store: the caller may be an event loop (the parts' requests make the bucket).
        return _FileParts(self, validate_key(key), fileobj, size_hint)

    def _file_part(self, key: str, upload_id: str, number: int, fd: int, offset: int, length: int) -> dict[str, Any]:
        body = _read_at(fd, offset, length)
        answer = self._call("upload_part", key, UploadId=upload_id, PartNumber=number, Body=body)
        return {"PartNumber": number, "ETag": answer["ETag"]}

    def _abort_upload(self, key: str, upload_id: str) -> None:
        """Abort a multipart upload (its parts are dropped); one already gone is not an error."""
        try:
            self._call("abort_multipart_upload", key, UploadId=upload_id)
        except ClientError as error:
            if error.response["Error"]["Code"] != "NoSuchUpload":
                raise

    def open_writer(self, key: str, size_hint: int | None = None) -> ObjectWriter:
        self._ensure_bucket()
        return _MultipartWriter(self, key, _part_size(size_hint))

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        start, end = validate_range(start, end)
        if start == end:
            self.size(key)  # still raise ObjectNotFound for a missing key
            return b""
        if start == 0 and end is None:
            return self._call("get_object", key)["Body"].read()
        # HTTP ranges are inclusive: [start, end) is bytes=start-(end-1).
        byte_range = f"bytes={start}-{'' if end is None else end - 1}"
        try:
            return self._call("get_object", key, Range=byte_range)["Body"].read()
        except ClientError as exc:
            if exc.response["Error"]["Code"] == "InvalidRange":  # start is at or past the end
                return b""
            raise

    def open_stream(self, key: str) -> ObjectReader:
        return self._call("get_object", key)["Body"]

    def size(self, key: str) -> int:
        return self._call("head_object", key)["ContentLength"]

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        self._call("delete_object", key)  # S3 deletes are idempotent

    def list_keys(self, prefix: str) -> list[str]:
        self._ensure_bucket()
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))

    def delete_keys(self, keys: list[str]) -> None:
        # One DeleteObjects request per 1,000 keys (S3's limit) instead of one request per key.
        for start in range(0, len(keys), S3_MAX_DELETE_KEYS):
            batch = [{"Key": validate_key(key)} for key in keys[start : start + S3_MAX_DELETE_KEYS]]
            self._ensure_bucket()
            answer = self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            if answer.get("Errors"):
                first = answer["Errors"][0]
                raise ObjectStoreError(
                    f"could not delete {len(answer['Errors'])} object(s), e.g. {first.get('Key')}: {first.get('Message')}"
                )

    def presigned_get_url(self, key: str, expires_in: int) -> str:
        # For clients: signed for the public endpoint when one is configured.
        return self._presigned(self._presigner, "get_object", key, expires_in)

    def _presigned(self, client: Any, operation: str, key: str, expires_in: int, **params: Any) -> str:
        self._ensure_bucket()
        return client.generate_presigned_url(
            operation,
            Params={"Bucket": self.bucket, "Key": validate_key(key), **params},
            ExpiresIn=validate_expiry(expires_in),
        )

    def _call(self, operation: str, key: str, **params: Any) -> Any:
        """Call one keyed S3 operation, mapping "no such key" to :class:`ObjectNotFound`."""
        validate_key(key)
        self._ensure_bucket()
        try:
            return getattr(self._client, operation)(Bucket=self.bucket, Key=key, **params)
        except ClientError as exc:
            if exc.response["Error"]["Code"] in _NOT_FOUND_CODES:
                raise ObjectNotFound(key) from exc
            raise

    def _ensure_bucket(self) -> None:
        """Create the bucket once per store if it is missing. Several processes may race to create
        it; losing the race (BucketAlreadyOwnedByYou) is fine."""
        if self._bucket_ready:
            return
        with self._bucket_lock:
            if not self._bucket_ready:
                self._create_bucket_if_missing()
                self._bucket_ready = True

    def _create_bucket_if_missing(self) -> None:
        try:
            # HEAD first: production credentials may read a pre-made bucket but not create one.
            self._client.head_bucket(Bucket=self.bucket)
            return
        except ClientError as exc:
            if exc.response["Error"]["Code"] not in {"404", "NoSuchBucket", "NotFound"}:
                raise
        params: dict[str, Any] = {"Bucket": self.bucket}
        region = self._client.meta.region_name
        if region and region != "us-east-1":  # us-east-1 rejects an explicit LocationConstraint
            params["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            self._client.create_bucket(**params)
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "BucketAlreadyOwnedByYou":
                raise


def _client(settings: S3Settings, endpoint_url: str | None) -> Any:
    secret = settings.secret_access_key
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=settings.region,
        aws_access_key_id=settings.access_key_id,
        aws_secret_access_key=secret.get_secret_value() if secret else None,
        config=Config(
            signature_version="s3v4",
            # Custom endpoints rarely resolve <bucket>.<host>; AWS itself prefers virtual hosts. Bodies unsigned, with
            # their CRC32 (see the module doc).
            s3={"addressing_style": "path" if endpoint_url else "auto", "payload_signing_enabled": False},
            retries={"mode": "standard", "max_attempts": 5},
            max_pool_connections=settings.upload_parts_in_flight + SPARE_CONNECTIONS,
        ),
    )


def _part_size(size_hint: int | None) -> int:
    part_size = MIN_PART_SIZE
    if size_hint:
        part_size = max(part_size, math.ceil(size_hint / MAX_PARTS / MiB) * MiB)
    return part_size


def _transfer_config(size_hint: int | None) -> TransferConfig:
    return TransferConfig(
        multipart_threshold=MULTIPART_THRESHOLD,
        multipart_chunksize=_part_size(size_hint),
        max_concurrency=MAX_CONCURRENCY,
    )


class _MultipartWriter(ObjectWriter):
    """Bytes buffered into parts of ``part_size``; the first full part starts a multipart upload, and parts go up
    on ``MAX_CONCURRENCY`` threads while more are written (at most that many in flight: memory stays near
    ``(MAX_CONCURRENCY + 1) * part_size``). Commit completes the upload, or puts a small object in one request;
    until then no object appears at the key."""

    def __init__(self, store: S3ObjectStore, key: str, part_size: int) -> None:
        super().__init__(key)
        self.store, self.part_size = store, part_size
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: deque[Future[dict[str, Any]]] = deque()
        self.done: list[dict[str, Any]] = []
        self.pool: ThreadPoolExecutor | None = None

    def _write(self, data: bytes | memoryview) -> None:
        self.buffer += data
        while len(self.buffer) >= self.part_size:
            part = bytes(self.buffer[: self.part_size])
            del self.buffer[: self.part_size]
            self._send(part)

    def _send(self, part: bytes) -> None:
        if self.upload_id is None:
            self.upload_id = self.store._call("create_multipart_upload", self.key)["UploadId"]
            self.pool = ThreadPoolExecutor(MAX_CONCURRENCY, thread_name_prefix="nnqueue-s3-part")
        assert self.pool is not None
        while len(self.parts) >= MAX_CONCURRENCY:
            self.done.append(self.parts.popleft().result())
        number = len(self.done) + len(self.parts) + 1
        self.parts.append(self.pool.submit(self._upload_part, number, part))

    def _upload_part(self, number: int, part: bytes) -> dict[str, Any]:
        answer = self.store._call("upload_part", self.key, UploadId=self.upload_id, PartNumber=number, Body=part)
        return {"PartNumber": number, "ETag": answer["ETag"]}

    def _commit(self) -> None:
        try:
            if self.upload_id is None:
                self.store._call("put_object", self.key, Body=bytes(self.buffer))
                return
            if self.buffer:  # the last part, which may be smaller
                self._send(bytes(self.buffer))
            self.done += [future.result() for future in self.parts]
            self.parts.clear()
            self.store._call(
                "complete_multipart_upload", self.key, UploadId=self.upload_id, MultipartUpload={"Parts": self.done}
            )
            self.upload_id = None
        except BaseException:
            self.abort()
            raise
        finally:
            self.buffer = bytearray()
            if self.pool is not None:
                self.pool.shutdown(wait=False)

    def abort(self) -> None:
        self.buffer = bytearray()
        for future in self.parts:
            future.cancel()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.parts.clear()
        if self.upload_id is not None:
            upload_id, self.upload_id = self.upload_id, None
            self.store._abort_upload(self.key, upload_id)


class _FileParts(FileUpload):
    """A regular file (from ``offset``) in parts of its size hint's part size, each read at its offset and sent on the
    store's part threads as soon as the file holds it whole; the multipart upload is created by the first part's
    turn on those threads (they serve in order, so it is made before any part needs it). Completed once every part
    is in, aborted if any fails: nothing appears before. A file under the multipart threshold that sent nothing
    goes up in one PUT at the finish."""

    def __init__(self, store: S3ObjectStore, key: str, fileobj: BinaryIO, size_hint: int | None, offset: int = 0):
        super().__init__(store, key, fileobj, size_hint)
        self.s3, self.fd, self.offset = store, fileobj.fileno(), offset
        self.part_size = _part_size(size_hint)
        self.created: Future[str] | None = None
        self.parts: list[Future[dict[str, Any]]] = []
        self.sent = 0

    def advance(self, written: int) -> None:
        while self.sent + self.part_size <= written:
            self._send(self.part_size)

    def _send(self, length: int) -> None:
        if self.created is None:
            self.created = self.s3._parts.submit(self._create)
        created, number, offset = self.created, len(self.parts) + 1, self.offset + self.sent
        self.parts.append(
            self.s3._parts.submit(
                lambda: self.s3._file_part(self.key, created.result(), number, self.fd, offset, length)
            )
        )
        self.sent += length

    def _create(self) -> str:
        upload_id: str = self.s3._call("create_multipart_upload", self.key)["UploadId"]
        return upload_id

    def finish(self, size: int) -> int:
        if self.created is None and size < MULTIPART_THRESHOLD:
            self.s3._call("put_object", self.key, Body=_read_at(self.fd, self.offset, size))
            return size
        if self.created is None:  # nothing sent: the parts' size for the size now known, not a bound's
            self.part_size = _part_size(size)
        try:
            if size < self.sent:
                raise ObjectStoreError(f"the file has {size} bytes, fewer than the {self.sent} already sent")
            while self.sent < size:
                self._send(min(self.part_size, size - self.sent))
            done = [part.result() for part in self.parts]
            assert self.created is not None
            upload_id = self.created.result()
            self.s3._call("complete_multipart_upload", self.key, UploadId=upload_id, MultipartUpload={"Parts": done})
        except BaseException:
            self.abort()
            raise
        self.created, self.parts = None, []
        return size

    def abort(self) -> None:
        for part in self.parts:
            part.cancel()
        wait(self.parts)  # no part thread reads the file once the caller closes it
        self.parts = []
        if self.created is None:
            return
        created, self.created = self.created, None
        if not created.cancelled() and created.exception() is None:  # (one never created has nothing to abort)
            self.s3._abort_upload(self.key, created.result())


def _file_span(fileobj: BinaryIO) -> tuple[int, int] | None:
    """``(position, bytes from there to the end)`` when ``fileobj`` is an open regular file, else None."""
    try:
        fd = fileobj.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        return None
    position = fileobj.tell()
    return position, max(0, info.st_size - position)


def _read_at(fd: int, offset: int, length: int) -> bytes:
    """Exactly ``length`` bytes of ``fd`` at ``offset``; a file cut short meanwhile is an error (nothing is stored)."""
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise ObjectStoreError(f"the file ended at byte {offset + len(data)} while {offset + length} were expected")
    return data


class _CountingReader:
    """Wraps a readable binary stream and counts the bytes read from it, so ``put_stream`` can
    report the size of a stream whose length is not known in advance."""

    def __init__(self, fileobj: BinaryIO) -> None:
        self._fileobj = fileobj
        self.bytes_read = 0

    def read(self, size: int = -1) -> bytes:
        chunk = self._fileobj.read(size)
        self.bytes_read += len(chunk)
        return chunk
