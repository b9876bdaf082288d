"""What every client command shares: the ``--url`` and ``--api-key`` options, the consoles, connecting to
the API (an nnqueue error exits 1 with its message) and the rendering of a status and a time.

The job commands (:mod:`nnqueue.client.cli`) and the harvest and schedule groups
(:mod:`nnqueue.client.harvest_cli`) both build on it, so neither imports the other's module for them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from nnqueue.client.client import Client
from nnqueue.client.errors import NNqueueError

console = Console()
err_console = Console(stderr=True)

UrlOption = typer.Option(None, "--url", envvar="NNQUEUE_URL", help="The API's URL (NNQUEUE_URL).", show_default=False)
KeyOption = typer.Option(
    None, "--api-key", envvar="NNQUEUE_API_KEY", help="Your API key (NNQUEUE_API_KEY).", show_default=False
)
STATUS_STYLE = {"queued": "yellow", "running": "cyan", "completed": "green", "failed": "red", "cancelled": "magenta"}


@contextmanager
def connected(url: str | None, api_key: str | None) -> Iterator[Client]:
    """The API's client; an nnqueue error in the block (HTTP, connection, job) exits 1 with its message."""
    try:
        with Client.from_env(url=url, api_key=api_key) as client:
            yield client
    except NNqueueError as error:
        err_console.print(f"[red]{type(error).__name__}:[/red] {escape(str(error))}", highlight=False)
        raise typer.Exit(1) from None


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
