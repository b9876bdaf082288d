"""A submitted job as the client sees it: its last known state, waiting with a progress display, its result."""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)

from nnqueue.client.errors import IntegrityError, JobCancelled, JobFailed
from nnqueue.client.waiting import TERMINAL, wait_until_ended

if TYPE_CHECKING:
    import httpx

    from nnqueue.client.transport import Transport

CHUNK_SIZE = 1 << 20


class Job:
    """One job. ``info`` is the API's last answer about it (the Job JSON); `status` refreshes it.
    ``console`` shows the progress displays (default: stderr)."""

    def __init__(self, transport: Transport, info: dict[str, Any], console: Console | None = None) -> None:
        self.transport = transport
        self.info = info
        self.console = console or Console(stderr=True)

    @property
    def id(self) -> str:
        return str(self.info["id"])

    @property
    def model_key(self) -> str:
        return str(self.info.get("model_key", ""))

    @property
    def weights_version(self) -> str | None:
        """The weights version the job ran on (once it ended; None before, or on an API without versions)."""
        return self.info.get("weights_version")

    @property
    def done(self) -> bool:
        """Whether the last known status is final (completed, failed or cancelled); does not refresh."""
        return self.info.get("status") in TERMINAL

    def __repr__(self) -> str:
        return f"<Job {self.id} {self.info.get('status')} model={self.model_key!r}>"

    # -- state ----------------------------------------------------------------------------------

    def refresh(self) -> dict[str, Any]:
        self.info = self.transport.get_json(f"/v1/jobs/{self.id}")
        return self.info

    def status(self) -> str:
        """Ask the API for the job's current status (queued, running, completed, failed, cancelled)."""
        return str(self.refresh()["status"])

    def cancel(self) -> Job:
        """Cancel the job (queued: it never runs; running: its requests are aborted). 409 if it had ended."""
        self.info = self.transport.request("POST", f"/v1/jobs/{self.id}/cancel").json()
        return self

    def cancel_quietly(self) -> None:
        """Cancel it if it may still run, ignoring any failure: for callers on their way out (Ctrl-C)."""
        try:
            if not self.done:
                self.cancel()
        except Exception:  # noqa: BLE001 - best effort while interrupted
            pass

    def raise_for_status(self) -> None:
        """Raise :class:`JobFailed` / :class:`JobCancelled` if the last known status says so."""
        status = self.info.get("status")
        if status == "failed":
            raise JobFailed.from_job(self)
        if status == "cancelled":
            raise JobCancelled(self)

    # -- waiting --------------------------------------------------------------------------------

    def wait(self, timeout: float | None = None, progress: bool = True, *, poll_interval: float | None = None) -> Job:
        """Poll until the job ends; show its queue position and progress while ``progress``.

        Returns the job once COMPLETED. Raises :class:`JobFailed` (the worker's error type, message and
        traceback) or :class:`JobCancelled`, and :class:`WaitTimeout` after ``timeout`` seconds.
        """
        with _WaitDisplay(self, self.console, enabled=progress) as display:
            wait_until_ended(self, timeout, display.update, poll_interval=poll_interval)
        self.raise_for_status()
        return self

    # -- results --------------------------------------------------------------------------------

    def result(
        self, timeout: float | None = None, progress: bool = True, *, inline: bool | None = None
    ) -> dict[str, Any]:
        """Wait for the job, download its result and load it: the saves dict ``{name: value}``.

        A failed trace raises :class:`JobFailed`; its ``saves`` are what the trace's other invokes saved
        before the error (None when nothing was). Loading unpickles (``torch.load(weights_only=False)``):
        load only results of jobs you trust.
        """
        if not self.done or self.info.get("status") != "completed":
            try:
                self.wait(timeout, progress)
            except JobFailed as failure:
                if self.info.get("result"):
                    failure.saves = self._load(progress, inline)
                raise
        return self._load(progress, inline)

    def _load(self, progress: bool, inline: bool | None) -> dict[str, Any]:
        import torch

        with tempfile.SpooledTemporaryFile(max_size=64 << 20) as spool:
            # A bar only where it helps: small results arrive before it could draw.
            self._download_to(spool, progress=progress, inline=inline, bar_from=4 * CHUNK_SIZE)
            spool.seek(0)
            return torch.load(spool, map_location="cpu", weights_only=False)

    def download(
        self,
        path: str | os.PathLike[str],
        progress: bool = True,
        *,
        wait: bool = True,
        timeout: float | None = None,
        inline: bool | None = None,
        format: str = "torch",  # noqa: A002 - the API's name
    ) -> Path:
        """Stream the result (``torch.save`` bytes of the saves dict; ``format="safetensors"``: its safetensors
        copy, for a job submitted with ``safetensors=True``) to ``path`` and return the file's path.

        ``path`` may be a directory (the file is then ``<job id>.pt`` or ``.safetensors`` in it). With ``wait``
        (default) a job that has not finished is waited for first. The file appears only once complete and
        checked against the sha256 the worker recorded (:class:`IntegrityError` otherwise).
        """
        target = Path(path)
        if target.is_dir():
            target = target / f"{self.id}.{'pt' if format == 'torch' else 'safetensors'}"
        if wait and not (self.done and self.info.get("status") == "completed"):
            self.wait(timeout, progress)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".part")
        try:
            with open(partial, "wb") as file:
                self._download_to(file, progress=progress, inline=inline, format=format)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        return target

    def _download_to(
        self,
        file: IO[bytes],
        *,
        progress: bool,
        inline: bool | None,
        bar_from: int = 0,
        format: str = "torch",  # noqa: A002 - the API's name
    ) -> int:
        """Stream the result into ``file``, checked against the size and sha256 the worker recorded (the job's
        JSON, else the download's ``Digest`` header); raises :class:`IntegrityError` when they differ."""
        recorded = self.info.get("result") or {}
        if format != "torch":
            recorded = recorded.get(format) or {}
        expected, sha256 = recorded.get("size"), recorded.get("sha256")
        digest, written = hashlib.sha256(), 0
        with self.transport.result_stream(self.id, inline=inline, format=format) as response:
            sha256 = sha256 or digest_header(response.headers.get("digest"))
            total = _content_length(response) or expected
            show = progress and (total is None or total >= bar_from)
            with _download_bar(self.console, f"job {self.id[:8]} result", total, show) as advance:
                for chunk in response.iter_bytes(CHUNK_SIZE):
                    file.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    advance(len(chunk))
        what = f"the {format} result of job {self.id}"
        if expected is not None and written != expected:
            raise IntegrityError(what, f"{expected} bytes", f"{written} bytes")
        if sha256 and digest.hexdigest() != sha256:
            raise IntegrityError(what, f"sha256 {sha256}", f"sha256 {digest.hexdigest()}")
        return written


