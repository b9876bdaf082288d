"""``nnqueue harvest ...`` and ``nnqueue schedules ...``: declarative harvests and their recurring schedules.

nnqueue harvest submit spec.yaml [--dataset corpus.jsonl] [--wait] [--dry-run]
nnqueue harvest status ID [--wait]          # progress bar: chunks, prompts, tokens/s, ETA
nnqueue harvest list | cancel ID | manifest ID
nnqueue harvest inspect ID [--rows 3]       # per-capture statistics, shapes, dtype, a few rows
nnqueue harvest download ID DIR [--parallel 4]
nnqueue harvest export ID DEST --format saelens|hf [--context-size 128] [--hook-names module|transformer-lens]
                       [--drop-norm-above 10x | --clip-norm-above 1500] [--batch-size-tokens 4096] [--model-name M]
                                            # DEST: a local folder or s3://bucket/prefix
nnqueue schedules create NAME --cron '0 3 * * *' spec.yaml
nnqueue schedules list | pause ID | resume ID | delete ID
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from nnqueue.outliers import Outliers

if TYPE_CHECKING:
    from nnqueue.client.harvest_export import ExportReport

harvest_app = typer.Typer(help="Declarative activation harvests: submit a spec, follow it, download its shards.")
schedules_app = typer.Typer(help="Recurring harvests, fired by `nnqueue beat`.")
SpecArgument = typer.Argument(..., exists=True, dir_okay=False, help="The harvest spec, a YAML or JSON file.")
# `harvest inspect` flags rows whose norm is over this multiple of their capture's median norm.
FLAG_TIMES_MEDIAN = 10


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
        "capture",
        "shape",
        "dtype",
        "|mean|",
        "mean std",
        "norm p1",
        "p50",
        "p99",
        "max",
        f"> {FLAG_TIMES_MEDIAN}x p50",
        "NaN",
        "Inf",
        "bad rows",
    )
    flags = []
    for key, stats in sorted((manifest.get("statistics") or {}).items()):
        norm, percentiles = stats["norm"], stats["norm"]["percentiles"]
        width = max(stats["width"], 1)
        over, share = norm_outliers(stats, FLAG_TIMES_MEDIAN)
        if over:
            flags.append(
                f"[yellow]{escape(key)}: at least {over:,} rows have a norm over {FLAG_TIMES_MEDIAN}x its median "
                f"(the largest {norm['max'] / max(percentiles.get('p50', 0.0), 1e-30):,.0f}x), about {share:.0%} of "
                "the squared norm[/yellow]"
            )
        table.add_row(
            escape(key),
            f"[{manifest['rows']:,}, {stats['width']}]",
            spec["dtype"],
            f"{sum(m * m for m in stats['mean']) ** 0.5:.4g}",
            f"{sum(stats['std']) / width:.4g}",
            *(f"{percentiles.get(p, float('nan')):.4g}" for p in ("p1", "p50", "p99")),
            f"{norm['max']:.4g}",
            f"[yellow]{over:,}[/yellow]" if over else "0",
            str(stats["nan"]),
            str(stats["inf"]),
            str(stats["nonfinite_rows"]),
        )
    console.print(table)
    handled = manifest.get("outliers")
    if handled:
        option = Outliers.from_report(handled)
        console.print(
            f"outliers: {option.describe()}{' of each chunk' if option.times_median else ''}: "
            f"{handled['dropped_rows']:,} rows dropped; over the "
            f"limit: {escape(', '.join(f'{key} {count:,}' for key, count in handled['over'].items()))}"
        )
    for flag in flags:
        console.print(flag)
    if flags:
        console.print(
            f"  (attention sinks?) leave them out with `nnqueue harvest export ... --drop-norm-above "
            f"{FLAG_TIMES_MEDIAN}x`, nnqueue.harvest.open(..., outliers=...), or the spec's `outliers: "
            f"{{action: drop, times_median: {FLAG_TIMES_MEDIAN}}}`"
        )


def norm_outliers(stats: dict[str, Any], times_median: float) -> tuple[int, float]:
    """Rows of a capture's manifest statistics whose norm is over ``times_median`` times the median, read off the
    norm histogram: at least this many (the bins wholly above the limit), and about what share of the squared norm
    they hold (each counted at its bin's middle)."""
    norm = stats["norm"]
    median, histogram = norm["percentiles"].get("p50"), norm["histogram"]
    if not median or not stats["count"]:
        return 0, 0.0
    low, per_decade = histogram["low_decade"], histogram["bins_per_decade"]
    limit, over, squares = times_median * median, 0, 0.0
    for index, count in enumerate(histogram["counts"][1:], 1):  # bin i starts at 10 ** (low + (i - 1) / per_decade)
        if count and 10 ** (low + (index - 1) / per_decade) >= limit:
            over += count
            squares += count * min(10 ** (low + (index - 0.5) / per_decade), norm["max"]) ** 2
    return over, squares / (norm["mean_square"] * stats["count"]) if norm["mean_square"] else 0.0


def show_rows(shard: bytes, count: int) -> None:
    """The first ``count`` rows of a shard: prompt, position, token, prompt length, whether generated, and the first
    values of each capture."""
    from safetensors.torch import load

    tensors = load(shard)
    known = ("prompt_index", "token_position", "token_id", "prompt_length", "generated")
    columns = [name for name in known if name in tensors]
    table = Table(*columns, *(escape(name) for name in sorted(tensors) if name not in columns))
    for row in range(min(count, len(tensors["prompt_index"]))):
        values = [
            ", ".join(f"{v:.4g}" for v in tensors[name][row, :4].float().tolist()) + ", ..."
            for name in sorted(tensors)
            if name not in columns
        ]
        table.add_row(*(str(tensors[name][row].item()) for name in columns), *values)
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
    drop_norm_above: str | None = typer.Option(
        None,
        help="Leave out rows whose norm is over this: a norm (1500) or a multiple of the capture's median norm (10x).",
    ),
    clip_norm_above: str | None = typer.Option(
        None, help="Scale rows whose norm is over this down to it: a norm (1500) or a multiple of the median (10x)."
    ),
    batch_size_tokens: int | None = typer.Option(
        None,
        min=1,
        help="saelens: SAELens's train_batch_size_tokens (sizes the sae_lens block's buffer; default SAELens's, 4096).",
    ),
    model_name: str | None = typer.Option(
        None,
        help="saelens: the model SAELens loads (default: the manifest's repository, or the model's folder relative to"
        " the worker's directory).",
    ),
    url: str | None = UrlOption,
    api_key: str | None = KeyOption,
) -> None:
    """Write a completed harvest as a Hugging Face datasets folder (datasets.load_from_disk opens it)."""
    if fmt not in ("saelens", "hf") or hook_names not in ("module", "transformer-lens"):
        raise typer.BadParameter("--format is saelens or hf; --hook-names is module or transformer-lens")
    if drop_norm_above is not None and clip_norm_above is not None:
        raise typer.BadParameter("give --drop-norm-above or --clip-norm-above, not both")
    # numpy and the rest: loaded when an export runs, not by every command (the client runs without them)
    from nnqueue.client.harvest_export import ExportError, ExportOptions, export, require_train_extra

    try:
        require_train_extra()
        limit = drop_norm_above or clip_norm_above
        outliers = Outliers.parse("drop" if drop_norm_above else "clip", limit) if limit is not None else None
    except (ExportError, ValueError) as error:
        console.print(f"[red]{escape(str(error))}[/red]")
        raise typer.Exit(1) from None
    batch = {} if batch_size_tokens is None else {"batch_size_tokens": batch_size_tokens}
    options = ExportOptions(context_size, hook_names, outliers, model_name=model_name, **batch)  # type: ignore[arg-type]
    with connected(url, api_key) as client:
        try:
            report = export(client.get_harvest(harvest_id), dest, fmt, options)  # type: ignore[arg-type]
        except ExportError as error:
            console.print(f"[red]{escape(str(error))}[/red]")
            raise typer.Exit(1) from None
    show_export(report, dest, context_size)


