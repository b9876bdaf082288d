"""What the GPU benchmarks share: model directories of real shapes, the engine as the worker runs it, and the job
queue and stores around it.

* Model directories (`build_model_dir`): a Llama config of a real shape (`SHAPES`), a word-level tokenizer over
  its whole vocabulary and, ``seeded``, a safetensors checkpoint drawn from integer seeds (the same bits on any
  machine); dummy weights otherwise (vLLM's ``load_format="dummy"``). `prompt_ids`: random token ids, seeded.
* The engine (`engine_kwargs`, `start`, `stop`): nnqueue's ``load_engine`` on an ``EngineHost`` loop, as
  ``nnqueue worker`` starts it (``contained``: its user, network namespace, seccomp and lock-down too), and a meta
  client model to build payloads with (`PrebuiltBackend`).
* The queue (`Queue`): the worker's whole path for jobs, without the broker: payloads in the store, rows in SQLite
  or Postgres, ``JobRunner`` claims with one thread a job (as the Celery pool), results committed; each run's
  timeline (`nnqueue.timeline`: claim, payload, engine steps, result written, committed, finished).
* Stores (`start_store`): a SeaweedFS S3 server started here (``weed mini`` and more volume servers), and
  nnqueue's object store on it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import tempfile
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
SHAPES = {
    # Llama-3-70B: 80 layers of hidden 8192 (issue 13: vllm-lens' published +12% is for one-layer capture at TP=4).
    "70b": {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
    },
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 512,
        "tie_word_embeddings": False,
    },
}


# ---------------------------------------------------------------- model directory (config + tokenizer + weights)


def build_model_dir(root: Path, shape: str, seeded: bool) -> Path:
    """config.json, a word-level tokenizer covering the whole vocabulary, and (seeded) safetensors."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = root / f"llama-{shape}{'-seeded' if seeded else ''}"
    path.mkdir(parents=True, exist_ok=True)
    config = {**COMMON, **SHAPES[shape]}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, config["vocab_size"])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)
    if seeded:
        from safetensors.torch import save_file

        save_file({name: seeded_tensor(name, shape) for name in weight_shapes(config)}, path / "model.safetensors")
    return path


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF Llama tensor names and shapes."""
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.norm.weight": (h,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    return shapes


def seeded_tensor(name: str, shape: str):
    """A bf16 tensor from integer draws seeded by its name: the same bits on any machine.

    Uniform with std 0.02 (norm weights 1 +- 0.1), so attention and MLPs do real work, unlike vLLM's
    dummy init (uniform +-1e-3, under which every layer's output is nearly its input).
    """
    import torch

    dims = weight_shapes({**COMMON, **SHAPES[shape]})[name]
    draws = (
        torch.randint(
            -(2**15), 2**15, dims, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())), dtype=torch.int32
        ).float()
        / 2**15
    )
    value = 1 + 0.1 * draws if name.endswith("norm.weight") else 0.0346 * draws
    return value.to(torch.bfloat16)


def checkpoint_weights(shape: str, layers: int) -> dict[str, Any]:
    """The seeded checkpoint's weights in vLLM's fused layout (qkv_proj, gate_up_proj)."""
    import torch

    def t(n: int, name: str) -> Any:
        return seeded_tensor(f"model.layers.{n}.{name}.weight", shape)

    return {
        f"{n}.{name}": value
        for n in range(layers)
        for name, value in {
            "qkv_proj": torch.cat([t(n, f"self_attn.{p}_proj") for p in "qkv"]),
            "o_proj": t(n, "self_attn.o_proj"),
            "gate_up_proj": torch.cat([t(n, "mlp.gate_proj"), t(n, "mlp.up_proj")]),
            "down_proj": t(n, "mlp.down_proj"),
            "input_layernorm": t(n, "input_layernorm"),
            "post_attention_layernorm": t(n, "post_attention_layernorm"),
        }.items()
    }


def prompt_ids(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=g).tolist()


# ---------------------------------------------------------------- the engine, the queue, the stores


def engine_kwargs(args: argparse.Namespace, max_model_len: int) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "dtype": args.dtype,
        "load_format": args.load_format,
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": max_model_len,
        "max_num_seqs": args.max_num_seqs or None,  # 0: vLLM's default for the device
        "max_num_batched_tokens": max(args.max_num_batched_tokens, max_model_len),
        "enable_prefix_caching": False,
        "enable_chunked_prefill": False,
        "tensor_parallel_size": args.tp,
    }
    if getattr(args, "pp", 1) > 1:  # steer_gpu.py shares this without a --pp
        kwargs["pipeline_parallel_size"] = args.pp
    if not args.tiny:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.distributed_executor_backend:
        kwargs["distributed_executor_backend"] = args.distributed_executor_backend
    return kwargs


def start(
    model_dir: Path,
    kwargs: dict[str, Any],
    concurrency: int,
    contained: bool = False,
    writable: list[Path] | None = None,
) -> tuple[Any, Any, Any]:
    """EngineHost + nnqueue's load_engine on its loop, and a meta client for payloads. ``contained``: the engine
    as ``nnqueue worker`` starts it (scrubbed environment, engine user, network namespace, filesystem view,
    seccomp, lock-down); the folders this process makes later with `tempfile` (handoff folders) are made in a
    folder the engine user may write, which its filesystem view holds, as are ``writable`` (folders made before,
    which the engine user can reach: an ``NNQUEUE_WORKER_HANDOFF_DIR``-like handoff parent)."""
    import contextlib
    import inspect

    from nnsight.modeling.vllm import VLLM

    from nnqueue.engines.platform import load_engine, prepare_process
    from nnqueue.workers.engine_host import EngineHost

    # I/O threads as `nnqueue worker` sizes them for K concurrent jobs (where this nnqueue has the knob).
    threads = (
        {"blocking_threads": 2 * concurrency + 2}
        if "blocking_threads" in inspect.signature(EngineHost).parameters
        else {}
    )
    host = EngineHost(**threads)
    started = time.perf_counter()

    isolated: Any = contextlib.nullcontext()
    load_kwargs = kwargs
    if contained:  # as `nnqueue worker` contains its engine (nnqueue.workers.containment)
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        from nnqueue.enginecore.spawning import engine_core_contained
        from nnqueue.isolation import engine_writable_dir
        from nnqueue.settings import Settings
        from nnqueue.workers.containment import engine_core_kwargs, engine_view, isolate

        ray = kwargs.get("distributed_executor_backend") == "ray"
        containment = isolate(Settings(), str(model_dir), kwargs, ray=ray)
        print(f"containment: {json.dumps(containment.report())}", flush=True)
        cache_dir()  # root's kernel cache stays in /tmp; the handoff folders the bench makes later land below:
        tempfile.tempdir = str(engine_writable_dir("nnqueue-bench-handoff-"))
        folders = [Path(tempfile.tempdir), *(writable or [])]
        view = engine_view(str(model_dir), kwargs, folders) if containment.filesystem_private else None
        isolated = engine_core_contained(network=containment.network_isolated, view=view)
        load_kwargs = engine_core_kwargs(kwargs)

    async def load() -> Any:
        with isolated:
            return load_engine(str(model_dir), **load_kwargs)

    engine = host.call(load())
    print(f"engine up in {time.perf_counter() - started:.1f} s: {kwargs}", flush=True)
    prepare_process()
    client = VLLM(str(model_dir), dtype=kwargs["dtype"], max_model_len=kwargs["max_model_len"])
    try:  # what `nnqueue worker` does once its engine is up (where this nnqueue does it)
        from nnqueue.workers.main import freeze_startup_heap
    except ImportError:
        pass
    else:
        freeze_startup_heap()
    return host, engine, client


def kill_children() -> None:
    """Kill this process's child processes (the engine core, its workers, servers started here), for a run that
    failed and exits without stopping them."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass


def stop(host: Any, engine: Any) -> None:
    engine.vllm_entrypoint.shutdown()
    engine.vllm_entrypoint = None  # AsyncLLM.__del__ would shut down again at exit
    host.stop()


class PrebuiltBackend:
    """A client's backend: build the trace's requests instead of running them (the nnqueue client's payload)."""

    payload: bytes

    def __call__(self, tracer: Any) -> None:
        from nnqueue.client.backend import build_payload

        self.payload = build_payload(tracer)


class Queue:
    """nnqueue's embedded defaults (SQLite, or a Postgres URL, + local object store) and a JobRunner on the engine."""

    def __init__(self, data_dir: Path, engine: Any, database_url: str | None = None) -> None:
        from nnqueue.db.migrate import upgrade
        from nnqueue.db.session import make_engine, session_factory
        from nnqueue.engines.builders import BuilderPool
        from nnqueue.engines.outbox import poller
        from nnqueue.settings import Settings
        from nnqueue.storage import object_store_from_settings
        from nnqueue.timeline import Timelines
        from nnqueue.workers.job_execution import JobRunner
        from nnqueue.workers.sinks import ResultSinks
        from nnqueue.workers.trace_execution import VLLMTraceExecutor

        self.settings = Settings(_env_file=None, data_dir=data_dir, database_url=database_url)
        upgrade(self.settings.resolved_database_url)
        self.sessions = session_factory(make_engine(self.settings.resolved_database_url))
        self.store = object_store_from_settings(self.settings)
        # As `nnqueue worker` builds it; payloads are prebuilt, so no trace builder is ever started.
        executor = VLLMTraceExecutor(
            self.sessions,
            self.store,
            engine,
            ResultSinks(self.store, self.settings.resolved_store_dir / ".handoff"),
            poller(engine.vllm_entrypoint),  # the engine's one poller, shared with harvest chunks (as the worker)
            BuilderPool("", {}, 0, 0),
        )
        self.timelines = Timelines()  # each job's run: claim, payload, engine steps, result, commit, finish
        self.runner = JobRunner(self.sessions, executor, "bench", f"bench:{os.getpid()}", timelines=self.timelines)

    def submit(self, payloads: list[bytes], kind: str = "trace", safetensors: bool = False) -> list[uuid.UUID]:
        """What ``submit_job`` does, minus the broker: payload to the store, QUEUED row to the DB (jobs of
        ``kind``: trace, or steer for `benchmarks/steer_gpu.py`'s payloads; ``safetensors``: asking for the copy)."""
        from nnqueue.db.lifecycle import create_job
        from nnqueue.db.models import Job, JobKind
        from nnqueue.db.session import transaction
        from nnqueue.storage.keys import payload_key

        ids = []
        for payload in payloads:
            job_id = uuid.uuid4()
            size = self.store.put_bytes(payload_key(job_id), payload)
            with transaction(self.sessions) as session:
                create_job(
                    session,
                    Job(
                        id=job_id,
                        owner="bench",
                        model_key="bench",
                        kind=JobKind(kind),
                        timeout_s=600.0,
                        priority=0,
                        meta={},
                        payload_key=payload_key(job_id),
                        payload_size=size,
                        wants_safetensors=safetensors,
                    ),
                )
            ids.append(job_id)
        return ids

    def run(self, host: Any, job_ids: list[uuid.UUID], concurrency: int) -> list[str]:
        """K threads each handing a token per job to the engine loop, as the Celery thread pool does."""
        with ThreadPoolExecutor(concurrency) as pool:
            return [o.value for o in pool.map(lambda _: host.call(self.runner.run_next()), job_ids)]

    def results(self, job_ids: list[uuid.UUID]) -> tuple[int, int]:
        """(bytes of saves.pt by the DB, bytes under results/ in the store incl. safetensors)."""
        from sqlalchemy import func, select

        from nnqueue.db.models import Job

        with self.sessions() as session:
            pt = int(session.scalar(select(func.sum(Job.result_size)).where(Job.id.in_(job_ids))) or 0)
        root = self.settings.resolved_store_dir / "results"
        return pt, sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0

    def failure(self, job_id: uuid.UUID) -> tuple[Any, ...]:
        """A job's status, error type and message (the first 2,000 characters)."""
        from nnqueue.db.models import Job

        with self.sessions() as session:
            job = session.get(Job, job_id)
            assert job is not None
            return job.status.value, job.error_type, (job.error_message or "")[:2000]

    def load(self, job_id: uuid.UUID) -> dict[str, Any]:
        from nnqueue.db.models import Job
        from nnqueue.storage.results import load_result

        with self.sessions() as session:
            job = session.get(Job, job_id)
            assert job is not None and job.status.value == "completed", (job.status, job.error_type, job.error_message)
            return load_result(self.store.get_bytes(job.result_key))

    def clear(self) -> None:
        """Before a run: no results, no timelines of earlier runs."""
        shutil.rmtree(self.settings.resolved_store_dir / "results", ignore_errors=True)
        self.timelines.clear()


class Store:
    """A SeaweedFS S3 store started here (``weed mini`` and extra volume servers) and nnqueue's store on it."""

    def __init__(self, volumes: int, parts: int | None, volume_size_limit_mb: int) -> None:
        from pydantic import SecretStr

        from nnqueue.settings import S3Settings
        from nnqueue.storage.s3 import S3ObjectStore
        from tests.utils import servers

        self.server = servers.start_s3(volume_size_limit_mb=volume_size_limit_mb)
        self._scratch: list[Path] = []
        self.volumes = [self._volume_server(index) for index in range(volumes - 1)]
        self._wait_for_volume_servers(volumes)
        extra = {"upload_parts_in_flight": parts} if parts else {}
        self.settings = S3Settings(
            endpoint_url=self.server.endpoint_url,
            bucket=f"upload-bench-{uuid.uuid4().hex[:8]}",
            region=self.server.region,
            access_key_id=self.server.access_key_id,
            secret_access_key=SecretStr(self.server.secret_access_key),
            **extra,
        )
        self.store = S3ObjectStore(self.settings)
        self.store.put_bytes("warm", b"up")  # the bucket, then volumes for it on every volume server
        if volumes > 1:
            self._grow(2 * volumes)

    def _grow(self, count: int) -> None:
        """``count`` more volumes for the bucket's collection, which the master spreads over the volume servers."""
        import httpx

        master = f"http://127.0.0.1:{self.server.ports[0]}"
        params: dict[str, str | int] = {"collection": self.settings.bucket, "count": count, "replication": "000"}
        answer = httpx.get(f"{master}/vol/grow", params=params, timeout=60)
        answer.raise_for_status()

    def _volume_server(self, index: int) -> Any:
        from tests.utils import servers

        master, master_grpc = self.server.ports[0], self.server.ports[1]  # weed mini's first two listeners
        port, grpc = servers.free_ports(2)
        workdir = Path(tempfile.mkdtemp(prefix=f"nnqueue-bench-volume-{index}-"))
        argv = [
            str(servers.weed_binary()),
            "-logtostderr",
            "volume",
            f"-dir={workdir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-port={port}",
            f"-port.grpc={grpc}",
            f"-mserver=127.0.0.1:{master}.{master_grpc}",
        ]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workdir), "TMPDIR": str(workdir)}
        return servers.ServerProcess(f"weed-volume-{index}", argv, workdir, stop_signal=signal.SIGKILL, env=env)

    def data_nodes(self) -> dict[str, int]:
        """Each volume server's address and the volumes it holds, from the master."""
        import httpx

        status = httpx.get(f"http://127.0.0.1:{self.server.ports[0]}/dir/status", timeout=10).json()
        nodes = {}
        for center in status["Topology"].get("DataCenters") or []:
            for rack in center.get("Racks") or []:
                for node in rack.get("DataNodes") or []:
                    nodes[node["Url"]] = node.get("Volumes", 0)
        return nodes

    def _wait_for_volume_servers(self, count: int) -> None:
        deadline = time.monotonic() + 60
        while len(self.data_nodes()) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(self.data_nodes())} of {count} volume servers joined the master")
            time.sleep(0.2)

    def cpu_seconds(self) -> float:
        """CPU seconds of the store's processes so far."""
        import psutil

        total = 0.0
        for process in [self.server.process, *self.volumes]:
            times = psutil.Process(process.pid).cpu_times()
            total += times.user + times.system
        return total

    def scratch(self, parent: Path) -> Path:
        """A folder of this run's in ``parent`` (a handoff folder on a tmpfs, say), which the engine user can pass
        through to its own folder inside; removed by `stop`."""
        folder = Path(tempfile.mkdtemp(prefix="upload-bench-", dir=parent))
        folder.chmod(0o711)
        self._scratch.append(folder)
        return folder

    def stop(self) -> None:
        for folder in self._scratch:
            shutil.rmtree(folder, ignore_errors=True)
        for volume in self.volumes:
            volume.stop()
        self.server.stop()


def start_store(volumes: int = 1, parts: int | None = None, volume_size_limit_mb: int = 30000) -> Store:
    """weed mini with ``volumes`` - 1 more volume servers that joined its master before any bucket exists (so that
    the bucket's volumes are grown on all of them); nnqueue's store on it with ``parts`` parts in flight (None:
    nnqueue's default)."""
    return Store(volumes, parts, volume_size_limit_mb)
