"""A trainer pushing weights into an nnqueue engine over NCCL with TRL's vLLM server protocol (issue 26), on two GPUs:
the engine on GPU 0, the trainer in a process of its own on GPU 1.

The engine side is what ``nnqueue worker`` runs with ``NNQUEUE_TRAINER_PORT`` and ``NNQUEUE_TRAINER_NCCL_PORT``:
nnqueue's ``load_engine`` (nnqueue's worker class: RPC, weights guard) on an ``EngineHost`` loop, the weights gate,
and :func:`nnqueue.workers.trl_server.serve` on that loop (its key check on a SQLite database of its own). The
trainer drives it with TRL's ``VLLMClient`` (``trl.generation.vllm_client``, TRL <= 1.8) when TRL is installed,
else with the same protocol calls written out here (:class:`ProtocolClient`: TRL 1.8's, line for line).

* ``--check-1b``: a Llama-3.2-1B-shaped model with seeded weights; the trainer pushes new seeded values of every
  parameter (``init_communicator``, ``update_named_param`` each, ``reset_prefix_cache``) and writes them as a
  checkpoint; then a trace (layer 3's output and the logits of two prompts, through nnsight on the engine)
  must equal, bit for bit, the same trace on a fresh engine loaded from that checkpoint. A generate call through
  the protocol must run afterwards. Prints ``CHECK PASSED`` or ``CHECK FAILED``.
* ``--time-8b``: a Llama-3-8B-shaped model (dummy weights); the trainer times a full update of every parameter
  through the protocol, then, in the same run and processes, a bare NCCL broadcast of the same tensors (a
  ``StatelessProcessGroup`` + ``PyNcclCommunicator`` between the trainer and a receiver on GPU 0, no engine).
  Prints both, their ratio, and the engine's pause (requests held back) for the update.

Run on the device (2 GPUs)::

    python benchmarks/weights_update_gpu.py --check-1b --time-8b --out "$OUT"

Results: stdout and ``<out>/weights_update.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HTTP_PORT, NCCL_PORT, BARE_PORT = 18010, 51216, 51217
CHECK_LAYER = 3


# ---------------------------------------------------------------- the trainer (GPU 1)


class ProtocolClient:
    """TRL 1.8's ``VLLMClient`` calls, for a device without TRL: the same HTTP requests and NCCL group."""

    def __init__(self, base_url: str, group_port: int) -> None:
        import requests

        self.base_url, self.group_port, self.host = base_url, group_port, "127.0.0.1"
        self.session = requests.Session()
        self.communicator: Any = None
        assert requests.get(f"{base_url}/health/").status_code == 200

    def _post(self, path: str, **kwargs: Any) -> Any:
        response = self.session.post(f"{self.base_url}{path}", **kwargs)
        if response.status_code != 200:
            raise RuntimeError(f"{path}: {response.status_code} {response.text}")
        return response.json()

    def init_communicator(self, device: int = 0) -> None:
        import requests
        import torch
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        world_size = requests.get(f"{self.base_url}/get_world_size/").json()["world_size"] + 1
        self.rank = world_size - 1
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        body = {"host": "0.0.0.0", "port": self.group_port, "world_size": world_size, "client_device_uuid": uuid}
        self._post("/init_communicator/", json=body)
        time.sleep(0.1)
        group = StatelessProcessGroup.create(
            host=self.host, port=self.group_port, rank=self.rank, world_size=world_size
        )
        self.communicator = PyNcclCommunicator(group, device=device)

    def update_named_param(self, name: str, weights: Any) -> None:
        self._post(
            "/update_named_param/", json={"name": name, "dtype": str(weights.dtype), "shape": list(weights.shape)}
        )
        self.communicator.broadcast(weights, src=self.rank)
        self.communicator.group.barrier()

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache/")

    def generate(self, prompts: list[Any], **kwargs: Any) -> dict[str, Any]:
        return dict(self._post("/generate/", json={"prompts": prompts, **kwargs}))

    def close_communicator(self) -> None:
        self._post("/close_communicator/")
        self.communicator = None


