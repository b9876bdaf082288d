"""Where a harvest export goes when it is not a local folder: ``s3://bucket/prefix`` on any S3-compatible store.

The export is written to a local temporary folder first (``datasets`` writes Arrow files there), then each of
its files is uploaded under the prefix with boto3's transfer manager (multipart for large files, several parts
at once), keeping the folder's layout, so ``datasets.load_from_disk("s3://bucket/prefix", storage_options=...)``
(with ``s3fs``) or a download of the prefix opens it. Credentials, region and endpoint come from boto3's usual
chain: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (or a profile, an instance role), ``AWS_ENDPOINT_URL``
for a store other than AWS (MinIO, SeaweedFS). The prefix must be empty, as a local destination must be.

boto3 is imported only here, when such a destination is asked for (``pip install 'nnqueue[train]'`` has it): a
light client install has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEME = "s3://"


class UploadError(ValueError):
    """A remote destination that cannot be written; the message says why."""


@dataclass(frozen=True)
class S3Destination:
    bucket: str
    prefix: str  # no leading or trailing slash; may be empty

    @classmethod
    def parse(cls, url: str) -> S3Destination:
        bucket, _, prefix = url.removeprefix(SCHEME).partition("/")
        if not bucket:
            raise UploadError(f"{url!r} names no bucket: use s3://bucket/prefix")
        return cls(bucket, prefix.strip("/"))

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}"

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def check_empty(self, client: Any) -> None:
        """Raise `UploadError` when the prefix holds anything (or the bucket cannot be listed)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            found = client.list_objects_v2(Bucket=self.bucket, Prefix=self.key(""), MaxKeys=1)
        except (BotoCoreError, ClientError) as error:
            raise UploadError(f"cannot list {self}: {error}") from None
        if found.get("KeyCount", 0):
            raise UploadError(f"{self} is not empty: export under a new or empty prefix")

    def upload(self, client: Any, folder: Path) -> list[str]:
        """Every file under ``folder`` to the prefix, at its relative path; the keys written."""
        from boto3.s3.transfer import TransferConfig
        from botocore.exceptions import BotoCoreError, ClientError

        config = TransferConfig(multipart_chunksize=64 << 20, max_concurrency=8)
        keys = []
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            key = self.key(path.relative_to(folder).as_posix())
            try:
                client.upload_file(str(path), self.bucket, key, Config=config)
            except (BotoCoreError, ClientError) as error:
                raise UploadError(f"uploading {key} to {self} failed: {error}") from None
            keys.append(key)
        return keys


def is_remote(dest: str | Path) -> bool:
    return str(dest).startswith(SCHEME)


def s3_client() -> Any:
    """A boto3 S3 client from the environment (see the module docstring)."""
    try:
        import boto3
    except ImportError:
        raise UploadError("an s3:// destination needs boto3: pip install 'nnqueue[train]'") from None
    return boto3.client("s3")
