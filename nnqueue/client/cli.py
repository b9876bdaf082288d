"""Client commands of ``nnqueue``: submit, status, jobs, cancel, download, models (and, from
:mod:`nnqueue.client.harvest_cli`, the ``harvest`` and ``schedules`` groups).

Every command talks to the API at ``--url`` / ``NNQUEUE_URL`` with ``--api-key`` / ``NNQUEUE_API_KEY``
(either may also come from a ``.env`` file).

``nnqueue submit script.py [ARGS...]`` runs a Python script that writes ordinary nnsight traces with
``backend=client.backend()``, where ``client = nnqueue.client.Client.from_env()`` (the command exports
``NNQUEUE_URL`` and ``NNQUEUE_API_KEY`` for it). Every job the script submits is listed at the end.
Without ``--wait`` the script's backends only *queue* their traces (their default ``blocking`` becomes
false, through ``NNQUEUE_BLOCKING=0``), so the script runs through and the command prints the job ids
to follow with ``nnqueue status`` and fetch with ``nnqueue download``; the trace variables are then not
set, so a script that reads them needs ``--wait``. With ``--wait`` the traces block as usual (saved
values land in the script's variables), and any job still unfinished at the end is waited for.
A backend built with an explicit ``blocking=`` keeps it either way.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from nnqueue.client.cli_common import (
    TRACE_EXTRA_HINT,
    TRACE_MODULES,
    JsonOption,
    KeyOption,
    UrlOption,
    connected,
    console,
    err_console,
    local_time,
    print_json,
    print_table,
    show,
    status_text,
)
from nnqueue.client.client import submit_hooks
from nnqueue.client.errors import JobCancelled, JobFailed
from nnqueue.client.harvest_cli import harvest_app, schedules_app
from nnqueue.client.job import Job
from nnqueue.client.steer_cli import steer_app


def submit(
    script: Path = typer.Argument(
        ..., exists=True, dir_okay=False, help="A Python script that traces with client.backend()."
    ),
    args: list[str] = typer.Argument(None, help="Arguments for the script (after --)."),
    wait: bool = typer.Option(False, "--wait", help="Block on each trace and wait for every job to finish."),
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Run SCRIPT; list the jobs its traces submitted (queued only, unless --wait)."""
    exported = {"NNQUEUE_BLOCKING": "1" if wait else "0"}
    if url:
        exported["NNQUEUE_URL"] = url
    if api_key:
        exported["NNQUEUE_API_KEY"] = api_key
    saved_env = {name: os.environ.get(name) for name in exported}
    os.environ.update(exported)
    submitted: list[Job] = []
    submit_hooks.append(submitted.append)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [str(script), *(args or [])]
    sys.path.insert(0, str(script.resolve().parent))
    failure: BaseException | None = None
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            failure = exit_
    except Exception as error:  # noqa: BLE001 - the script's own error, whatever it is: show it, then what it queued
        failure = error
        err_console.print("".join(traceback.format_exception(error)).rstrip(), highlight=False, markup=False)
    finally:
        submit_hooks.remove(submitted.append)
        sys.argv, sys.path = saved_argv, saved_path
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    if wait:
        for job in submitted:
            if not job.done:
                try:
                    job.wait()
                except (JobFailed, JobCancelled):
                    pass  # shown in the table
    if submitted:
        print_table(_jobs_table(submitted, title=f"{len(submitted)} job(s) submitted by {script.name}"))
    else:
        err_console.print(f"[yellow]{script.name} submitted no jobs[/yellow] (did it trace with client.backend()?)")
    if not wait and submitted:
        first = submitted[0].id
        console.print(
            f"follow with [bold]nnqueue status {first}[/bold], fetch with [bold]nnqueue download {first} out.pt[/bold]"
        )
    if isinstance(failure, NameError) and not wait and submitted:
        err_console.print(
            "[yellow]hint:[/yellow] without --wait traces only queue jobs, so their saved variables are unset"
        )
    if isinstance(failure, ModuleNotFoundError) and (failure.name or "").split(".")[0] in TRACE_MODULES:
        err_console.print(f"[yellow]hint:[/yellow] traces need nnsight: {escape(TRACE_EXTRA_HINT)}")
    if failure is not None or (wait and any(job.info.get("status") != "completed" for job in submitted)):
        raise typer.Exit(1)


