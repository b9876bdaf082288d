"""A wheel built from this tree carries its migrations: installed into a fresh virtualenv (no network, no
source tree, no editable install), ``nnqueue db upgrade`` migrates a real Postgres database from it.

The fresh virtualenv gets only the wheel (``--no-deps``); a ``.pth`` file puts the test environment's
site-packages after its own, so that the dependencies resolve without an index. ``.pth`` files inside that
directory are not processed, so the editable install of this checkout stays out, and the commands run from
an empty folder without PYTHONPATH: ``nnqueue`` can only come from the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from nnqueue.db import migrate

pytestmark = pytest.mark.slow  # builds a wheel and a virtualenv

ROOT = Path(__file__).resolve().parents[1]


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{argv} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built without network from a copy of the package (the checkout gets no build/ or egg-info)."""
    source = tmp_path_factory.mktemp("source")
    shutil.copy(ROOT / "pyproject.toml", source)
    shutil.copy(ROOT / "README.md", source)
    shutil.copytree(ROOT / "nnqueue", source / "nnqueue", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), "."], source)
    [built] = out.glob("nnqueue-*.whl")
    return built


def test_the_wheel_holds_the_migrations_and_the_type_marker(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    revisions = {
        f"nnqueue/db/migrations/versions/{path.name}" for path in (ROOT / "nnqueue/db/migrations/versions").glob("*.py")
    }
    assert len(revisions) >= 3
    assert {"nnqueue/db/migrations/env.py", "nnqueue/db/migrations/script.py.mako", "nnqueue/py.typed"} <= names
    assert revisions <= names


def test_db_upgrade_from_the_installed_wheel_migrates_postgres(
    wheel: Path, database_factory: Callable[..., str], tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    # Without NNQUEUE_* and PYTHON* (a PYTHONPATH naming this checkout would make pip skip the install).
    env = {name: value for name, value in os.environ.items() if not name.startswith(("NNQUEUE_", "PYTHON"))}
    run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        tmp_path,
        env,
    )
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path).strip())
    (site / "test-environment.pth").write_text(sysconfig.get_path("purelib") + "\n")

    url = database_factory(migrated=False)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env["NNQUEUE_DATABASE_URL"] = url
    where = run([str(python), "-c", "import nnqueue.db.migrate as m; print(m.MIGRATIONS_DIR)"], workdir, env)
    assert Path(where.strip()).is_relative_to(site)  # the wheel's copy, not this checkout's

    output = run([str(venv / "bin" / "nnqueue"), "db", "upgrade"], workdir, env)
    assert "is at revision head" in " ".join(output.split())  # rich wraps lines at the terminal width
    engine = create_engine(url)
    try:
        assert {"jobs", "job_events", "api_keys", "workers"} <= set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    migrate.require_head(url)  # at this checkout's newest revision: the wheel shipped all of them
