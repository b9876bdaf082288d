"""A submitted harvest as the client sees it: its state, waiting with a progress bar, its manifest and shards.

harvest = client.harvest("spec.yaml")                  # or a dict; dataset="corpus.jsonl" uploads a file
harvest.wait()                                         # rich bar: chunks, prompts, tokens/s, ETA
harvest.download("out/")                               # parallel, resumable, sha256-checked
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from nnqueue.client.errors import APIError, HarvestFailed, IntegrityError
from nnqueue.client.resource import Resource
from nnqueue.client.transport import Transport
from nnqueue.client.waiting import wait_until_ended

CHUNK_SIZE = 1 << 20
MANIFEST = "manifest.json"


class Harvest(Resource):
    """One harvest. ``info`` is the API's last answer about it; `refresh` updates it; `cancel`: queued chunks
    never run, running ones are aborted."""

    PATH = "/v1/harvests"

    def __init__(self, transport: Transport, info: dict[str, Any], console: Console) -> None:
        super().__init__(transport, info)
        self.console = console

    def wait(
        self, timeout: float | None = None, progress: bool = True, *, poll_interval: float | None = None
    ) -> Harvest:
        """Poll until it ends, with a progress bar (chunks, prompts, tokens/s, ETA) while ``progress``.

        Returns it once COMPLETED; raises :class:`HarvestFailed` (failed or cancelled) or :class:`WaitTimeout`.
        Transient poll failures (a 502 from a proxy, the API restarting) do not end the wait
        (:func:`nnqueue.client.waiting.wait_until_ended`)."""
        with _ProgressBar(self, enabled=progress) as bar:
            wait_until_ended(self, timeout, bar.update, poll_interval=poll_interval)
        if self.status != "completed":
            raise HarvestFailed(self.info)
        return self

    def manifest(self) -> dict[str, Any]:
        return self.transport.get_json(f"/v1/harvests/{self.id}/manifest")

    def shards(self) -> list[dict[str, Any]]:
        """``[{"name", "index", "rows", "bytes", "sha256", "url"}]`` (URLs are presigned and short-lived)."""
        return list(self.transport.get_json(f"/v1/harvests/{self.id}/shards")["shards"])

    def download(self, directory: str | os.PathLike[str], parallel: int = 4, progress: bool = True) -> Path:
        """Every shard and ``manifest.json`` into ``directory``, ``parallel`` at a time.

        Resumable: a shard already there with the right sha256 is kept; a missing, partial or corrupt one
        is fetched again. Each download is checked against the sha256 the worker recorded."""
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        shards = self.shards()
        wanted = [shard for shard in shards if _sha256(target / shard["name"]) != shard["sha256"]]
        columns = (TextColumn("[bold blue]shards"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.console, disable=not progress) as bar:
            task = bar.add_task("shards", total=len(shards), completed=len(shards) - len(wanted))
            with ThreadPoolExecutor(max(1, parallel)) as pool:
                for _ in pool.map(lambda shard: self._fetch(shard, target), wanted):
                    bar.advance(task)
        manifest = self.transport.request("GET", f"/v1/harvests/{self.id}/manifest").content
        _check_manifest(manifest, shards)
        (target / MANIFEST).write_bytes(manifest)
        return target

    def shard_bytes(self, shard: dict[str, Any]) -> bytes:
        """One shard (an entry of `shards`) in memory, checked against the sha256 the worker recorded."""
        digest, pieces = hashlib.sha256(), []
        with self.transport.download(shard["url"]) as response:
            for piece in response.iter_bytes(CHUNK_SIZE):
                digest.update(piece)
                pieces.append(piece)
        if digest.hexdigest() != shard["sha256"]:
            raise APIError(502, f"{shard['name']} arrived with sha256 {digest.hexdigest()}, expected {shard['sha256']}")
        return b"".join(pieces)

    def _fetch(self, shard: dict[str, Any], target: Path) -> None:
        path = target / shard["name"]
        partial = path.with_name(path.name + ".part")
        digest = hashlib.sha256()
        with self.transport.download(shard["url"]) as response, open(partial, "wb") as file:
            for piece in response.iter_bytes(CHUNK_SIZE):
                file.write(piece)
                digest.update(piece)
        if digest.hexdigest() != shard["sha256"]:
            partial.unlink(missing_ok=True)
            raise IntegrityError(shard["name"], f"sha256 {shard['sha256']}", f"sha256 {digest.hexdigest()}")
        os.replace(partial, path)


def _check_manifest(manifest: bytes, shards: list[dict[str, Any]]) -> None:
    """The manifest (an object in the store) must name the shards' sha256s the worker recorded (the shard list)."""
    try:
        listed = {entry["file"]: entry["sha256"] for entry in json.loads(manifest)["shards"]}
    except (ValueError, KeyError, TypeError):
        raise IntegrityError(MANIFEST, "a harvest manifest", "an unreadable file") from None
    recorded = {shard["name"]: shard["sha256"] for shard in shards}
    if listed != recorded:
        wrong = sorted(name for name in recorded.keys() | listed.keys() if listed.get(name) != recorded.get(name))
        raise IntegrityError(MANIFEST, "the shards' recorded sha256s", f"other sha256s for {', '.join(wrong[:5])}")


def _sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while piece := file.read(CHUNK_SIZE):
            digest.update(piece)
    return digest.hexdigest()


class _ProgressBar:
    """Chunks done of total as the bar; prompts, tokens/s and ETA beside it."""

    def __init__(self, harvest: Harvest, enabled: bool) -> None:
        self.progress = Progress(
            SpinnerColumn(finished_text="[green]✓"),
            TextColumn(f"[bold]harvest {harvest.id[:8]}[/bold] {{task.description}}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            console=harvest.console,
            disable=not enabled,
        )
        self.task = self.progress.add_task("submitted", total=None, detail="")

    def __enter__(self) -> _ProgressBar:
        self.progress.start()
        return self

    def update(self, info: dict[str, Any]) -> None:
        done = info.get("progress") or {}
        rate, eta = done.get("tokens_per_s"), done.get("eta_s")
        detail = f"{done.get('prompts_done', 0)}/{done.get('prompts_total', 0)} prompts"
        if rate:
            detail += f", {rate:,.0f} tokens/s"
        if eta is not None:
            detail += f", ETA {eta:,.0f} s"
        error = (info.get("error") or {}).get("message")
        status = str(info.get("status"))
        self.progress.update(
            self.task,
            description=status + (f": {error}" if error else ""),
            total=done.get("chunks_total"),
            completed=done.get("chunks_done", 0),
            detail=detail,
        )

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()
