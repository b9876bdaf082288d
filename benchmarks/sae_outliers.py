"""Outlier rows and an SAE's loss: do rows far over the median norm spike it, does leaving them out stop that, and
what does leaving them out cost?

The setting of issue 37's trial: SmolLM2-135M-Instruct (as `nnqueue demo` converts it), layer 15's residual
stream, ``selection: {kind: all, skip: 1}``, bfloat16, over ``--paragraphs`` paragraphs of English prose that ship
with Python (the standard library's docstrings, so the run needs no download) truncated to 128 tokens. On
one in-process engine:

1. the harvest, chunk by chunk through the engine's capture path and shard writer (`run_chunk`), each chunk twice
   in a row, as it is and with the spec's ``outliers: {action: drop, times_median: 10}``: the rows the writer
   dropped, and the chunk's time both ways (the option's cost on the engine side: the writer's pass over rows it
   already holds);
2. the rows' norms: the median, the 99.9th percentile, the rows over 10 times the median, their positions and
   their share of the squared norm;
3. the reading side's option (`nnqueue.outliers.screen`, what the export and the reader run on each shard) against
   the rest of an export's per-shard work that does not write (safetensors load, bfloat16 to float32);
4. one SAE (SAELens's ``StandardTrainingSAE``: d_sae = 4 d_in, L1 coefficient 5, Adam at 3e-4, no activation
   normalization) trained from the same seed on the same shuffled batches of ``--batch`` rows for ``--epochs``
   epochs, three times: every row, the rows over 10x the median dropped, and clipped. Per step, the MSE loss over
   the median of the previous 50 steps' (the first 50 steps left out): its largest value, and the steps over 5x.

    .venv/bin/python benchmarks/sae_outliers.py            # SmolLM2-135M, 1,000 paragraphs (minutes on a CPU)
    .venv/bin/python benchmarks/sae_outliers.py --tiny     # the test suite's tiny model, a logic check
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TIMES_MEDIAN = 10.0
WINDOW = 50  # steps of the running median a step's loss is compared with


def paragraphs(count: int, min_chars: int = 200) -> list[str]:
    """The first ``count`` paragraphs of at least ``min_chars`` characters of the standard library's docstrings
    (modules, classes, functions), in file order (deterministic for a Python version)."""
    found: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if {"test", "idlelib", "site-packages", "dist-packages"} & set(path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docstrings = [ast.get_docstring(node) or "" for node in ast.walk(tree) if isinstance(node, documented)]
        for paragraph in "\n\n".join(docstrings).split("\n\n"):
            text = " ".join(paragraph.split())
            if len(text) >= min_chars:
                found.append(text)
                if len(found) == count:
                    return found
    return found


def harvest(run: Any, llm: Any, prompts: list[list[int]], layer: int, chunk: int, out: Path) -> dict[str, Any]:
    """Each chunk without and with the outliers option, in a row; the shards of the first, timings and counts."""
    from nnqueue.engines.harvest_runner import Capture, ChunkWork, Selection, run_chunk
    from nnqueue.outliers import Outliers

    option = Outliers("drop", times_median=TIMES_MEDIAN)
    plain_s, screened_s, dropped, files = [], [], 0, []
    for number, first in enumerate(range(-chunk, len(prompts), chunk)):  # chunk -1: a warm-up, not counted
        first = max(first, 0)
        for outliers in (None, option) if number % 2 else (option, None):  # alternated against drift
            name = f"{f'chunk-{number - 1:03d}' if number else 'warm-up'}{'-screened' if outliers else ''}"
            work = ChunkWork(
                chunk_id=name,
                prompt_indices=range(first, min(first + chunk, len(prompts))),
                token_ids=prompts[first : first + chunk],
                captures=[Capture(f"model.layers.{layer}")],
                selection=Selection("all", skip=1),
                dtype="bfloat16",
                sink={"kind": "handoff", "path": str(out / f"{name}.safetensors")},
                outliers=outliers,
            )
            result = run(run_chunk(llm, work))
            if number == 0:
                continue
            if outliers is None:
                plain_s.append(result.seconds)
                files.append(out / f"{name}.safetensors")
            else:
                screened_s.append(result.seconds)
                dropped += result.outliers["dropped_rows"]
    paired = [b / a for a, b in zip(plain_s, screened_s, strict=True)]
    return {
        "files": files,
        "chunks": len(files),
        "engine_s_per_chunk_without": round(statistics.median(plain_s), 3),
        "engine_s_per_chunk_with_option": round(statistics.median(screened_s), 3),
        "engine_time_with_over_without_median": round(statistics.median(paired), 3),
        "rows_dropped_by_the_spec_option": dropped,
    }


def norms_report(rows: Any, positions: Any) -> dict[str, Any]:
    norms = rows.float().norm(dim=1)
    median = float(norms.median())
    over = norms > TIMES_MEDIAN * median
    squares = norms.double().square()
    return {
        "rows": len(norms),
        "median_norm": round(median, 2),
        "p99_9_norm": round(float(norms.quantile(0.999)), 2),
        "max_norm": round(float(norms.max()), 2),
        "rows_over_10x_median": int(over.sum()),
        "their_norms": sorted(round(float(n), 1) for n in norms[over]),
        "their_positions": sorted(int(p) for p in positions[over]),
        "their_share_of_squared_norm": round(float(squares[over].sum() / squares.sum()), 4),
    }


def reading_cost(files: list[Path], rounds: int = 3) -> dict[str, Any]:
    """The reading side's screen per shard against the per-shard load an export does anyway (the median of
    ``rounds`` rounds over every shard, after one that warms both up)."""
    import torch
    from safetensors.torch import load

    from nnqueue.outliers import Outliers, screened

    datas = [file.read_bytes() for file in files]
    option = Outliers("drop", times_median=TIMES_MEDIAN)
    load_s, screen_s = [], []
    for _ in range(rounds + 1):
        loading = screening = 0.0
        for data in datas:
            started = time.perf_counter()
            tensors = load(data)
            widened = {name: (v.float() if v.dtype == torch.bfloat16 else v).numpy() for name, v in tensors.items()}
            loading += time.perf_counter() - started
            started = time.perf_counter()
            key = next(name for name in tensors if name.endswith(".output"))
            screened(tensors, {key: option.limit(1.0)}, "drop")
            screening += time.perf_counter() - started
            del widened
        load_s.append(loading)
        screen_s.append(screening)
    load_median, screen_median = statistics.median(load_s[1:]), statistics.median(screen_s[1:])
    return {
        "shard_bytes": sum(len(data) for data in datas),
        "load_and_widen_s": round(load_median, 3),
        "screen_s": round(screen_median, 3),
        "screen_over_load": round(screen_median / load_median, 3),
    }


def train(rows: Any, batch: int, epochs: int, seed: int) -> list[float]:
    """Per-step MSE losses of an SAE trained on ``rows`` (float32), the batches drawn in a seeded order."""
    import torch
    from sae_lens import StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.saes.sae import TrainStepInput

    torch.manual_seed(seed)
    d_in = rows.shape[1]
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=d_in, d_sae=4 * d_in, l1_coefficient=5.0))
    coefficients = {
        name: getattr(value, "value", value) for name, value in sae.get_coefficients().items()
    }  # {"l1": 5.0}: no warm-up
    optimizer = torch.optim.Adam(sae.parameters(), lr=3e-4)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(epochs):
        order = torch.randperm(len(rows), generator=generator)
        for start in range(0, len(rows) - batch + 1, batch):
            step = TrainStepInput(rows[order[start : start + batch]], coefficients, None, len(losses), False)
            output = sae.training_forward_pass(step)
            optimizer.zero_grad()
            output.loss.backward()
            optimizer.step()
            losses.append(output.losses["mse_loss"].item())
    return losses


def spikes(losses: list[float]) -> dict[str, Any]:
    ratios = [
        loss / statistics.median(losses[step - WINDOW : step]) for step, loss in enumerate(losses) if step >= WINDOW
    ]
    return {
        "steps": len(losses),
        "largest_loss_over_running_median": round(max(ratios), 2) if ratios else None,
        "steps_over_5x": sum(ratio > 5 for ratio in ratios),
        "final_loss": round(statistics.median(losses[-10:]), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the test suite's tiny model (a logic check)")
    parser.add_argument("--paragraphs", type=int, default=1000)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--chunk", type=int, default=64, help="prompts per chunk")
    parser.add_argument("--batch", type=int, default=1024, help="SAE training batch, rows")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--models-dir", type=Path, default=ROOT / ".nnqueue" / "models")
    parser.add_argument("--out", type=Path, help="write the report here as JSON")
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from nnqueue.engines.platform import load_engine
    from nnqueue.outliers import Outliers, screen
    from nnqueue.workers.engine_host import EngineHost

    work = Path(tempfile.mkdtemp(prefix="sae-outliers-"))
    if args.tiny:
        from tests.utils.tiny_model import build_tiny_llama

        model_dir = build_tiny_llama(work / "tiny-llama")
        args.paragraphs, args.layer, args.batch, args.epochs = min(args.paragraphs, 40), 1, 64, 2
    else:
        from rich.console import Console

        from nnqueue.demo import ensure_model

        model_dir, _ = ensure_model(args.models_dir, Console(stderr=True))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = paragraphs(args.paragraphs)
    prompts = [tokenizer(text, add_special_tokens=True).input_ids[:128] for text in texts]

    host = EngineHost()

    async def load() -> Any:
        return load_engine(str(model_dir), dtype="float32", max_model_len=256, seed=0)

    engine = host.call(load())
    try:
        harvested = harvest(host.call, engine.vllm_entrypoint, prompts, args.layer, args.chunk, work)
    finally:
        engine.vllm_entrypoint.shutdown()
        engine.vllm_entrypoint = None
        host.stop()
    shards = [load_file(file) for file in harvested["files"]]
    key = f"model.layers.{args.layer}.output"
    rows = torch.cat([shard[key] for shard in shards]).float()
    positions = torch.cat([shard["token_position"] for shard in shards])
    report: dict[str, Any] = {
        "model": model_dir.name,
        "layer": args.layer,
        "paragraphs": len(texts),
        "tokens": sum(len(p) for p in prompts),
        "harvest": {name: value for name, value in harvested.items() if name != "files"},
        "norms": norms_report(rows, positions),
        "reading_side_cost": reading_cost(harvested["files"]),
    }
    limit = Outliers("drop", times_median=TIMES_MEDIAN).limit(float(rows.norm(dim=1).median()))
    kept = screen({key: rows.clone()}, {key: limit}, "drop").keep
    clipped = rows.clone()
    screen({key: clipped}, {key: limit}, "clip")
    variants = {
        "every row": rows,
        f"rows over {TIMES_MEDIAN:g}x the median dropped": rows if kept is None else rows[kept],
        f"rows over {TIMES_MEDIAN:g}x the median clipped": clipped,
    }
    report["sae"] = {
        "batch_rows": args.batch,
        "epochs": args.epochs,
        **{name: spikes(train(data, args.batch, args.epochs, seed=0)) for name, data in variants.items()},
    }
    shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
