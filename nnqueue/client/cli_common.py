"""What every client command shares: the ``--url``, ``--api-key`` and ``--json`` options, the consoles, connecting
to the API (an nnqueue error exits 1 with its message) and the rendering of tables, a status and a time.

A table printed to a terminal fits its width; printed anywhere else (a pipe, a file) it takes the width its
contents need, so no id or message is cut where a script reads it. ``--json`` prints what the API answered.

The job commands (:mod:`nnqueue.client.cli`) and the harvest and schedule groups
(:mod:`nnqueue.client.harvest_cli`) both build on it, so neither imports the other's module for them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from nnqueue.client.client import Client
from nnqueue.client.errors import APIConnectionError, NNqueueError

console = Console()
err_console = Console(stderr=True)

UrlOption = typer.Option(None, "--url", envvar="NNQUEUE_URL", help="The API's URL (NNQUEUE_URL).", show_default=False)
KeyOption = typer.Option(
    None, "--api-key", envvar="NNQUEUE_API_KEY", help="Your API key (NNQUEUE_API_KEY).", show_default=False
)
# Top-level modules of the trace extra (nnsight and what it brings): `pip install nnqueue` has none of them.
TRACE_MODULES = frozenset({"nnsight", "torch", "numpy", "safetensors", "transformers"})
TRACE_EXTRA_HINT = "pip install 'nnqueue[trace]' (nnsight and torch; docs/getting-started.md says which torch)"
JsonOption = typer.Option(False, "--json", help="Print what the API answered, as JSON (for scripts).")
STATUS_STYLE = {"queued": "yellow", "running": "cyan", "completed": "green", "failed": "red", "cancelled": "magenta"}


@contextmanager
def connected(url: str | None, api_key: str | None) -> Iterator[Client]:
    """The API's client; an nnqueue error in the block (HTTP, connection, job) exits 1 with its message."""
    try:
        with Client.from_env(url=url, api_key=api_key) as client:
            yield client
    except NNqueueError as error:
        err_console.print(f"[red]{type(error).__name__}:[/red] {escape(str(error))}", highlight=False)
        if isinstance(error, APIConnectionError):
            err_console.print(
                "is an API running there? `nnqueue up` runs one on this machine; --url or NNQUEUE_URL names another"
            )
        raise typer.Exit(1) from None


def print_table(table: Table | str) -> None:
    """``table`` on stdout: as wide as the terminal, or as wide as its contents when stdout is not a terminal."""
    if isinstance(table, str) or console.is_terminal:
        console.print(table)
        return
    natural = Measurement.get(console, console.options.update_width(1_000_000), table).maximum
    Console(file=console.file, width=max(natural, console.width)).print(table)


def print_json(value: Any) -> None:
    """``value`` (what the API answered) as JSON on stdout."""
    typer.echo(json.dumps(value, indent=1))


def show(answer: Any, as_json: bool, table: Callable[[], Table | str]) -> None:
    """What the API answered, as JSON with ``--json``; else ``table()`` (built only then), as `print_table` prints."""
    if as_json:
        print_json(answer)
    else:
        print_table(table())


def status_text(info: dict[str, Any]) -> str:
    value = str(info.get("status"))
    style = STATUS_STYLE.get(value, "")
    return f"[{style}]{value}[/{style}]" if style else value


def local_time(value: str | None) -> str:
    if not value:
        return ""
    try:
        return datetime.fromisoformat(value).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return value
