"""Run the Alembic migrations in ``migrations/`` against a database URL, from code or the CLI."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(database_url: str) -> Config:
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise FileNotFoundError(
            f"Alembic migrations not found at {MIGRATIONS_DIR}; install nnqueue from its source tree (pip install -e .)"
        )
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Alembic's Config interpolates '%'; a password may contain one.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)
