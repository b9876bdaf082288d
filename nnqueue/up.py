"""``nnqueue up``: the embedded stack kept running as a service, for one researcher on one machine.

What ``nnqueue demo`` starts (:class:`nnqueue.demo.EmbeddedStack`: a Redis broker, a SQLite database and a
local object-store folder under the data directory, the HTTP API in a thread of this process, and one
supervised ``nnqueue worker`` for the model), without the demo's trace, plus the schedules' beat (in a
thread, as ``nnqueue beat`` runs it), until Ctrl-C or SIGTERM. It prints the API's URL and a key, and the
settings that point the nnqueue client and CLI (``NNQUEUE_URL``, ``NNQUEUE_API_KEY``) and nnsight's own
``remote=True`` client (``NDIF_HOST``, ``NDIF_API_KEY``) at it; the status page is at ``<URL>/status``.
Nothing else to set up: no Postgres, Redis or S3.

Without a model it serves the demo's, SmolLM2-135M-Instruct as ``smollm2-135m``, converted once into
``<data dir>/models`` as ``nnqueue demo`` does (:func:`nnqueue.demo.ensure_model`); that folder, under any
name, gets the demo's engine arguments (float32, 512 tokens) unless the command line gives others.

State lives in the data directory and survives a restart of ``nnqueue up`` on the same one: the database
(jobs, harvests, keys), the results and harvest shards, and the key (``<data dir>/api-key``, mode 600, used
again while it is valid). Jobs queued when it stopped run once it is back: the broker starts empty, and the
worker's reconciler sends their tokens again (:mod:`nnqueue.scheduler.reconciler`). Keep the same ``--port``
(default 8000) for the URL to stay the same.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from nnqueue.demo import MODEL_KEY, DemoError, EmbeddedStack, engine_defaults, ensure_model, say_isolation

DEFAULT_PORT = 8000
KEY_FILE = "api-key"


def run_up(
    model: str | None,
    data_dir: Path,
    *,
    model_key: str | None = None,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    engine_kwargs: dict[str, Any] | None = None,
    max_concurrent_jobs: int | None = None,
    console: Console | None = None,
) -> None:
    """Start the stack, print how to reach it, and keep it running until SIGINT or SIGTERM (then stop it all).
    ``model`` None: the demo's; ``max_concurrent_jobs`` None: the engine's ``max_num_seqs``.

    Raises :class:`DemoError` if the demo's model is not installed, the worker cannot start or its supervisor
    gives up."""
    console = console or Console()
    data_dir = data_dir.resolve()
    if model is None:
        model, model_key = str(demo_model(data_dir, console)), model_key or MODEL_KEY
    model_key = model_key or model
    engine_kwargs = {**engine_defaults(model), **(engine_kwargs or {})}
    stack = EmbeddedStack(data_dir, Path(model), model_key, engine_kwargs, max_concurrent_jobs)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        stack.start_services(host=host, port=port, key_file=data_dir / KEY_FILE)
        assert stack.api is not None and stack.api_key is not None
        worker = stack.start_worker()
        stack.start_beat()
        console.print(f"nnqueue up: data directory {data_dir}")
        console.print(f"  worker pid {worker.pid} is loading {model!r} (log: {worker.log_path})")
        from nnqueue.client import Client

        waiting = console.status(f"waiting for the worker's engine to serve {model_key!r}")
        with Client(stack.api.url, stack.api_key) as client, waiting:
            stack.wait_worker(client)
        _print_access(console, stack.api.url, stack.api_key, model_key, Path(model))
        say_isolation(console, stack)
        while worker.running():
            time.sleep(0.5)
        raise DemoError(
            f"the worker exited with code {worker.process.returncode}; last lines of {worker.log_path}:\n"
            f"{worker.log_tail(30)}"
        )
    except KeyboardInterrupt:
        console.print("stopping the worker, the API, the schedules' beat and Redis")
    finally:
        try:
            stack.stop()
        except KeyboardInterrupt:
            stack.kill()
        signal.signal(signal.SIGTERM, previous)
    console.print("stopped; the data directory keeps the jobs, results, harvests and the key")


def demo_model(data_dir: Path, console: Console) -> Path:
    """The demo's model folder under ``data_dir``, converted now if it is not there yet."""
    try:
        folder, converted = ensure_model(data_dir / "models", console)
    except DemoError as error:
        raise DemoError(f"give --model, or install the demo's model: {error}") from None
    console.print(f"{'converted' if converted else 'serving'} the demo's model, SmolLM2-135M-Instruct, at {folder}")
    return folder


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _print_access(console: Console, url: str, key: str, model_key: str, model: Path) -> None:
    lines = [f"serving {model_key!r} at {url}"]
    if model.is_dir():  # a local folder: the meta model a trace is written against
        lines.append(f"  a meta model of it for your traces: VLLM({_shown(model)!r})")
    lines += [
        f"API key: {key}",
        f"status page: {url}/status",
        "for the nnqueue client and CLI:",
        f"  export NNQUEUE_URL={url} NNQUEUE_API_KEY={key}",
        "for nnsight's remote=True:",
        f"  export NDIF_HOST={url}/ndif NDIF_API_KEY={key}",
        "harvest schedules fire here too (log: logs/beat.log in the data directory).",
        "Ctrl-C or SIGTERM stops it; state stays in the data directory for the next `nnqueue up`.",
    ]
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is under it (as a user types it there), else absolute."""
    absolute = path.resolve()
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)