def trainer(args: argparse.Namespace) -> None:
    """One phase's trainer: push every parameter through the protocol; ``--bare``: then a bare broadcast."""
    import torch

    from benchmarks import common

    try:
        from trl.generation.vllm_client import VLLMClient

        client: Any = VLLMClient(base_url=f"http://127.0.0.1:{HTTP_PORT}", group_port=NCCL_PORT)
        kind = "trl " + __import__("trl").__version__
    except ImportError:
        client, kind = ProtocolClient(f"http://127.0.0.1:{HTTP_PORT}", NCCL_PORT), "ProtocolClient (no TRL here)"
    client.session.headers["Authorization"] = f"Bearer {os.environ['NNQUEUE_BENCH_KEY']}"
    config = {**common.COMMON, **common.SHAPES[args.shape]}
    names = list(common.weight_shapes(config))
    tensors = {name: new_value(name, args.shape).to("cuda:0") for name in names}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    torch.cuda.synchronize()
    report: dict[str, Any] = {"client": kind, "tensors": len(tensors), "bytes": total}

    client.init_communicator(device=0)
    started = time.perf_counter()
    for name, tensor in tensors.items():
        client.update_named_param(name, tensor)
    client.reset_prefix_cache()
    report["protocol_update_s"] = time.perf_counter() - started
    if args.save:
        from safetensors.torch import save_file

        save_file({name: tensor.cpu() for name, tensor in tensors.items()}, args.save)
    answer = client.generate([[5, 6, 7, 8]], max_tokens=4, temperature=0.0)
    report["generated_after_update"] = answer["completion_ids"]
    client.close_communicator()

    if args.bare:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host="127.0.0.1", port=BARE_PORT, rank=1, world_size=2)
        communicator = PyNcclCommunicator(group, device=0)
        group.barrier()
        started = time.perf_counter()
        for tensor in tensors.values():
            communicator.broadcast(tensor, src=1)
        torch.cuda.synchronize()
        group.barrier()
        report["bare_broadcast_s"] = time.perf_counter() - started
    print("TRAINER " + json.dumps(report), flush=True)


def new_value(name: str, shape: str) -> Any:
    """The trainer's value of ``name``: seeded like ``common.seeded_tensor``, from another seed."""
    import torch

    from benchmarks import common

    dims = common.weight_shapes({**common.COMMON, **common.SHAPES[shape]})[name]
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}#step-1".encode()))
    draws = torch.randint(-(2**15), 2**15, dims, generator=generator, dtype=torch.int32).float() / 2**15
    value = 1 + 0.1 * draws if name.endswith("norm.weight") else 0.0346 * draws
    return value.to(torch.bfloat16)


# ---------------------------------------------------------------- the engine side (GPU 0)


def start_trainer(
    args: argparse.Namespace, shape: str, save: Path | None, bare: bool, key: str
) -> subprocess.Popen[str]:
    command = [sys.executable, __file__, "--role", "trainer", "--shape", shape]
    command += ["--save", str(save)] if save else []
    command += ["--bare"] if bare else []
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": args.trainer_gpu, "NNQUEUE_BENCH_KEY": key}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)