def status(
    job_id: str = typer.Argument(..., help="The job's id, or its first characters."),
    wait: bool = typer.Option(False, "--wait", help="Follow the job until it ends, with a progress display."),
    as_json: bool = JsonOption,
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Show a job: status, queue position, progress, times, error."""
    with connected(url, api_key) as client:
        job = client.job(job_id)
        if wait and not job.done:
            try:
                job.wait(progress=not as_json)
            except (JobFailed, JobCancelled):
                pass
    error = job.info.get("error")
    show(job.info, as_json, lambda: _job_table(job))
    if not as_json and error and error.get("traceback"):
        console.print("[bold]worker traceback[/bold]")
        console.print(error["traceback"].rstrip(), markup=False, highlight=False)
    if wait and job.info.get("status") != "completed":
        raise typer.Exit(1)


def jobs(
    status_filter: str | None = typer.Option(
        None, "--status", help="Only jobs with this status (queued, running, completed, failed, cancelled)."
    ),
    model_key: str | None = typer.Option(None, "--model", help="Only jobs for this model key."),
    limit: int = typer.Option(20, min=1, help="Show at most this many (newest first)."),
    as_json: bool = JsonOption,
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """List your jobs, newest first."""
    shown: list[Job] = []
    with connected(url, api_key) as client:
        for job in client.jobs(status=status_filter, model_key=model_key, page_size=min(limit + 1, 200)):
            if len(shown) == limit:
                break
            shown.append(job)
    show([job.info for job in shown], as_json, lambda: _jobs_table(shown) if shown else "no jobs")


def cancel(
    job_id: str = typer.Argument(..., help="The job's id, or its first characters."),
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Cancel a queued or running job."""
    with connected(url, api_key) as client:
        job = client.job(job_id).cancel()
    console.print(f"job {job.id} is {status_text(job.info)}")


def download(
    job_id: str = typer.Argument(..., help="The job's id, or its first characters."),
    path: Path = typer.Argument(..., help="Where to write the result (a directory: <id>.pt in it)."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait for an unfinished job first."),
    inline: bool = typer.Option(False, "--inline", help="Stream through the API instead of the presigned URL."),
    safetensors: bool = typer.Option(
        False,
        "--safetensors",
        help="The safetensors copy (a job submitted with safetensors=True whose saves are all tensors).",
    ),
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Download a job's result (torch.save of its saves dict), with progress bars, checked against the sha256 the
    worker recorded."""
    fmt = "safetensors" if safetensors else "torch"
    with connected(url, api_key) as client:
        written = client.job(job_id).download(path, wait=wait, inline=inline, format=fmt)
    loader = "safetensors.torch.load_file(path)" if safetensors else "torch.load(path, weights_only=False)"
    console.print(f"wrote {written} ({written.stat().st_size:,} bytes); load it with {loader}")


models_app = typer.Typer(help="The models live workers serve; their weights.", no_args_is_help=False)


@models_app.callback(invoke_without_command=True)
def models(
    ctx: typer.Context, as_json: bool = JsonOption, url: str | None = UrlOption, api_key: str | None = KeyOption
) -> None:
    """List the models that live workers serve (and the weights versions they serve)."""
    if ctx.invoked_subcommand is not None:
        return
    with connected(url, api_key) as client:
        served = client.models()
    if as_json:
        print_json(served)
        return
    table = Table("model key", "workers", "capacity", "weights versions")
    for model in served:
        versions = ", ".join(f"{version} ({count})" for version, count in model.get("weights_versions", {}).items())
        table.add_row(escape(model["model_key"]), str(model["workers"]), str(model["capacity"]), escape(versions))
    print_table(table if served else "no live workers")


@models_app.command("update-weights")
def update_weights(
    model_key: str = typer.Argument(..., help="The model key whose live engines load the checkpoint."),
    source: str = typer.Option(
        ..., "--from", help="s3://<bucket>/<key> of a .safetensors file, or an absolute path on the workers' hosts."
    ),
    tensor: list[str] = typer.Option(None, "--tensor", help="Load only this tensor (repeatable); default: all."),
    wait: float = typer.Option(600.0, "--wait", help="Seconds to wait for every live worker to serve it (0: don't)."),
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Load a safetensors checkpoint into every live engine of MODEL_KEY without restarting them (an admin key)."""
    with connected(url, api_key) as client:
        view = client.update_weights(model_key, source, list(tensor or []) or None)
        version = view["updates"][-1]["version"]
        console.print(f"update {escape(version)} asked of {len(view['workers'])} live worker(s)")
        if wait <= 0:
            return
        workers = _await_version(client, model_key, version, wait)
    behind = False
    for worker in workers:
        error = str((worker.get("source") or {}).get("error") or "")
        failed = version in error
        behind = behind or failed or worker["version"] != version
        note = f"  [red]{escape(error)}[/]" if failed else ""
        console.print(f"{escape(worker['worker_id'])}: {escape(str(worker['version']))}{note}")
    if behind:
        raise typer.Exit(1)


def _await_version(client: Any, model_key: str, version: str, wait_s: float) -> list[dict[str, Any]]:
    """The model's live workers once each serves ``version`` or failed to load it, or after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        workers: list[dict[str, Any]] = client.model_weights(model_key)["workers"]
        settled = all(
            worker["version"] == version or version in str((worker.get("source") or {}).get("error") or "")
            for worker in workers
        )
        if settled or time.monotonic() > deadline:
            return workers
        time.sleep(1.0)


COMMANDS: dict[str, Callable[..., None]] = {
    "submit": submit,
    "status": status,
    "jobs": jobs,
    "cancel": cancel,
    "download": download,
}


def register(app: typer.Typer) -> None:
    """Add the client commands to the ``nnqueue`` app (the harvest and schedule groups too)."""
    for name, command in COMMANDS.items():
        app.command(name)(command)
    app.add_typer(models_app, name="models")
    app.add_typer(harvest_app, name="harvest")
    app.add_typer(schedules_app, name="schedules")
    app.add_typer(steer_app, name="steer")


# -- rendering ------------------------------------------------------------------------------------


def _progress(info: dict[str, Any]) -> str:
    progress = info.get("progress") or {}
    total = progress.get("total")
    return f"{progress.get('done', 0)}/{total}" if total else ""


def _detail(info: dict[str, Any]) -> str:
    if info.get("status") == "queued" and info.get("queue_position") is not None:
        return f"position {info['queue_position']}"
    if error := info.get("error"):
        return escape(f"{error.get('type')}: {error.get('message', '')}"[:80])
    if result := info.get("result"):
        return f"result {result.get('size', 0):,} B"
    return ""


def _jobs_table(jobs: list[Job], title: str | None = None) -> Table:
    table = Table("id", "status", "model", "created", "progress", "detail", title=title)
    for job in jobs:
        info = job.info
        table.add_row(
            job.id,
            status_text(info),
            escape(job.model_key),
            local_time(info.get("created_at")),
            _progress(info),
            _detail(info),
        )
    return table


def _job_table(job: Job) -> Table:
    info = job.info
    table = Table(show_header=False, title=f"job {job.id}")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("status", status_text(info)),
        ("model", escape(job.model_key)),
        ("owner", str(info.get("owner", ""))),
        ("priority", str(info.get("priority", ""))),
        ("timeout", f"{info['timeout_s']:g} s" if info.get("timeout_s") is not None else ""),
        ("queue position", str(info["queue_position"]) if info.get("queue_position") is not None else ""),
        ("progress", _progress(info)),
        ("attempts", str(info.get("attempts", ""))),
        ("created", local_time(info.get("created_at"))),
        ("started", local_time(info.get("started_at"))),
        ("finished", local_time(info.get("finished_at"))),
    ]
    if result := info.get("result"):
        rows.append(("result", f"{result.get('size', 0):,} bytes ({result.get('format')})"))
    if error := info.get("error"):
        rows.append(("error", escape(f"{error.get('type')}: {error.get('message', '')}")))
    if metadata := info.get("metadata"):
        rows.append(("metadata", escape(str(metadata))))
    for name, value in rows:
        if value:
            table.add_row(name, value)
    return table
