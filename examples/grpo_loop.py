"""A GRPO-style loop against an nnqueue worker: TRL's own, unmodified ``VLLMClient`` generates with the worker and
pushes the policy's weights into its engine over NCCL every ``--push-every`` steps, and between two pushes a
harvest of fixed probe prompts, pinned to the version being served, records in its manifest which weights it
captured. Interpretability while training: the same prompts, harvested at each step of the policy.

The worker (GPU 0; docs/user/weights.md)::

    NNQUEUE_TRAINER_PORT=8010 NNQUEUE_TRAINER_NCCL_PORT=51216 NNQUEUE_ENGINE_NETWORK=host \\
        nnqueue worker --model Qwen/Qwen2.5-0.5B-Instruct --model-key policy
    nnqueue keys create trainer --scope weights --scope harvest

This script (the trainer, GPU 1; ``pip install 'nnqueue[train]'``, TRL <= 1.8)::

    CUDA_VISIBLE_DEVICES=1 python examples/grpo_loop.py --model Qwen/Qwen2.5-0.5B-Instruct --model-key policy \\
        --worker http://127.0.0.1:8010 --api http://127.0.0.1:8000 --key nnq_...

The loss is GRPO's policy-gradient term with group-normalized advantages (no KL term, one gradient step per batch)
and the reward a toy one (shorter completions that contain a digit): the point is the loop's plumbing, not the
training.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.generation.vllm_client import VLLMClient

from nnqueue.client import Client

PROMPTS = ["Write a number between 1 and 9:", "How many legs does a spider have?", "Name a prime number:"]
PROBES = ["The capital of France is", "2 + 2 =", "My favourite colour is"]


def reward(completion: str) -> float:
    """A toy reward: a digit is good, length is not."""
    return (1.0 if re.search(r"\d", completion) else 0.0) - 0.01 * len(completion)


def grpo_step(
    policy: Any,
    optimizer: Any,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    rewards: list[float],
    group: int,
) -> float:
    """One GRPO update: each completion's log-likelihood weighted by its group-normalized reward."""
    grouped = torch.tensor(rewards).view(-1, group)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
    loss = torch.zeros((), device=policy.device)
    for index, completion in enumerate(completion_ids):
        prompt = prompt_ids[index // group]
        ids = torch.tensor([prompt + completion], device=policy.device)
        logits = policy(ids).logits[0, len(prompt) - 1 : -1]
        picked = torch.log_softmax(logits.float(), -1).gather(1, ids[0, len(prompt) :, None]).sum()
        loss = loss - advantages[index] * picked / len(completion_ids)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss)


def harvest_probes(nnqueue: Client, model_key: str, layer: int) -> dict[str, Any]:
    """The probe prompts' last-token activations at one layer, on the version served now; the manifest."""
    spec = {
        "model_key": model_key,
        "dataset": {"prompts": PROBES},
        "captures": [{"module": f"model.layers.{layer}"}],
        "selection": {"kind": "last"},
        "weights_version": "latest",  # every chunk on the version served at submit
    }
    return nnqueue.harvest(spec).wait().manifest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="The policy's checkpoint (the one the worker serves).")
    parser.add_argument("--model-key", required=True)
    parser.add_argument("--worker", default="http://127.0.0.1:8010", help="The worker's TRL protocol URL.")
    parser.add_argument("--group-port", type=int, default=51216, help="The worker's NNQUEUE_TRAINER_NCCL_PORT.")
    parser.add_argument("--api", default="http://127.0.0.1:8000", help="nnqueue's API, for the harvests.")
    parser.add_argument("--key", required=True, help="A key with the weights and harvest scopes.")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--push-every", type=int, default=2)
    parser.add_argument("--group", type=int, default=4, help="Completions per prompt (GRPO's group).")
    parser.add_argument("--layer", type=int, default=6)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to("cuda:0")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    vllm = VLLMClient(base_url=args.worker, group_port=args.group_port, connection_timeout=60)
    vllm.session.headers["Authorization"] = f"Bearer {args.key}"  # the client itself is TRL's, unmodified
    vllm.init_communicator(device=0)
    nnqueue = Client(args.api, args.key)

    manifest = harvest_probes(nnqueue, args.model_key, args.layer)
    print(f"step 0: probes harvested on weights {manifest['weights_versions']}")
    for step in range(1, args.steps + 1):
        out = vllm.generate(PROMPTS, n=args.group, temperature=1.0, max_tokens=24)
        texts = tokenizer.batch_decode(out["completion_ids"], skip_special_tokens=True)
        rewards = [reward(text) for text in texts]
        loss = grpo_step(policy, optimizer, out["prompt_ids"], out["completion_ids"], rewards, args.group)
        print(f"step {step}: loss {loss:.4f}, mean reward {sum(rewards) / len(texts):.3f}")
        if step % args.push_every == 0:
            vllm.update_model_params(policy)  # every parameter, over NCCL
            vllm.reset_prefix_cache()  # ends the update: the worker serves a new version
            manifest = harvest_probes(nnqueue, args.model_key, args.layer)
            print(f"step {step}: pushed; probes harvested on weights {manifest['weights_versions']}")
    vllm.close_communicator()


if __name__ == "__main__":
    main()
