"""The server fixtures serve for real: SQL on PostgreSQL, commands on Redis, signed-only S3."""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
import redis
import sqlalchemy as sa
from botocore.exceptions import ClientError

from nnqueue.embedded import MIN_REDIS_VERSION, EmbeddedRedis
from nnqueue.settings import S3Settings
from tests.utils import servers


def test_postgres_runs_sql(postgres_url: str) -> None:
    assert postgres_url.startswith("postgresql+psycopg://")
    engine = sa.create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("select 1")).scalar_one() == 1
            assert conn.execute(sa.text("select current_setting('server_version_num')::int")).scalar_one() >= 120000
    finally:
        engine.dispose()


def test_redis_pings_and_stores(redis_url: str) -> None:
    with redis.Redis.from_url(redis_url) as client:
        assert client.ping() is True
        key = f"nnqueue-test:{uuid.uuid4()}"
        client.set(key, b"value", ex=60)
        assert client.get(key) == b"value"
        major, minor = (int(part) for part in client.info("server")["redis_version"].split(".")[:2])
        assert (major, minor) >= MIN_REDIS_VERSION


def test_redis_refuses_a_client_without_the_password(redis_url: str) -> None:
    """The suite's broker, like a deployment's, has a password: a trace that reaches it cannot send to it."""
    if "NNQUEUE_TEST_REDIS_URL" in os.environ:
        pytest.skip("an external Redis: its password is its operator's business")
    url = urlsplit(redis_url)
    assert url.password, "the test broker has no password"
    with redis.Redis(host=url.hostname or "", port=url.port or 0) as client:
        with pytest.raises(redis.AuthenticationError):
            client.ping()
        with pytest.raises(redis.AuthenticationError):
            client.publish("celery.pidbox", b"{}")
    with redis.Redis(host=url.hostname or "", port=url.port or 0, password="wrong") as client:
        with pytest.raises(redis.AuthenticationError):
            client.ping()


def test_the_embedded_broker_has_a_private_password_per_data_dir(tmp_path: Path) -> None:
    first = EmbeddedRedis(tmp_path / "redis")
    try:
        password = urlsplit(first.url).password
        assert password and password not in first.display_url
        assert stat.S_IMODE((tmp_path / "redis").stat().st_mode) == 0o700
        assert stat.S_IMODE((tmp_path / "redis" / "redis.conf").stat().st_mode) == 0o600
        assert all(password not in part for part in psutil.Process(first.process.pid).cmdline())
        with redis.Redis(port=first.port) as client, pytest.raises(redis.AuthenticationError):
            client.ping()
        with redis.Redis.from_url(first.url) as client:
            assert client.ping() is True
    finally:
        first.stop()
    again = EmbeddedRedis(tmp_path / "redis")
    try:
        assert urlsplit(again.url).password == password  # the data dir keeps its password
    finally:
        again.stop()
    other = EmbeddedRedis(tmp_path / "other")
    try:
        assert urlsplit(other.url).password != password
    finally:
        other.stop()


@pytest.fixture(scope="module")
def s3_object(s3_settings: S3Settings) -> tuple[str, str, bytes]:
    """(bucket, key, body) of an object put with the right credentials."""
    client = servers.s3_client_for(s3_settings)
    bucket, key, body = f"nnqueue-servers-{uuid.uuid4().hex[:12]}", "hello.txt", b"hello s3"
    client.create_bucket(Bucket=bucket)
    client.put_object(Bucket=bucket, Key=key, Body=body)
    return bucket, key, body


def test_s3_puts_and_gets(s3_settings: S3Settings, s3_object: tuple[str, str, bytes]) -> None:
    bucket, key, body = s3_object
    assert servers.s3_client_for(s3_settings).get_object(Bucket=bucket, Key=key)["Body"].read() == body


@pytest.mark.parametrize(
    ("kwargs", "expected_code"),
    [
        ({"unsigned": True}, "AccessDenied"),
        ({"secret_access_key": "not-the-secret"}, "SignatureDoesNotMatch"),
    ],
    ids=["unsigned", "wrong-secret"],
)
def test_s3_refuses_requests_without_valid_signature(
    s3_settings: S3Settings, s3_object: tuple[str, str, bytes], kwargs: dict, expected_code: str
) -> None:
    bucket, key, _ = s3_object
    client = servers.s3_client_for(s3_settings, **kwargs)
    with pytest.raises(ClientError) as read_error:
        client.get_object(Bucket=bucket, Key=key)
    with pytest.raises(ClientError) as write_error:
        client.put_object(Bucket=bucket, Key="intruder.txt", Body=b"x")
    for error in (read_error.value, write_error.value):
        assert error.response["ResponseMetadata"]["HTTPStatusCode"] == 403
        assert error.response["Error"]["Code"] == expected_code
    assert "Contents" not in servers.s3_client_for(s3_settings).list_objects_v2(Bucket=bucket, Prefix="intruder")
