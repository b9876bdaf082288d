"""The KV cache's blocks that no running request holds, zeroed at a trust-domain switch.

A trace can read the KV cache (``model.layers[0].self_attn.attn._module.kv_cache``): a red-team round read back,
from a trace, the keys and values an earlier request of another owner had left in blocks since freed (matched
exactly against a re-run of her prompt). vLLM frees a finished request's blocks without clearing them. At a
switch between trust domains nothing of the old domain is in flight, so every block is zeroed but those of the
requests still running that carry no trace (harvests and steering jobs of any owner: zeroing their blocks would
change their results). A request that carries a trace and is still listed by the runner (a trace finished in
the last step, dropped at the next) is the old domain's: its blocks are zeroed too.

What this relies on, in vLLM's model runner (0.24 and 0.32): ``requests`` (each request's ``block_ids``, a list of
block ids per KV cache group, ids into one pool of ``kv_cache_config.num_blocks``) and ``kv_caches`` (a tensor per
layer whose first dimension, or second for a ``(2, blocks, ...)`` key/value layout, indexes the blocks, as a
multiple of the pool's size where a backend splits each block into kernel blocks). A tensor with no such
dimension is left as it is, and logged. With prefix caching on (nnsight's default is off), free blocks still
serve later prompts that share a prefix: nothing is zeroed, and the switch's log says so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)


def clear_free_blocks(runner: Any, traced: Iterable[str], prefix_caching: bool) -> int | None:
    """Zero every block of ``runner``'s KV cache but those held by its requests that are not in ``traced`` (the ids
    of the requests that carry a trace); the number of blocks zeroed, or None when nothing was (prefix caching)."""
    if prefix_caching:
        log.warning("prefix caching is on: the KV cache's free blocks keep earlier requests' keys and values")
        return None
    skipped = set(traced)
    num_blocks = int(runner.kv_cache_config.num_blocks)
    free = torch.ones(num_blocks, dtype=torch.bool)
    for request_id, request in runner.requests.items():
        if request_id not in skipped:
            for group in request.block_ids:
                free[group] = False
    blocks = free.nonzero().flatten()
    indices: dict[tuple[torch.device, int], torch.Tensor] = {}  # built once per device and kernel blocks per block
    for kv in runner.kv_caches:
        if not isinstance(kv, torch.Tensor):
            continue
        dim = _blocks_dim(kv, num_blocks)
        if dim is None:
            log.warning(
                "KV cache tensor of shape %s has no dimension of its %d blocks: not cleared", kv.shape, num_blocks
            )
            continue
        ratio = kv.shape[dim] // num_blocks
        if (kv.device, ratio) not in indices:
            indices[kv.device, ratio] = (blocks[:, None] * ratio + torch.arange(ratio)).flatten().to(kv.device)
        kv.index_fill_(dim, indices[kv.device, ratio], 0)
    return len(blocks)


def _blocks_dim(kv: torch.Tensor, num_blocks: int) -> int | None:
    """The dimension of ``kv`` that indexes the blocks (see the module doc), or None."""
    for dim in range(min(2, kv.ndim)):
        if kv.shape[dim] >= num_blocks and kv.shape[dim] % num_blocks == 0:
            return dim
    return None
