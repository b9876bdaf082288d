"""``nnqueue serve-api``, ``nnqueue keys create|list|revoke|scopes`` and ``nnqueue domains list|join|leave``,
registered on the main CLI.

Keys and trust domains are managed directly in the database (whoever can run this has the database's credentials),
so there is no HTTP route that creates keys. The server's libraries (sqlalchemy, uvicorn, ...) are imported
inside the commands: a client install, which has none of them, still lists these in ``nnqueue --help``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from nnqueue import logs
from nnqueue.settings import Settings

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

keys_app = typer.Typer(help="Create, list and revoke API keys.")
domains_app = typer.Typer(
    help="Trust domains: owners whose traces may share an engine (each owner alone unless grouped here)."
)
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
    domain: str | None = typer.Option(
        None, help="Put the owner in this trust domain (a group), as `nnqueue domains join` does. Default: as is."
    ),
) -> None:
    """Create a key and print its secret, which is shown only this once."""
    from nnqueue.api import auth
    from nnqueue.db.session import transaction
    from nnqueue.scheduler import trust_domains

    with transaction(_sessions()) as session:
        try:
            key, secret = auth.create_key(session, owner, scope)
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="--scope") from None
        if domain is not None:
            try:
                trust_domains.join_group(session, owner, domain, Settings().trust_domains)
            except trust_domains.InvalidDomain as error:
                raise typer.BadParameter(str(error), param_hint="--domain") from None
    scopes = ", ".join(key.scopes)
    in_domain = f", trust domain {domain}" if domain is not None else ""
    console.print(
        f"created key {key.id} ({key.key_prefix}...) for {owner}, scopes {scopes}{in_domain}; its secret, shown "
        "only once:"
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


@domains_app.command("list")
def list_domains() -> None:
    """List the groups and their owners (every other owner is alone in a domain of their own)."""
    from nnqueue.scheduler import trust_domains

    settings = Settings()
    with _sessions()() as session:
        grouped = trust_domains.groups(session)
    if settings.trust_domains == trust_domains.DEPLOYMENT:
        console.print("NNQUEUE_TRUST_DOMAINS=deployment: every owner's traces share the engines (groups kept below)")
    table = Table("domain", "owners")
    for domain, owners in grouped.items():
        table.add_row(domain, ", ".join(owners))
    console.print(table if grouped else "no groups: each owner is alone in a trust domain of their own")


@domains_app.command("join")
def join_domain(
    owner: str = typer.Argument(..., help="The owner (of API keys) to move."),
    domain: str = typer.Argument(..., help="The group: 1 to 64 letters, digits, '.', '_' or '-'."),
) -> None:
    """Put an owner in a group: their traces share engines with its other owners' (trust them with each other's
    results). Their queued jobs move with them."""
    from nnqueue.scheduler import trust_domains

    moved = _move_owner(lambda session, mode: trust_domains.join_group(session, owner, domain, mode))
    console.print(f"{owner} is in trust domain {domain} ({moved} queued jobs moved)")


@domains_app.command("leave")
def leave_domain(owner: str = typer.Argument(..., help="The owner to put back in a domain of their own.")) -> None:
    """Put an owner back in a trust domain of their own (the default). Their queued jobs move with them."""
    from nnqueue.scheduler import trust_domains

    moved = _move_owner(lambda session, mode: trust_domains.leave_group(session, owner, mode))
    domain = trust_domains.default_domain(owner, Settings().trust_domains)
    console.print(f"{owner} left their group: trust domain {domain} ({moved} queued jobs moved)")


def _move_owner(change: Callable[[Session, Any], int]) -> int:
    """``change(session, NNQUEUE_TRUST_DOMAINS)`` in a transaction: the jobs it moved. A name that cannot be a
    group's is a usage error; an owner no key has, exit 1."""
    from nnqueue.db.session import transaction
    from nnqueue.scheduler import trust_domains

    with transaction(_sessions()) as session:
        try:
            return change(session, Settings().trust_domains)
        except trust_domains.InvalidDomain as error:
            raise typer.BadParameter(str(error), param_hint="DOMAIN") from None
        except trust_domains.UnknownOwner as error:
            console.print(f"[red]{error}[/red]")
            raise typer.Exit(1) from None


def _sessions() -> sessionmaker[Session]:
    """Sessions on the configured database, once it is at the schema's head (else :class:`SchemaOutOfDate`, which
    says what to run)."""
    from nnqueue.db import migrate
    from nnqueue.db.session import make_engine, session_factory

    url = Settings().resolved_database_url
    migrate.require_head(url)
    return session_factory(make_engine(url))
