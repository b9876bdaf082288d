"""The object store on S3 or an S3-compatible server (SeaweedFS, MinIO, ...), through boto3."""

from __future__ import annotations

import math
import threading
from typing import Any, BinaryIO

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError

from nnqueue.settings import S3Settings
from nnqueue.storage.object_store import (
    MultipartUpload,
    ObjectNotFound,
    ObjectReader,
    ObjectStore,
    ObjectStoreError,
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
_NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound"}


class S3ObjectStore(ObjectStore):
    """Objects in one bucket, which is created on first use if it does not exist."""

    def __init__(self, settings: S3Settings) -> None:
        self.bucket = settings.bucket
        self._client: Any = _client(settings, settings.endpoint_url)
        # Presigning is local (no request); a URL for clients must name the address they reach the store at.
        public = settings.public_endpoint_url
        self._presigner: Any = _client(settings, public) if public and public != settings.endpoint_url else self._client
        self._bucket_ready = False
        self._bucket_lock = threading.Lock()

    def put_bytes(self, key: str, data: bytes) -> int:
        self._call("put_object", key, Body=data)
        return len(data)

    def put_stream(self, key: str, fileobj: BinaryIO, size_hint: int | None = None) -> int:
        counted = _CountingReader(fileobj)
        self._ensure_bucket()
        # Managed transfer: multipart above the threshold, parts read one at a time from the stream
        # and uploaded concurrently; a failure aborts the multipart upload so no object appears.
        self._client.upload_fileobj(counted, self.bucket, validate_key(key), Config=_transfer_config(size_hint))
        return counted.bytes_read

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

    def presigned_put_url(self, key: str, expires_in: int) -> str:
        # For the worker's own engine processes, which reach the store at its internal endpoint.
        return self._presigned(self._client, "put_object", key, expires_in)

    def presigned_multipart(self, key: str, parts: int, expires_in: int) -> MultipartUpload:
        # Like presigned_put_url: for the engine processes, at the internal endpoint.
        if not 1 <= parts <= S3_MAX_PARTS:
            raise ValueError(f"a multipart upload has 1 to {S3_MAX_PARTS} parts, not {parts}")
        upload_id = self._call("create_multipart_upload", key)["UploadId"]
        urls = [
            self._presigned(self._client, "upload_part", key, expires_in, UploadId=upload_id, PartNumber=number)
            for number in range(1, parts + 1)
        ]
        return MultipartUpload(key, upload_id, urls)

    def complete_multipart(self, upload: MultipartUpload, etags: list[str]) -> int:
        parts = [{"PartNumber": number, "ETag": etag} for number, etag in enumerate(etags, 1)]
        self._call("complete_multipart_upload", upload.key, UploadId=upload.upload_id, MultipartUpload={"Parts": parts})
        return self.size(upload.key)

    def abort_multipart(self, upload: MultipartUpload) -> None:
        try:
            self._call("abort_multipart_upload", upload.key, UploadId=upload.upload_id)
        except ClientError as error:
            if error.response["Error"]["Code"] != "NoSuchUpload":  # already completed or aborted
                raise

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
            # Custom endpoints rarely resolve <bucket>.<host>; AWS itself prefers virtual hosts.
            s3={"addressing_style": "path" if endpoint_url else "auto"},
            retries={"mode": "standard", "max_attempts": 5},
        ),
    )


def _transfer_config(size_hint: int | None) -> TransferConfig:
    part_size = MIN_PART_SIZE
    if size_hint:
        part_size = max(part_size, math.ceil(size_hint / MAX_PARTS / MiB) * MiB)
    return TransferConfig(
        multipart_threshold=MULTIPART_THRESHOLD,
        multipart_chunksize=part_size,
        max_concurrency=MAX_CONCURRENCY,
    )


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