def show_export(report: ExportReport, dest: str, context_size: int) -> None:
    """An export's summary: rows, columns, sequences, the dtype, generated rows, outliers, the sae_lens block."""
    columns = ", ".join(f"{key} -> {column}" for key, column in report.columns.items())
    console.print(f"{report.rows:,} rows in {dest} ({report.format}); columns {escape(columns)}")
    if report.format == "saelens":
        console.print(
            f"{report.sequences:,} sequences of {context_size} tokens; {report.dropped_rows} rows left over at the "
            f"end were dropped; token sequences for SAELens's dataset in {str(dest).rstrip('/')}/tokens"
        )
    if report.dtype["harvested"] != report.dtype["exported"]:
        console.print(f"{report.dtype['harvested']} stored as {report.dtype['exported']} (Arrow has no bfloat16)")
    if report.generated_rows:
        console.print(f"{report.generated_rows:,} of the rows are of generated tokens (the generated column)")
    if report.outliers is not None:
        option = Outliers.from_report(report.outliers)
        over = ", ".join(
            f"{key} over {report.outliers['limits'][key]:,.4g}: {count:,}"
            for key, count in report.outliers["over"].items()
        )
        console.print(
            f"outliers: {option.describe()}: {escape(over)}; {report.outliers['dropped_rows']:,} rows dropped"
        )
    block = report.sae_lens
    if block is not None:
        console.print(
            f"SAELens (nnqueue_export.json's sae_lens): hook_name {escape(block['hook_name'])}, d_in {block['d_in']}, prepend_bos "
            f"{block['prepend_bos']}, n_batches_in_buffer {block['n_batches_in_buffer']} for batches of "
            f"{block['train_batch_size_tokens']:,} tokens, model_name {escape(str(block['model_name']))}"
        )
        if block["model_name"] is None:
            console.print(
                "[yellow]the harvested model's folder is outside the worker's directory: give SAELens the model"
                " with --model-name (its folder or repository here)[/yellow]"
            )
        if report.rows < block["train_batch_size_tokens"]:
            console.print(
                f"[yellow]fewer rows ({report.rows:,}) than one training batch: lower --batch-size-tokens[/yellow]"
            )


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
