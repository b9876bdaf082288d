"""Changing a running engine's weights, through vLLM's own loader: a safetensors checkpoint (every tensor or named
ones), or tensors a trainer broadcasts over NCCL (TRL's vLLM server protocol, :mod:`nnqueue.workers.trl_server`).

Both feed ``(name, tensor)`` pairs in the checkpoint's naming to the model's ``load_weights`` (vLLM's model
classes, e.g. ``LlamaForCausalLM.load_weights``: it maps checkpoint names to its fused parameters and each
parameter's ``weight_loader`` copies this rank's shard in place, so CUDA graphs' pointers stay valid). Under tensor
parallelism every rank runs the same call with the full tensor and keeps its shard, as TRL's own worker extension
does. A checkpoint goes through vLLM's in-place reload where it exists (:func:`load_checkpoint`). Reached only through nnqueue's RPC methods (:mod:`nnqueue.enginecore.rpc`), between steps, never from users'
code; the worker pauses every request around them (:mod:`nnqueue.workers.weights`).

The trainer's channel (:class:`TrainerChannel`) is TRL's: a ``StatelessProcessGroup`` (``vllm.distributed.utils``)
of the engine's ranks plus the trainer (the last rank), and a ``PyNcclCommunicator``
(``vllm.distributed.device_communicators.pynccl``) over it. Rank 0's ``TCPStore`` is built here in C++
(``torch.distributed.TCPStore``), not by ``StatelessProcessGroup.create``, whose Python ``socket.bind`` the
protected environment's lock-down refuses; it listens only on the host and port the worker was configured with.
Every wait has a deadline: the store's (``timeout_s``), the barrier's, and the broadcast's (a CUDA event polled
until ``timeout_s``): a trainer that goes away mid-update raises :class:`ChannelTimeout`, it never hangs the engine.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from nnqueue.errors import NNqueueError


class WeightsLoadError(NNqueueError):
    """A checkpoint that cannot be loaded as asked (a named tensor it lacks, a tensor the model does not take)."""


class ChannelTimeout(NNqueueError):
    """The trainer did not send within the channel's deadline."""


def checkpoint_names(files: list[str]) -> dict[str, str]:
    """Each tensor's name in the safetensors ``files`` (headers only), with its file."""
    from safetensors import safe_open

    names: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            names.update(dict.fromkeys(handle.keys(), file))
    return names


def checkpoint_plan(files: list[str], tensors: list[str] | None) -> dict[str, str]:
    """The tensors to load, each with its file: every tensor of ``files``, or the named ``tensors``; raises
    :class:`WeightsLoadError` for a named tensor the files lack, before anything is loaded."""
    where = checkpoint_names(files)
    if tensors is None:
        return where
    missing = sorted(set(tensors) - set(where))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise WeightsLoadError(f"the checkpoint has no tensor {shown}")
    return {name: where[name] for name in dict.fromkeys(tensors)}


def read_checkpoint(plan: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of ``plan`` (:func:`checkpoint_plan`), file by file."""
    from safetensors import safe_open

    for file in dict.fromkeys(plan.values()):
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name, found in plan.items():
                if found == file:
                    yield name, handle.get_tensor(name)


def load_checkpoint(model_runner: Any, files: list[str], tensors: list[str] | None) -> int:
    """Load the checkpoint into the runner's model; the number of tensors fed.

    Through the runner's ``reload_weights(weights_iterator=..., is_checkpoint_format=True)`` where vLLM has it
    (``vllm.model_executor.model_loader.reload``: it puts each layer back in checkpoint form, loads, and runs the
    layer's ``process_weights_after_loading`` again, so weights that vLLM repacked after loading (the CPU
    backend's packed GEMM weights, quantized kernels) are rebuilt, and copies the result into the same storage).
    A layer is processed from what this load gave it, so a partial checkpoint must hold every tensor of each layer
    it touches (``q_proj``, ``k_proj`` and ``v_proj`` together, say). Older vLLM: the model's ``load_weights``
    (unquantized models on a GPU, where weights are used as loaded).

    The files and names are checked before the reload begins: vLLM's reload first moves every layer's parameters
    to the meta device and puts them back only when it finishes (``finalize_layerwise_reload``), so a load that
    raised inside it left the model on meta parameters: the next load failed on them (``Attempted to load weight
    ... into parameter (torch.Size([0]))``), whatever the worker restored. A load that fails inside it all the same
    (a tensor of the wrong shape) is finished there, which puts the layers' own tensors back, before the caller
    restores their values (:meth:`nnqueue.enginecore.rpc.NNqueueRPC.nnqueue_load_weights`)."""
    plan = checkpoint_plan(files, tensors)
    reload = getattr(model_runner, "reload_weights", None)
    with torch.no_grad():
        if callable(reload) and "weights_iterator" in inspect.signature(reload).parameters:
            try:
                reload(weights_iterator=read_checkpoint(plan), is_checkpoint_format=True)
            except BaseException:
                _finish_reload(model_runner)
                raise
        else:
            model_runner.get_model().load_weights(read_checkpoint(plan))
    return len(plan)


def _finish_reload(model_runner: Any) -> None:
    """Put back the tensors of the layers that vLLM's in-place reload moved to the meta device, after it raised."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    finalize_layerwise_reload(model_runner.get_model(), model_runner.model_config)


class TrainerChannel:
    """This rank's end of a trainer's NCCL group (see the module doc)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device, timeout_s: float):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        store = torch.distributed.TCPStore(
            host_name=host,
            port=port,
            world_size=world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=timeout_s),
            use_libuv=False,
        )
        self.group = StatelessProcessGroup(rank=rank, world_size=world_size, store=store)
        self.communicator = PyNcclCommunicator(self.group, device=device)
        self.trainer_rank = world_size - 1
        self.device, self.timeout_s = device, timeout_s

    def receive(self, name: str, dtype: str, shape: list[int]) -> torch.Tensor:
        """The tensor the trainer broadcasts next (TRL's ``update_named_param``: broadcast, then barrier)."""
        kind = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(kind, torch.dtype):
            raise WeightsLoadError(f"{name}: unknown dtype {dtype!r}")
        tensor = torch.empty(tuple(shape), dtype=kind, device=self.device)
        stream = torch.cuda.current_stream(self.device)
        self.communicator.broadcast(tensor, src=self.trainer_rank, stream=stream)
        done = torch.cuda.Event()
        done.record(stream)
        deadline = time.monotonic() + self.timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                raise ChannelTimeout(f"the trainer sent no {name!r} within {self.timeout_s:g} s")
            time.sleep(0.0005)
        if "timeout" in inspect.signature(self.group.barrier).parameters:  # vLLM's barrier has had no deadline
            self.group.barrier(timeout=self.timeout_s)
        else:
            self.group.barrier()
        return tensor

    def close(self) -> None:
        communicator: Any = self.communicator
        destroy = getattr(communicator, "destroy", None)
        if callable(destroy):
            destroy()
