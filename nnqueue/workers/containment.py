"""How a worker contains its engine: decided once at start-up, before the engine, and exported to its processes.

The engine's processes run users' code (traces) and capture harvests. They must find no secret in their
environment or their parent, no network but their own loopback (:mod:`nnqueue.netns`), no file but what the
engine reads and the folders it hands results through (:mod:`nnqueue.mountns`), and run as an account of their
own with no capability (:mod:`nnqueue.isolation`). :func:`isolate` decides each from the settings and what this
machine allows, says what it decided on the console (a warning for anything less than all of it), and exports it
for the engine's processes; :func:`engine_view` plans the filesystem they see once the folders they write exist.
A worker whose containment is degraded runs no other owner's trace (:meth:`nnqueue.isolation.Containment.refusal`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nnqueue import cgroups, isolation, mountns, netns, probe_memo, seccomp_filter
from nnqueue.enginecore import sandbox, spawning
from nnqueue.settings import Settings

log = logging.getLogger(__name__)

NETWORK_ISOLATED = "a network namespace of its own (loopback only)"
FILESYSTEM_PRIVATE = (
    "a private filesystem view (read-only: Python, the model, its caches; writable: its handoff folders)"
)


def isolate(
    settings: Settings, model: str, engine_kwargs: dict[str, Any], ray: bool = False, nccl: bool = False
) -> isolation.Containment:
    """Remove the secrets from the environment the engine will inherit, keep the engine out of ours, and
    choose the engine processes' network (:func:`nnqueue.netns.resolve`: ``NNQUEUE_ENGINE_NETWORK``), filesystem
    (:func:`nnqueue.mountns.resolve`: ``NNQUEUE_ENGINE_FILESYSTEM``) and user
    (:func:`nnqueue.isolation.plan_containment`, whose probe runs in that network and filesystem: raises
    :class:`nnqueue.isolation.EngineUserError` when the worker must not start).

    Also: the engine reads its settings from the environment (never ``.env``), and its processes are
    spawned, not forked, so that none starts with a copy of this process's memory (settings, clients).
    ``nccl``: a trainer pushes weights over NCCL (:mod:`nnqueue.workers.trl_server`): the engine's rank 0 listens
    for the trainer's group, so its processes keep the host's network and may open TCP sockets, as with Ray.
    """
    if nccl and settings.engine_network == netns.ISOLATED:
        raise netns.NetworkIsolationError(
            "NNQUEUE_TRAINER_NCCL_PORT needs the engine on the host's network (the trainer joins its NCCL group);"
            " unset NNQUEUE_ENGINE_NETWORK=isolated or the NCCL port"
        )
    network, network_why = netns.resolve(settings.engine_network, ray=ray)
    if nccl and network == netns.ISOLATED:
        network, network_why = netns.HOST, "a trainer's NCCL group (NNQUEUE_TRAINER_NCCL_PORT) needs the host's network"
    isolated = network == netns.ISOLATED
    isolation.anchor_python_path()
    probe_view = mountns.plan(
        engine_reads(model, engine_kwargs), [], home=Path.home(), sockets_kept=None, workdir=Path.cwd()
    )
    filesystem, filesystem_why = mountns.resolve(settings.engine_filesystem, probe_view)
    private = filesystem == mountns.PRIVATE
    ray = ray or nccl  # sockets: the seccomp filter's and the protected environment's allowances
    seccomp = seccomp_filter.unavailable_reason() if settings.engine_seccomp else "off (NNQUEUE_ENGINE_SECCOMP=false)"
    # The engine hands results to this process through files; only Ray's executor opens sockets after start-up.
    if seccomp is None and ray:
        seccomp = "seccomp filter applied, with TCP/UDP sockets allowed: the engine's Ray executor needs them"
    contained = functools.partial(spawning.contained, network=isolated, view=probe_view if private else None)
    containment = isolation.plan_containment(
        settings.engine_user,
        settings.engine_user_required,
        seccomp,
        sandbox.PROBE_MODULES,
        files=model_files(model),
        contained=contained,
        memo=probe_memo.DEFAULT_FOLDER,
        where=json.dumps([isolated, probe_view.to_json() if private else None]),
    )
    containment = dataclasses.replace(
        containment,
        network_isolated=isolated,
        network_note=NETWORK_ISOLATED if isolated else f"the host's network: {network_why}",
        filesystem_private=private,
        filesystem_note=FILESYSTEM_PRIVATE if private else f"the host's filesystem: {filesystem_why}",
        operators=tuple(settings.operator_owners),
        memory_note=cgroups.create(settings.engine_memory_max, settings.engine_tasks_max)[1],
    )
    say(containment)
    warn_if_degraded(containment)
    env_file = Path(str(Settings.model_config.get("env_file")))
    for warning in isolation.env_file_warnings(env_file, containment.engine_user or ""):
        log.warning("%s", warning)
    removed = isolation.scrub_environment(settings.secret_env_patterns)
    isolation.make_non_dumpable()
    os.environ.update(settings.engine_environment())
    os.environ[isolation.ENGINE_USER_ENV] = containment.engine_user or ""
    os.environ[isolation.SECCOMP_NETWORK_ENV] = "true" if ray else "false"
    isolation.mark_engine_sandbox()
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    os.environ.update(netns.engine_environment(network))
    log.info("removed %d secret variables from the engine's environment", len(removed))
    return containment


def say(containment: isolation.Containment) -> None:
    """The containment on the console: one line per layer."""
    (log.info if containment.engine_user else log.warning)("engine isolation: %s", containment.note)
    (log.info if containment.network_isolated else log.warning)(
        "engine isolation: the engine's processes use %s", containment.network_note
    )
    (log.info if containment.filesystem_private else log.warning)(
        "engine isolation: the engine's processes see %s", containment.filesystem_note
    )
    if containment.seccomp:
        log.warning("engine isolation: %s", containment.seccomp)
    # A root worker without the bound says so louder: its engine could take the host's memory.
    bounded = cgroups.asked() is not None or os.geteuid() != 0
    (log.info if bounded else log.warning)("engine isolation: the engine's memory: %s", containment.memory_note)


def warn_if_degraded(containment: isolation.Containment) -> None:
    """One warning that sums up a degraded containment and what the worker runs because of it."""
    if degradations := containment.degradations():
        log.warning(
            "engine isolation DEGRADED (%s): this worker runs %s; see docs/operator/engine-isolation.md",
            "; ".join(degradations),
            containment.traces(),
        )


def engine_reads(model: str, engine_kwargs: dict[str, Any]) -> list[Path]:
    """What the engine's processes read: the interpreter and the virtualenv (:func:`nnqueue.isolation.interpreter_paths`,
    the prefixes, ``sys.path`` but the working folder), the model, the engine arguments that name a file or
    folder (a tokenizer, a download folder), the Hugging Face hub's cache (models named by repository) and the C
    compiler's installation (`compiler_paths`)."""
    from huggingface_hub import constants

    paths = [*isolation.interpreter_paths(), Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix)]
    paths += [Path(entry) for entry in sys.path if entry and Path(entry).is_dir() and Path(entry) != Path.cwd()]
    named = [model, *(value for value in engine_kwargs.values() if isinstance(value, str) and os.sep in value)]
    paths += [Path(value).absolute() for value in named if os.path.exists(value)]
    paths.append(Path(constants.HF_HUB_CACHE))
    return paths + compiler_paths()


