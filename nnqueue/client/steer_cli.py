"""``nnqueue steer ...``: declarative steering jobs (``harvest`` scope; no code runs on the workers).

nnqueue steer submit spec.yaml [--vectors vectors.safetensors] [--dataset prompts.jsonl] [--wait]
nnqueue steer status ID [--wait]
nnqueue steer list | cancel ID
nnqueue steer result ID [--output generations.json] [--activations activations.safetensors]
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from nnqueue.client.cli_common import (
    JsonOption,
    KeyOption,
    UrlOption,
    connected,
    console,
    local_time,
    show,
    status_text,
)
from nnqueue.client.errors import SteeringFailed
from nnqueue.client.steering import Steering

steer_app = typer.Typer(help="Declarative steering: generate with edits at module points, no code on the workers.")


@steer_app.command("submit")
def submit(
    spec: Path = typer.Argument(..., exists=True, dir_okay=False, help="The steering spec, a YAML or JSON file."),
    vectors: Path | None = typer.Option(
        None, exists=True, dir_okay=False, help="A safetensors file of the vectors the edits name."
    ),
    dataset: Path | None = typer.Option(None, exists=True, dir_okay=False, help="A local file of prompts."),
    wait: bool = typer.Option(False, "--wait", help="Wait until the job ends."),
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Submit SPEC; print the steering job's id (and wait for it with --wait)."""
    with connected(url, api_key) as client:
        job = client.steer(spec, vectors, dataset)
        console.print(f"steering job {job.id} queued")
        if wait:
            _wait(job)


JobId = typer.Argument(..., help="The steering job's id, or its first characters.")


@steer_app.command("status")
def status(
    job_id: str = JobId,
    wait: bool = typer.Option(False, "--wait", help="Wait until it ends."),
    as_json: bool = JsonOption,
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Show a steering job: status, prompts done, error."""
    with connected(url, api_key) as client:
        job = client.get_steering(job_id)
        if wait and not job.done:
            try:
                job.wait()
            except SteeringFailed:
                pass  # shown below; the exit status says it
    show(job.info, as_json, lambda: _table([job]))
    if wait and job.status != "completed":
        raise typer.Exit(1)


@steer_app.command("list")
def list_jobs(
    status_filter: str | None = typer.Option(None, "--status", help="Only jobs in this status."),
    limit: int = typer.Option(50, min=1, max=200),
    as_json: bool = JsonOption,
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Your steering jobs, newest first."""
    with connected(url, api_key) as client:
        jobs = client.steering_jobs(status_filter, limit)
    show([job.info for job in jobs], as_json, lambda: _table(jobs) if jobs else "no steering jobs")


@steer_app.command("cancel")
def cancel(job_id: str = JobId, url: str | None = UrlOption, api_key: str | None = KeyOption) -> None:
    """Cancel a queued or running steering job."""
    with connected(url, api_key) as client:
        job = client.get_steering(job_id).cancel()
    console.print(f"steering job {job.id} {status_text(job.info)}")


@steer_app.command("result")
def result(
    job_id: str = JobId,
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the generations (JSON) here."),
    activations: Path | None = typer.Option(
        None, "--activations", help="Also write the activations the spec's captures recorded (safetensors) here."
    ),
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Print each prompt's generated text (or write all generations, JSON, with --output)."""
    with connected(url, api_key) as client:
        job = client.get_steering(job_id)
        generations = job.result()
        if activations is not None:
            job.download_activations(activations)
            console.print(f"activations written to {activations}")
    if output is not None:
        output.write_text(json.dumps(generations))
        console.print(f"{len(generations)} generations written to {output}")
        return
    for index, generation in enumerate(generations):
        console.print(f"[bold]{index}[/bold] {escape(generation['text'])}")


def _wait(job: Steering) -> None:
    try:
        job.wait()
    except SteeringFailed as failed:
        console.print(f"[red]{escape(str(failed))}[/red]")
        raise typer.Exit(1) from None
    console.print(f"steering job {job.id} {status_text(job.info)}")


def _table(jobs: list[Steering]) -> Table:
    table = Table("id", "model", "status", "prompts", "created", "error")
    for job in jobs:
        info = job.info
        progress = info.get("progress") or {}
        error = info.get("error") or {}
        table.add_row(
            job.id,
            escape(str(info.get("model_key"))),
            status_text(info),
            f"{progress.get('done', 0)}/{progress.get('total') if progress.get('total') is not None else '?'}",
            local_time(info.get("created_at")),
            escape(f"{error.get('type')}: {error.get('message')}") if error else "",
        )
    return table