def trainer_report(process: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    out, _ = process.communicate(timeout=timeout)
    sys.stdout.write(out)
    line = next((line for line in out.splitlines() if line.startswith("TRAINER ")), None)
    if process.returncode != 0 or line is None:
        raise RuntimeError(f"the trainer failed (exit {process.returncode})")
    return dict(json.loads(line.removeprefix("TRAINER ")))


def serving_stack(work: Path) -> tuple[Any, Any, str]:
    """A SQLite database with a ``weights`` key, its sessions, and the settings of the protocol's server."""
    from nnqueue.api.auth import create_key
    from nnqueue.db.models import Base
    from nnqueue.db.session import make_engine, session_factory
    from nnqueue.settings import Settings

    url = f"sqlite:///{work / 'bench.db'}"
    database = make_engine(url)
    Base.metadata.create_all(database)
    sessions = session_factory(database)
    with sessions() as session:
        _, secret = create_key(session, "trainer", ["weights"])
        session.commit()
    settings = Settings(
        _env_file=None,
        database_url=url,
        trainer_port=HTTP_PORT,
        trainer_nccl_port=NCCL_PORT,
        trainer_timeout_s=600,
    )
    return sessions, settings, secret


def with_protocol(engine: Any, sessions: Any, settings: Any) -> tuple[Any, Any]:
    """The weights gate and the protocol's server on the engine's loop (as ``run_worker`` starts them)."""
    from nnqueue.workers import trl_server
    from nnqueue.workers.weights import WeightsGate

    gate = WeightsGate("base-bench", {"source": "checkpoint"})
    llm = engine.model.vllm_entrypoint

    def broken() -> None:
        print("a failed update could not be rolled back", flush=True)
        os._exit(3)

    server = engine.run(trl_server.serve(llm, gate, settings, sessions, "bench-worker", "bench", broken))
    return gate, server


def probe_trace(client: Any, backend: Any) -> None:
    """Layer ``CHECK_LAYER``'s output (HF's hidden state) and the logits of two prompts, one trace."""
    with client.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        with tracer.invoke([11, 12, 13, 14, 15, 16, 17]):
            out = client.model.layers[CHECK_LAYER].output
            h0 = (out[0] + out[1]).save()
            logits0 = client.logits.save()
        with tracer.invoke([21, 22, 23, 24]):
            out = client.model.layers[CHECK_LAYER].output
            h1 = (out[0] + out[1]).save()
            logits1 = client.logits.save()


def check_1b(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    from nnsight.modeling.vllm import VLLM

    from benchmarks import common
    from tests.utils.engines import running_engine
    from tests.utils.reference import reference_saves

    model_dir = common.build_model_dir(work, "1b", seeded=True)
    pushed = work / "pushed"
    pushed.mkdir()
    for file in model_dir.iterdir():  # the same config and tokenizer; the trainer writes the weights
        if file.suffix != ".safetensors":
            (pushed / file.name).write_bytes(file.read_bytes())
    kwargs = {"dtype": "bfloat16", "max_model_len": 512, "gpu_memory_utilization": 0.4, "seed": 0}
    sessions, settings, key = serving_stack(work)
    client = VLLM(str(model_dir), dtype="bfloat16", max_model_len=512)
    with running_engine(model_dir, **kwargs) as engine:
        before = reference_saves(client, engine, probe_trace)
        gate, server = with_protocol(engine, sessions, settings)
        trainer_report_ = trainer_report(
            start_trainer(args, "1b", pushed / "model.safetensors", False, key), timeout=900
        )
        updated = reference_saves(client, engine, probe_trace)
        version, pauses = gate.version, list(gate.pauses)
        server.should_exit = True
    with running_engine(pushed, **kwargs) as fresh:
        expected = reference_saves(client, fresh, probe_trace)
    equal = {name: bool(torch.equal(updated[name], value)) for name, value in expected.items()}
    changed = {name: not bool(torch.equal(before[name], value)) for name, value in expected.items()}
    passed = all(equal.values()) and all(changed.values()) and version.startswith("trl-")
    print(
        f"CHECK {'PASSED' if passed else 'FAILED'}: equal to a fresh engine {equal}, changed {changed}, "
        f"version {version}, pause {pauses}",
        flush=True,
    )
    return {
        "passed": passed,
        "equal": equal,
        "changed": changed,
        "version": version,
        "pauses_s": pauses,
        "trainer": trainer_report_,
    }


def time_8b(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    from benchmarks import common
    from tests.utils.engines import running_engine

    model_dir = common.build_model_dir(work, "8b", seeded=False)
    kwargs = {"dtype": "bfloat16", "max_model_len": 1024, "gpu_memory_utilization": 0.5, "load_format": "dummy"}
    (work / "8b").mkdir()
    sessions, settings, key = serving_stack(work / "8b")
    trainer_process = None
    with running_engine(model_dir, **kwargs) as engine:
        gate, server = with_protocol(engine, sessions, settings)
        trainer_process = start_trainer(args, "8b", None, True, key)
        # The trainer pushes, then waits for the bare receiver below (after this engine is gone: GPU 0's memory).
        while not gate.version.startswith("trl-"):
            if trainer_process.poll() is not None:
                raise RuntimeError("the trainer exited before its update ended")
            time.sleep(0.2)
        version, pauses = gate.version, list(gate.pauses)
        time.sleep(2.0)  # its generate and close_communicator
        server.should_exit = True
    config = {**common.COMMON, **common.SHAPES["8b"]}
    buffers = [
        torch.empty(dims, dtype=torch.bfloat16, device="cuda:0") for dims in common.weight_shapes(config).values()
    ]
    group = StatelessProcessGroup.create(host="127.0.0.1", port=BARE_PORT, rank=0, world_size=2)
    communicator = PyNcclCommunicator(group, device=0)
    group.barrier()
    for buffer in buffers:
        communicator.broadcast(buffer, src=1)
    torch.cuda.synchronize()
    group.barrier()
    report = trainer_report(trainer_process, timeout=900)
    ratio = report["protocol_update_s"] / report["bare_broadcast_s"]
    print(
        f"8B update: {report['protocol_update_s']:.2f} s through the protocol ({report['tensors']} tensors, "
        f"{report['bytes'] / 2**30:.1f} GiB; engine pause {pauses[-1]:.2f} s) vs {report['bare_broadcast_s']:.2f} s "
        f"bare NCCL broadcast: {ratio:.2f}x; version {version}",
        flush=True,
    )
    return {"version": version, "pauses_s": pauses, "ratio": ratio, "trainer": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["engine", "trainer"], default="engine")
    parser.add_argument("--check-1b", action="store_true")
    parser.add_argument("--time-8b", action="store_true")
    parser.add_argument("--trainer-gpu", default="1")
    parser.add_argument("--shape", default="1b")
    parser.add_argument("--save")
    parser.add_argument("--bare", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # nnqueue, tests and benchmarks, from a checkout
    if args.role == "trainer":
        trainer(args)
        return
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    os.environ["NNQUEUE_ENGINE_SECCOMP_NETWORK"] = "true"  # the engine's rank 0 listens for the trainer's group
    work = Path(tempfile.mkdtemp(prefix="weights-update-"))
    results: dict[str, Any] = {}
    try:
        if args.check_1b:
            results["check_1b"] = check_1b(args, work)
        if args.time_8b:
            results["time_8b"] = time_8b(args, work)
    except BaseException:  # noqa: BLE001 - fail the device call now, loudly, rather than wait on engine threads
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "weights_update.json").write_text(json.dumps(results, indent=1, default=str))
    sys.stdout.flush()
    os._exit(0 if results.get("check_1b", {}).get("passed", True) else 1)


if __name__ == "__main__":
    main()
