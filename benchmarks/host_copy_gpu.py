"""What a host copy of an 8B model's weights costs on a GPU: pinned memory (the weights guard's, `_host_copy`) against
pageable memory, each twice in one process (the second pinned round reuses PyTorch's cached pinned blocks).

    python benchmarks/host_copy_gpu.py     # on a GPU host; 15 GB of device memory

One H200, 2026-12-01 (benchmarks/RESULTS.md): pinned 7.86 s the first time, 0.28 s the second; pageable 9.8-12.4 s.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def timed(name: str, tensors: list[torch.Tensor], make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors) / 1e9
    torch.cuda.synchronize()
    started = time.perf_counter()
    copies = [make(tensor) for tensor in tensors]
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    print(f"{name}: {total:.1f} GB in {elapsed:.2f} s ({total / elapsed:.1f} GB/s)", flush=True)
    del copies


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor)


def pageable(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)


def main() -> None:
    weights = [torch.randn(4096, 14336, dtype=torch.bfloat16, device="cuda") for _ in range(128)]  # 15 GB
    for _ in range(2):
        timed("pinned", weights, pinned)
        timed("pageable", weights, pageable)


if __name__ == "__main__":
    main()
