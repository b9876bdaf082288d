"""The ``nnqueue`` command: help, migrations against real Postgres, and engine arguments (the demo runs in
tests/test_demo.py)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
from sqlalchemy import create_engine, inspect
from typer.testing import CliRunner

from nnqueue.cli import app, engine_args

runner = CliRunner()


def test_help_lists_the_commands() -> None:
    result = subprocess.run([sys.executable, "-m", "nnqueue", "--help"], capture_output=True, text=True, check=True)
    for command in ("worker", "db", "demo", "version", "submit", "status", "jobs", "cancel", "download", "models"):
        assert command in result.stdout


def test_db_upgrade_migrates_the_configured_database(
    database_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = database_factory(migrated=False)
    monkeypatch.setenv("NNQUEUE_DATABASE_URL", url)
    result = runner.invoke(app, ["db", "upgrade"])
    assert result.exit_code == 0, result.output
    assert "jobs" in inspect(create_engine(url)).get_table_names()
    assert "***" in result.output or "@" not in result.output  # the password is not printed


def test_engine_args_become_vllm_keyword_arguments() -> None:
    assert engine_args(["--max-model-len", "256", "--enforce-eager", "--dtype=float32", "--seed", "-1"]) == {
        "max_model_len": 256,
        "enforce_eager": True,
        "dtype": "float32",
        "seed": -1,
    }