def compiler_paths() -> list[Path]:
    """Where the C compiler that Triton and inductor build their helpers with is installed (``$CC``, else ``gcc``
    or ``cc`` on ``PATH``; the folder above its ``bin/``): one outside ``/usr`` (an ``/opt/gcc``) is otherwise
    missing from the engine's view, and the engine's first sampling step fails to build Triton's CUDA helper."""
    found: list[Path] = []
    for name in filter(None, (os.environ.get("CC"), shutil.which("gcc"), shutil.which("cc"))):
        path = Path(shutil.which(name) or name)
        if not path.is_file():
            continue
        for each in (path.absolute(), path.resolve()):
            prefix = each.parent.parent if each.parent.name == "bin" else each.parent
            if prefix != Path(prefix.anchor) and prefix not in found:
                found.append(prefix)
    return found


def model_files(model: str) -> list[Path]:
    """A file of a local model that the engine user must be able to read (its config), for the start-up probe."""
    config = Path(model, "config.json")
    return [config.absolute()] if config.is_file() else []


def engine_view(
    model: str, engine_kwargs: dict[str, Any], writable: list[Path], readable: Sequence[Path] = ()
) -> mountns.View:
    """The filesystem view of the engine's processes, exported for the children that enter it themselves: what
    :func:`engine_reads` names and ``readable``, read-only; ``writable`` (the handoff and crash folders), a folder of root's for
    vLLM's ``ipc://`` sockets (``VLLM_RPC_BASE_PATH``: the worker makes them, the engine connects before it drops
    to the engine user) and the caches of compiled kernels, which the engine fills as root before the switch
    (vLLM's, inductor's and, where Triton is installed, Triton's: reused at the next start), writable."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    sockets = Path(tempfile.mkdtemp(prefix="nnqueue-ipc-"))
    os.environ["VLLM_RPC_BASE_PATH"] = str(sockets)
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    caches = [Path(os.environ.get("VLLM_CACHE_ROOT") or cache_root / "vllm"), Path(cache_dir())]
    if importlib.util.find_spec("triton") is not None:
        caches.append(Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton")
    for cache in caches:
        cache.mkdir(parents=True, exist_ok=True)
    view = mountns.plan(
        [*engine_reads(model, engine_kwargs), *readable],
        [*writable, sockets, *caches],
        home=Path.home(),
        sockets_kept=sockets,
        workdir=Path.cwd(),
    )
    os.environ[mountns.VIEW_ENV] = view.to_json()
    return view


def engine_core_kwargs(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM's engine arguments, with its multiprocessing executor (tensor or pipeline parallelism on one node)
    replaced by the one whose engine core enters the sandbox too
    (:class:`nnqueue.enginecore.parallel_executor.SandboxedMultiprocExecutor`)."""
    ranks = int(engine_kwargs.get("tensor_parallel_size", 1)) * int(engine_kwargs.get("pipeline_parallel_size", 1))
    one_node = int(engine_kwargs.get("nnodes", 1)) == 1
    if ranks == 1 or not one_node or engine_kwargs.get("distributed_executor_backend") not in (None, "mp"):
        return engine_kwargs
    from nnqueue.enginecore.parallel_executor import SandboxedMultiprocExecutor

    return {**engine_kwargs, "distributed_executor_backend": SandboxedMultiprocExecutor}
