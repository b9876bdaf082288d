"""The settings check themselves when built: ranges, the rules between values, the defaults filled in; and the
store they choose is the one the comments promise (S3 as soon as any NNQUEUE_S3__* is set)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from nnqueue.settings import Settings
from nnqueue.storage import (
    LocalObjectStore,
    S3ObjectStore,
    describe_store,
    object_store_from_settings,
    unshared_store_problem,
)


@pytest.fixture(autouse=True)
def no_nnqueue_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in os.environ:
        if name.startswith("NNQUEUE_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # no .env, and the embedded defaults land here


def test_the_embedded_defaults_are_filled_in(tmp_path: Path) -> None:
    settings = Settings(data_dir=Path("data"))
    assert settings.database_url == f"sqlite:///{tmp_path / 'data' / 'nnqueue.db'}"
    assert settings.store_dir == tmp_path / "data" / "objects" and settings.store_dir_defaulted
    assert settings.resolved_database_url == settings.database_url
    assert settings.model_dump()["store_dir"] == tmp_path / "data" / "objects"
    assert isinstance(object_store_from_settings(settings), LocalObjectStore)
    assert describe_store(settings) == f"local folder {tmp_path / 'data' / 'objects'}"


@pytest.mark.parametrize(
    ("values", "switch", "hold_s"),
    [({}, "restart", 30.0), ({"domain_switch": "verify"}, "verify", 1.0), ({"domain_hold_s": 5}, "restart", 5.0)],
)
def test_a_fresh_engine_at_each_trust_domain_switch_by_default_with_a_hold_to_match(
    values: dict[str, object], switch: str, hold_s: float
) -> None:
    settings = Settings(**values)  # type: ignore[arg-type]
    assert (settings.domain_switch, settings.resolved_domain_hold_s) == (switch, hold_s)


@pytest.mark.parametrize(
    ("values", "names"),
    [
        ({"worker_heartbeat_s": 30, "worker_stale_after_s": 30}, "NNQUEUE_WORKER_STALE_AFTER_S (30) must be greater"),
        (
            {"broker_visibility_timeout_s": 600},
            "NNQUEUE_BROKER_VISIBILITY_TIMEOUT_S (600) must be greater than NNQUEUE_DEFAULT_JOB_TIMEOUT_S",
        ),
        ({"worker_heartbeat_s": 0}, "worker_heartbeat_s"),
        ({"max_jobs_in_flight_per_key": 0}, "max_jobs_in_flight_per_key"),
        ({"result_url_expiry_s": 8 * 24 * 3600}, "result_url_expiry_s"),
        ({"retention_days": 0}, "retention_days"),
    ],
)
def test_invalid_values_fail_naming_what_to_fix(values: dict[str, float], names: str) -> None:
    with pytest.raises(ValidationError, match=names.replace("(", r"\(").replace(")", r"\)")):
        Settings(**values)


def test_rules_are_read_from_the_environment_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NNQUEUE_DEFAULT_JOB_TIMEOUT_S", "9000")
    with pytest.raises(ValidationError, match="NNQUEUE_BROKER_VISIBILITY_TIMEOUT_S"):
        Settings()


def test_errors_do_not_show_the_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NNQUEUE_DATABASE_URL", "postgresql+psycopg://u:hunter2@db/x")
    monkeypatch.setenv("NNQUEUE_WORKER_HEARTBEAT_S", "-1")
    with pytest.raises(ValidationError) as caught:
        Settings()
    assert "hunter2" not in str(caught.value)


def test_any_s3_variable_chooses_s3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NNQUEUE_S3__BUCKET", "results")
    settings = Settings()
    assert isinstance(object_store_from_settings(settings), S3ObjectStore)
    assert describe_store(settings) == "s3://results at AWS S3 (us-east-1)"
    monkeypatch.setenv("NNQUEUE_S3__ENDPOINT_URL", "http://minio:9000")
    assert describe_store(Settings()) == "s3://results at http://minio:9000"


def test_only_a_default_folder_beside_a_server_database_is_a_problem(tmp_path: Path) -> None:
    postgres = "postgresql+psycopg://u:p@db/x"
    assert unshared_store_problem(Settings()) is None  # SQLite: one host
    problem = unshared_store_problem(Settings(database_url=postgres))
    assert problem is not None and "NNQUEUE_S3__*" in problem and "NNQUEUE_STORE_DIR" in problem
    assert unshared_store_problem(Settings(database_url=postgres, store_dir=tmp_path / "shared")) is None
    assert unshared_store_problem(Settings(database_url=postgres, s3={"bucket": "b"})) is None