def digest_header(value: str | None) -> str | None:
    """The hex sha256 in a ``Digest: sha-256=<base64>`` header (RFC 3230), or None."""
    for item in (value or "").split(","):
        name, _, encoded = item.strip().partition("=")
        if name.lower() == "sha-256" and encoded:
            try:
                return base64.b64decode(encoded, validate=True).hex()
            except ValueError:
                return None
    return None


def _content_length(response: httpx.Response) -> int | None:
    try:
        return int(response.headers["content-length"])
    except (KeyError, ValueError):
        return None


@contextmanager
def _download_bar(console: Console, label: str, total: int | None, enabled: bool) -> Iterator[Any]:
    if not enabled:
        yield lambda n: None
        return
    columns = (
        TextColumn("[bold blue]⬇ {task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


class _WaitDisplay:
    """A one-line live status: spinner, job id, queued (position) / running (done of total) / final."""

    def __init__(self, job: Job, console: Console, enabled: bool) -> None:
        self.job, self.enabled = job, enabled
        self.started = time.monotonic()
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        if enabled:
            self.progress = Progress(
                SpinnerColumn(finished_text="[green]✓"),
                TextColumn("[bold]job {task.fields[short]}[/bold] {task.description}"),
                BarColumn(),
                TextColumn("{task.fields[count]}"),
                TimeElapsedColumn(),
                console=console,
            )

    def __enter__(self) -> _WaitDisplay:
        if self.progress is not None:
            self.progress.start()
            self.task = self.progress.add_task("submitted", total=None, short=self.job.id[:8], count="")
        return self

    def update(self, info: dict[str, Any]) -> None:
        if self.progress is None or self.task is None:
            return
        status = info.get("status")
        progress = info.get("progress") or {}
        done, total = progress.get("done") or 0, progress.get("total")
        count = f"{done}/{total} invokes" if total else ""
        if status == "queued":
            position = info.get("queue_position")
            where = f"position {position}" if position is not None else "waiting for a worker"
            self.progress.update(self.task, description=f"[yellow]queued[/yellow] ({where})", total=None, count="")
        elif status == "running":
            self.progress.update(
                self.task, description="[cyan]running[/cyan]", total=total, completed=done, count=count
            )
        elif status == "completed":
            size = (info.get("result") or {}).get("size")
            what = f", result {_human_bytes(size)}" if size is not None else ""
            self.progress.update(
                self.task,
                description=f"[green]completed[/green]{what}",
                total=total or 1,
                completed=total or 1,
                count=count,
            )
        elif status in ("failed", "cancelled"):
            error = info.get("error") or {}
            why = f": {error.get('type')}" if error.get("type") else ""
            self.progress.update(
                self.task, description=f"[red]{status}{why}[/red]", total=total or 1, completed=done, count=count
            )

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"
