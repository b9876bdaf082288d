"""``nnqueue up``: the embedded stack kept running as a service, for one researcher on one machine.

What ``nnqueue demo`` starts (:class:`nnqueue.demo.EmbeddedStack`: a Redis broker, a SQLite database and a
local object-store folder under the data directory, the HTTP API in a thread of this process, and one
supervised ``nnqueue worker`` for the model), without the demo's trace, until Ctrl-C or SIGTERM. It prints
the API's URL and a key, and the settings that point the nnqueue client and CLI (``NNQUEUE_URL``,
``NNQUEUE_API_KEY``) and nnsight's own ``remote=True`` client (``NDIF_HOST``, ``NDIF_API_KEY``) at it; the
status page is at ``<URL>/status``. Nothing else to set up: no Postgres, Redis or S3.

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

from nnqueue.demo import DemoError, EmbeddedStack, say_isolation

DEFAULT_PORT = 8000
KEY_FILE = "api-key"


def run_up(
    model: str,
    data_dir: Path,
    *,
    model_key: str | None = None,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    engine_kwargs: dict[str, Any] | None = None,
    max_concurrent_jobs: int = 8,
    console: Console | None = None,
) -> None:
    """Start the stack, print how to reach it, and keep it running until SIGINT or SIGTERM (then stop it all).

    Raises :class:`DemoError` if the worker cannot start or its supervisor gives up."""
    console = console or Console()
    data_dir = data_dir.resolve()
    model_key = model_key or model
    stack = EmbeddedStack(data_dir, Path(model), model_key, engine_kwargs or {}, max_concurrent_jobs)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        stack.start_services(host=host, port=port, key_file=data_dir / KEY_FILE)
        assert stack.api is not None and stack.api_key is not None
        worker = stack.start_worker()
        console.print(f"nnqueue up: data directory {data_dir}")
        console.print(f"  worker pid {worker.pid} is loading {model!r} (log: {worker.log_path})")
        from nnqueue.client import Client

        waiting = console.status(f"waiting for the worker's engine to serve {model_key!r}")
        with Client(stack.api.url, stack.api_key) as client, waiting:
            stack.wait_worker(client)
        _print_access(console, stack.api.url, stack.api_key, model_key)
        say_isolation(console, stack)
        while worker.running():
            time.sleep(0.5)
        raise DemoError(
            f"the worker exited with code {worker.process.returncode}; last lines of {worker.log_path}:\n"
            f"{worker.log_tail(30)}"
        )
    except KeyboardInterrupt:
        console.print("stopping the worker, the API and Redis")
    finally:
        try:
            stack.stop()
        except KeyboardInterrupt:
            stack.kill()
        signal.signal(signal.SIGTERM, previous)
    console.print("stopped; the data directory keeps the jobs, results, harvests and the key")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _print_access(console: Console, url: str, key: str, model_key: str) -> None:
    lines = [
        f"serving {model_key!r} at {url}",
        f"API key: {key}",
        f"status page: {url}/status",
        "for the nnqueue client and CLI:",
        f"  export NNQUEUE_URL={url} NNQUEUE_API_KEY={key}",
        "for nnsight's remote=True:",
        f"  export NDIF_HOST={url}/ndif NDIF_API_KEY={key}",
        "Ctrl-C or SIGTERM stops it; state stays in the data directory for the next `nnqueue up`.",
    ]
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
