"""Alembic environment: migrates the database named by the Alembic config, else by nnqueue's settings."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from nnqueue.db.models import Base
from nnqueue.db.session import make_engine
from nnqueue.settings import Settings

config = context.config
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

url = config.get_main_option("sqlalchemy.url") or Settings().resolved_database_url


def run_migrations() -> None:
    engine = make_engine(url)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            # SQLite cannot ALTER most things in place; batch mode rebuilds the table instead.
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("nnqueue migrations run online only: give a database URL")
run_migrations()
