"""``nnqueue harvest ...`` and ``nnqueue schedules ...``: declarative harvests and their recurring schedules.

nnqueue harvest submit spec.yaml [--dataset corpus.jsonl] [--wait] [--dry-run]
nnqueue harvest status ID [--wait]          # progress bar: chunks, prompts, tokens/s, ETA
nnqueue harvest list | cancel ID | manifest ID
nnqueue harvest inspect ID [--rows 3]       # per-capture statistics, shapes, dtype, a few rows
nnqueue harvest download ID DIR [--parallel 4]
nnqueue harvest export ID DEST --format saelens|hf [--context-size 128] [--hook-names module|transformer-lens]
                                            # DEST: a local folder or s3://bucket/prefix
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

from nnqueue.client.cli_common import (
    JsonOption,
    KeyOption,
    UrlOption,
    connected,
    console,
    local_time,
    print_json,
    print_table,
    show,
    status_text,
)
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
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Only estimate: tokens, rows, bytes, shards and duration; nothing is queued."
    ),
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Submit SPEC; print the harvest's id (and follow it with --wait), or with --dry-run its estimate."""
    with connected(url, api_key) as client:
        if dry_run:
            found = client.estimate_harvest(spec, dataset)
            duration = found["duration_s"]
            console.print(
                f"{found['prompts']:,} prompts, {'' if found['tokens_exact'] else '~'}{found['tokens']:,} tokens, "
                f"{found['rows']:,} rows, {found['bytes']:,} bytes in {found['shards']:,} shards; "
                + (
                    f"about {duration:,.0f} s at {found['tokens_per_s']:,.0f} tokens/s"
                    if duration
                    else "duration unknown"
                )
            )
            for note in found["notes"]:
                console.print(f"  {escape(note)}")
            return
        harvest = client.harvest(spec, dataset)
        console.print(f"harvest {harvest.id} queued: {harvest.info['progress']['chunks_total']} chunks")
        if wait:
            _wait(harvest)


HarvestId = typer.Argument(..., help="The harvest's id, or its first characters.")


