"""``nnqueue serve-api`` and ``nnqueue keys create|list|revoke``, registered on the main CLI.

Keys are managed directly in the database (whoever can run this has the database's credentials),
so there is no HTTP route that creates keys. The server's libraries (sqlalchemy, uvicorn, ...) are imported
inside the commands: a client install, which has none of them, still lists these in ``nnqueue --help``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from nnqueue import logs
from nnqueue.settings import Settings

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

keys_app = typer.Typer(help="Create, list and revoke API keys.")
console = Console()


def serve_api(
    host: str | None = typer.Option(None, help="Interface to listen on (default NNQUEUE_API_HOST, 127.0.0.1)."),
    port: int | None = typer.Option(None, help="Port to listen on (default NNQUEUE_API_PORT, 8000)."),
    workers: int | None = typer.Option(
        None, min=1, help="API processes sharing the port (default NNQUEUE_API_WORKERS, 1)."
    ),
) -> None:
    """Serve the HTTP API with uvicorn. The database must be migrated first (nnqueue db upgrade)."""
    import uvicorn

    from nnqueue.broker import broker_url
    from nnqueue.db import migrate

    settings = Settings()
    broker_url(settings)  # here rather than in each process's app factory, whose error uvicorn would print
    # nnqueue's own start-up lines (which object store, and a warning when it is probably not shared).
    logs.configure(settings.log_format)
    try:
        migrate.require_head(settings.resolved_database_url)
    except migrate.SchemaOutOfDate as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(1) from None
    processes = workers or settings.api_workers
    with _shared_metrics(processes):
        uvicorn.run(
            "nnqueue.api.app:create_app",
            factory=True,
            host=host or settings.api_host,
            port=port or settings.api_port,
            workers=processes,
            log_config=logs.uvicorn_log_config(settings.log_format),
        )


@contextmanager
def _shared_metrics(processes: int) -> Iterator[None]:
    """With several processes, a fresh prometheus-client multiprocess folder that they all inherit, so that any
    one of them reports all of their counts (see nnqueue.metrics); removed when the server stops."""
    if processes == 1:
        yield
        return
    from nnqueue import metrics

    with tempfile.TemporaryDirectory(prefix="nnqueue-api-metrics-") as folder:
        os.environ[metrics.MULTIPROC_ENV] = folder
        try:
            yield
        finally:
            del os.environ[metrics.MULTIPROC_ENV]


SCOPE_HELP = (
    "What the key may do (repeatable): trace (run nnsight code on the workers: trusted users only),"
    " harvest (declarative harvests, no code), admin (every owner's jobs, checkpoint swaps), weights (a"
    " worker's trainer endpoints: generate, push weights). Default: harvest."
)


@keys_app.command("create")
def create_key(
    owner: str = typer.Option(..., help="Who the key belongs to: the owner of the jobs it submits."),
    scope: list[str] = typer.Option(["harvest"], help=SCOPE_HELP),  # auth.DEFAULT_SCOPES
) -> None:
    """Create a key and print its secret, which is shown only this once."""
    from nnqueue.api import auth
    from nnqueue.db.session import transaction

    with transaction(_sessions()) as session:
        try:
            key, secret = auth.create_key(session, owner, scope)
        except ValueError as error:
            raise typer.BadParameter(str(error)) from None
    scopes = ", ".join(key.scopes)
    console.print(
        f"created key {key.id} ({key.key_prefix}...) for {owner}, scopes {scopes}; its secret, shown only once:"
    )
    typer.echo(secret)


@keys_app.command("list")
def list_keys() -> None:
    """List the keys: id, prefix, owner, scopes, creation and revocation (never the secrets)."""
    from nnqueue.api import auth

    table = Table("id", "prefix", "owner", "scopes", "created", "revoked")
    with _sessions()() as session:
        for key in auth.list_keys(session):
            revoked = key.revoked_at.isoformat(timespec="seconds") if key.revoked_at else ""
            created = key.created_at.isoformat(timespec="seconds")
            table.add_row(str(key.id), key.key_prefix, key.owner, ",".join(key.scopes), created, revoked)
    console.print(table)


@keys_app.command("revoke")
def revoke_key(prefix_or_id: str = typer.Argument(..., help="The key's id, or its secret's prefix.")) -> None:
    """Revoke a key: requests with it get 401 from now on."""
    from nnqueue.api import auth
    from nnqueue.db.session import transaction

    with transaction(_sessions()) as session:
        try:
            key = auth.revoke_key(session, prefix_or_id)
        except auth.KeyNotFound as error:
            console.print(f"[red]{error}[/red]")
            raise typer.Exit(1) from None
    console.print(f"revoked key {key.id} ({key.key_prefix}...) of {key.owner}")


@keys_app.command("scopes")
def set_scopes(
    prefix_or_id: str = typer.Argument(..., help="The key's id, or its secret's prefix."),
    scope: list[str] = typer.Option(..., help="The key's scopes from now on (repeatable): trace, harvest, admin."),
) -> None:
    """Replace a key's scopes (e.g. grant trace to a key created before scopes were enforced)."""
    from nnqueue.api import auth
    from nnqueue.db.session import transaction

    with transaction(_sessions()) as session:
        try:
            key = auth.set_scopes(session, prefix_or_id, scope)
        except auth.KeyNotFound as error:
            console.print(f"[red]{error}[/red]")
            raise typer.Exit(1) from None
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="--scope") from None
    console.print(f"key {key.id} ({key.key_prefix}...) of {key.owner} now has scopes {', '.join(key.scopes)}")


def _sessions() -> sessionmaker[Session]:
    """Sessions on the configured database, once it is at the schema's head (else :class:`SchemaOutOfDate`, which
    says what to run)."""
    from nnqueue.db import migrate
    from nnqueue.db.session import make_engine, session_factory

    url = Settings().resolved_database_url
    migrate.require_head(url)
    return session_factory(make_engine(url))
