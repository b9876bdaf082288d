"""``nnqueue harvest ...`` and ``nnqueue schedules ...``: declarative harvests and their recurring schedules.

nnqueue harvest submit spec.yaml [--dataset corpus.jsonl] [--wait]
nnqueue harvest status ID [--wait]          # progress bar: chunks, prompts, tokens/s, ETA
nnqueue harvest list | cancel ID | manifest ID
nnqueue harvest download ID DIR [--parallel 4]
nnqueue schedules create NAME --cron '0 3 * * *' spec.yaml
nnqueue schedules list | pause ID | resume ID | delete ID
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from nnqueue.client.cli_common import KeyOption, UrlOption, connected, console, local_time, status_text
from nnqueue.client.errors import HarvestFailed
from nnqueue.client.harvest import Harvest

harvest_app = typer.Typer(help="Declarative activation harvests: submit a spec, follow it, download its shards.")
schedules_app = typer.Typer(help="Recurring harvests, fired by `nnqueue beat`.")
SpecArgument = typer.Argument(..., exists=True, dir_okay=False, help="The harvest spec, a YAML or JSON file.")


@harvest_app.command("submit")
def submit(
    spec: Path = SpecArgument,
    dataset: Path | None = typer.Option(None, exists=True, dir_okay=False, help="A local file to upload and harvest."),
    wait: bool = typer.Option(False, "--wait", help="Follow the harvest until it ends."),
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Submit SPEC; print the harvest's id (and follow it with --wait)."""
    with connected(url, api_key) as client:
        harvest = client.harvest(spec, dataset)
        console.print(f"harvest {harvest.id} queued: {harvest.info['progress']['chunks_total']} chunks")
        if wait:
            _wait(harvest)


@harvest_app.command("status")
def status(
    harvest_id: str = typer.Argument(..., help="The harvest's id."),
    wait: bool = typer.Option(False, "--wait", help="Follow it with a progress bar until it ends."),
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Show a harvest: status, chunks, prompts, tokens, bytes, tokens/s, ETA, error."""
    with connected(url, api_key) as client:
        harvest = client.get_harvest(harvest_id)
        if wait and not harvest.done:
            _wait(harvest)
    console.print(_table([harvest]))


@harvest_app.command("list")
def list_harvests(
    status_filter: str | None = typer.Option(None, "--status", help="Only harvests with this status."),
    limit: int = typer.Option(20, min=1, max=200),
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """List your harvests, newest first."""
    with connected(url, api_key) as client:
        harvests = client.harvests(status=status_filter, limit=limit)
    console.print(_table(harvests) if harvests else "no harvests")


@harvest_app.command("cancel")
def cancel(harvest_id: str, url: str | None = UrlOption, api_key: str | None = KeyOption) -> None:
    """Cancel a harvest: its queued chunks never run, its running ones are aborted."""
    with connected(url, api_key) as client:
        harvest = client.get_harvest(harvest_id).cancel()
    console.print(f"harvest {harvest.id} is {status_text(harvest.info)}")


@harvest_app.command("manifest")
def manifest(harvest_id: str, url: str | None = UrlOption, api_key: str | None = KeyOption) -> None:
    """Print a completed harvest's manifest.json."""
    with connected(url, api_key) as client:
        typer.echo(json.dumps(client.get_harvest(harvest_id).manifest(), indent=1))


@harvest_app.command("download")
def download(
    harvest_id: str,
    directory: Path = typer.Argument(..., help="Where to put the shards and manifest.json."),
    parallel: int = typer.Option(4, min=1, help="Shards downloaded at once."),
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Download a completed harvest's shards (resumable: verified shards already there are kept)."""
    with connected(url, api_key) as client:
        target = client.get_harvest(harvest_id).download(directory, parallel=parallel)
    console.print(f"shards and manifest.json in {target}; load a shard with safetensors.safe_open(path, 'pt')")


@schedules_app.command("create")
def create_schedule(
    name: str,
    spec: Path = SpecArgument,
    cron: str = typer.Option(..., help="When to run: five fields ('0 3 * * *', UTC), or six with seconds last."),
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Create a schedule that starts a harvest of SPEC at each time CRON names."""
    with connected(url, api_key) as client:
        schedule = client.create_schedule(name, cron, spec)
    console.print(f"schedule {schedule['id']} ({escape(name)}) first runs at {local_time(schedule['next_run_at'])}")


@schedules_app.command("list")
def list_schedules(url: str | None = UrlOption, api_key: str | None = KeyOption) -> None:
    """List your schedules."""
    with connected(url, api_key) as client:
        schedules = client.schedules()
    table = Table("id", "name", "cron", "state", "next run", "runs", "last harvest", "last error")
    for item in schedules:
        table.add_row(
            str(item["id"]),
            escape(item["name"]),
            item["cron"],
            "paused" if item["paused"] else "active",
            local_time(item["next_run_at"]),
            str(item["runs"]),
            str(item["last_harvest_id"] or ""),
            escape(item["last_error"] or ""),
        )
    console.print(table if schedules else "no schedules")


@schedules_app.command("pause")
def pause(schedule_id: int, url: str | None = UrlOption, api_key: str | None = KeyOption) -> None:
    """Pause a schedule: it starts no runs until resumed."""
    with connected(url, api_key) as client:
        client.pause_schedule(schedule_id)
    console.print(f"schedule {schedule_id} paused")


@schedules_app.command("resume")
def resume(schedule_id: int, url: str | None = UrlOption, api_key: str | None = KeyOption) -> None:
    """Resume a schedule from its next time on (times missed while paused are skipped)."""
    with connected(url, api_key) as client:
        schedule = client.resume_schedule(schedule_id)
    console.print(f"schedule {schedule_id} resumed; next run at {local_time(schedule['next_run_at'])}")


@schedules_app.command("delete")
def delete(schedule_id: int, url: str | None = UrlOption, api_key: str | None = KeyOption) -> None:
    """Delete a schedule; the harvests it started go on."""
    with connected(url, api_key) as client:
        client.delete_schedule(schedule_id)
    console.print(f"schedule {schedule_id} deleted")


def _wait(harvest: Harvest) -> None:
    try:
        harvest.wait()
    except HarvestFailed as failure:
        console.print(f"[red]{escape(str(failure))}[/red]")
        raise typer.Exit(1) from None


def _table(harvests: list[Harvest]) -> Table:
    table = Table("id", "model", "status", "chunks", "prompts", "tokens", "bytes", "tokens/s", "ETA s", "error")
    for harvest in harvests:
        progress: dict[str, Any] = harvest.info.get("progress") or {}
        rate, eta = progress.get("tokens_per_s"), progress.get("eta_s")
        table.add_row(
            harvest.id,
            escape(str(harvest.info.get("model_key"))),
            status_text(harvest.info),
            f"{progress.get('chunks_done', 0)}/{progress.get('chunks_total', 0)}",
            f"{progress.get('prompts_done', 0)}/{progress.get('prompts_total', 0)}",
            f"{progress.get('tokens', 0):,}",
            f"{progress.get('bytes', 0):,}",
            f"{rate:,.0f}" if rate else "",
            f"{eta:,.0f}" if eta is not None else "",
            escape((harvest.info.get("error") or {}).get("message", "")),
        )
    return table