@harvest_app.command("status")
def status(
    harvest_id: str = HarvestId,
    wait: bool = typer.Option(False, "--wait", help="Follow it with a progress bar until it ends."),
    as_json: bool = JsonOption,
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Show a harvest: status, chunks, prompts, tokens, bytes, tokens/s, ETA, error."""
    with connected(url, api_key) as client:
        harvest = client.get_harvest(harvest_id)
        if wait and not harvest.done:
            try:
                harvest.wait(progress=not as_json)
            except HarvestFailed:
                pass  # shown below; the exit status says it
    show(harvest.info, as_json, lambda: _table([harvest]))
    if wait and harvest.status != "completed":
        raise typer.Exit(1)


@harvest_app.command("list")
def list_harvests(
    status_filter: str | None = typer.Option(None, "--status", help="Only harvests with this status."),
    limit: int = typer.Option(20, min=1, max=200),
    as_json: bool = JsonOption,
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """List your harvests, newest first."""
    with connected(url, api_key) as client:
        harvests = client.harvests(status=status_filter, limit=limit)
    show([harvest.info for harvest in harvests], as_json, lambda: _table(harvests) if harvests else "no harvests")


@harvest_app.command("cancel")
def cancel(harvest_id: str = HarvestId, url: str | None = UrlOption, api_key: str | None = KeyOption) -> None:
    """Cancel a harvest: its queued chunks never run, its running ones are aborted."""
    with connected(url, api_key) as client:
        harvest = client.get_harvest(harvest_id).cancel()
    console.print(f"harvest {harvest.id} is {status_text(harvest.info)}")


@harvest_app.command("manifest")
def manifest(harvest_id: str = HarvestId, url: str | None = UrlOption, api_key: str | None = KeyOption) -> None:
    """Print a completed harvest's manifest.json."""
    with connected(url, api_key) as client:
        typer.echo(json.dumps(client.get_harvest(harvest_id).manifest(), indent=1))


@harvest_app.command("inspect")
def inspect(
    harvest_id: str = HarvestId,
    rows: int = typer.Option(3, min=0, help="Rows of the first shard to print."),
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Print a completed harvest's per-capture statistics, shapes and dtype, and its first rows."""
    with connected(url, api_key) as client:
        harvest = client.get_harvest(harvest_id)
        manifest = harvest.manifest()
        shards = harvest.shards()
        first = harvest.shard_bytes(shards[0]) if rows and shards else None
    show_manifest(manifest)
    if first is not None:
        show_rows(first, rows)


def show_manifest(manifest: dict[str, Any]) -> None:
    """The manifest's provenance and per-capture statistics, as tables."""
    spec = manifest["spec"]
    console.print(
        f"harvest {manifest['harvest_id']}: model {escape(str(manifest.get('model')))} "
        f"(revision {manifest.get('revision')}), dtype {spec['dtype']}, selection {spec['selection']}"
    )
    console.print(
        f"{manifest['rows']:,} rows from {manifest['tokens']:,} tokens of {manifest['dataset']['prompts']:,} prompts, "
        f"{manifest['bytes']:,} bytes in {len(manifest['shards'])} shards"
    )
    table = Table(
        "capture", "shape", "dtype", "|mean|", "mean std", "norm p1", "p50", "p99", "max", "NaN", "Inf", "bad rows"
    )
    for key, stats in sorted((manifest.get("statistics") or {}).items()):
        norm, percentiles = stats["norm"], stats["norm"]["percentiles"]
        width = max(stats["width"], 1)
        table.add_row(
            escape(key),
            f"[{manifest['rows']:,}, {stats['width']}]",
            spec["dtype"],
            f"{sum(m * m for m in stats['mean']) ** 0.5:.4g}",
            f"{sum(stats['std']) / width:.4g}",
            *(f"{percentiles.get(p, float('nan')):.4g}" for p in ("p1", "p50", "p99")),
            f"{norm['max']:.4g}",
            str(stats["nan"]),
            str(stats["inf"]),
            str(stats["nonfinite_rows"]),
        )
    console.print(table)


def show_rows(shard: bytes, count: int) -> None:
    """The first ``count`` rows of a shard: prompt, position, token and the first values of each capture."""
    from safetensors.torch import load

    tensors = load(shard)
    columns = ("prompt_index", "token_position", "token_id")
    table = Table(*columns, *(escape(name) for name in sorted(tensors) if name not in columns))
    for row in range(min(count, len(tensors["prompt_index"]))):
        values = [
            ", ".join(f"{v:.4g}" for v in tensors[name][row, :4].float().tolist()) + ", ..."
            for name in sorted(tensors)
            if name not in columns
        ]
        table.add_row(*(str(int(tensors[name][row])) for name in columns), *values)
    console.print(table)


@harvest_app.command("download")
def download(
    harvest_id: str = HarvestId,
    directory: Path = typer.Argument(..., help="Where to put the shards and manifest.json."),
    parallel: int = typer.Option(4, min=1, help="Shards downloaded at once."),
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Download a completed harvest's shards (resumable: verified shards already there are kept)."""
    with connected(url, api_key) as client:
        target = client.get_harvest(harvest_id).download(directory, parallel=parallel)
    console.print(f"shards and manifest.json in {target}; load a shard with safetensors.safe_open(path, 'pt')")


@harvest_app.command("export")
def export_command(
    harvest_id: str = HarvestId,
    dest: str = typer.Argument(
        ...,
        help="A new or empty local folder, or s3://bucket/prefix (credentials and endpoint from the AWS environment:"
        " AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL).",
    ),
    fmt: str = typer.Option(
        "saelens", "--format", help="saelens (SAELens's cached activations) or hf (one row per harvested row)."
    ),
    context_size: int = typer.Option(128, min=1, help="saelens: tokens per sequence (rows are packed)."),
    hook_names: str = typer.Option(
        "module",
        help="saelens/hf column names: module (model.layers.12) or transformer-lens (blocks.12.hook_resid_post).",
    ),
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Write a completed harvest as a Hugging Face datasets folder (datasets.load_from_disk opens it)."""
    if fmt not in ("saelens", "hf") or hook_names not in ("module", "transformer-lens"):
        raise typer.BadParameter("--format is saelens or hf; --hook-names is module or transformer-lens")
    from nnqueue.client.harvest_export import ExportError, export  # numpy and more: not every command's

    with connected(url, api_key) as client:
        try:
            report = export(client.get_harvest(harvest_id), dest, fmt, context_size, hook_names)  # type: ignore[arg-type]
        except ExportError as error:
            console.print(f"[red]{escape(str(error))}[/red]")
            raise typer.Exit(1) from None
    columns = ", ".join(f"{key} -> {column}" for key, column in report.columns.items())
    console.print(f"{report.rows:,} rows in {dest} ({fmt}); columns {escape(columns)}")
    if fmt == "saelens":
        console.print(
            f"{report.sequences:,} sequences of {context_size} tokens; {report.dropped_rows} rows left over at the "
            f"end were dropped; token sequences for SAELens's dataset in {str(dest).rstrip('/')}/tokens"
        )
    if report.dtype["harvested"] != report.dtype["exported"]:
        console.print(f"{report.dtype['harvested']} stored as {report.dtype['exported']} (Arrow has no bfloat16)")


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
def list_schedules(as_json: bool = JsonOption, url: str | None = UrlOption, api_key: str | None = KeyOption) -> None:
    """List your schedules."""
    with connected(url, api_key) as client:
        schedules = client.schedules()
    if as_json:
        print_json(schedules)
        return
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
    print_table(table if schedules else "no schedules")


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
