"""No network for the processes that run users' code: a network namespace of their own, loopback only.

The engine core, its model-runner workers and the trace builders run intervention code. Whatever else
holds (the protected environment, the engine user, the scrubbed environment), code that escapes must
not be able to open a connection to the service's database, broker or object store, nor to anything
else. So a root worker starts those processes in a fresh network namespace (``unshare(CLONE_NEWNET)``)
in which only ``lo`` is up (``SIOCSIFFLAGS`` on a socket of the namespace: the images have no ``ip``):
every ``connect`` to another host fails with ``ENETUNREACH``, and the namespace's loopback is its own,
so the worker's host services on ``127.0.0.1`` are not there either.

What the engine needs still works inside:

* vLLM's front end (the worker) talks to the engine core over ZMQ ``ipc://`` sockets
  (``vllm.v1.utils.get_engine_client_zmq_addr(local_only=True)``: paths in the temp folder). Unix sockets
  with a path are found through the file system, which the namespaces share; abstract ones and TCP
  would not cross.
* Tensor parallelism (vLLM's ``mp`` executor, ``vllm.v1.executor.multiproc_executor``) spawns its
  model-runner workers from the engine core, so they are born in the same namespace. Their
  ``torch.distributed`` rendezvous is a TCP store on ``get_loopback_ip()``, and NCCL bootstraps over
  TCP on the only interface there is, ``lo``; the data then moves over NVLink/PCIe (CUDA IPC, which is
  no network). ``VLLM_HOST_IP`` is set to ``127.0.0.1`` for the engine so that ``get_ip()`` (which asks
  the routing table for 8.8.8.8, unreachable here) names loopback. Measured before this module on
  2x H200: TP=2 runs inside ``unshare -n`` with ``lo`` up.
* Ray (``distributed_executor_backend="ray"``, multi-node) needs the real network between its
  nodes: a worker that uses it runs its engine on the host's network and says so at start.

How the processes get there: :mod:`nnqueue.enginecore.spawning` (a fresh thread enters the namespace with
:func:`new_namespace` and starts the engine core; a process that starts single-threaded isolates itself first
thing, :func:`isolate_this_process`).

Entering a network namespace needs ``CAP_SYS_ADMIN``: a root worker has it (and its engine drops to the
engine user afterwards, so users' code cannot ``setns`` back). An unprivileged worker could only do it
inside a new user namespace, which must be created by a single-threaded process and remaps every file's
owner; it runs its engine on the host's network instead and says so, as does a root worker in a container
that was not granted ``CAP_SYS_ADMIN`` (``NNQUEUE_ENGINE_NETWORK``: ``auto``, the default, isolates where it
can; ``isolated`` refuses to start without it; ``host`` never isolates).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from nnqueue.errors import NNqueueError
from nnqueue.libc import check, libc

log = logging.getLogger(__name__)

# How the engine's processes reach the network: what the worker exports to them (``NNQUEUE_ENGINE_NETWORK``).
NETWORK_ENV = "NNQUEUE_ENGINE_NETWORK"
ISOLATED, HOST = "isolated", "host"
Mode = Literal["auto", "isolated", "host"]

_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sh22x"  # struct ifreq: the interface's name, then ifr_flags in the 24-byte union


class NetworkIsolationError(NNqueueError):
    """A network namespace could not be made or entered."""


def resolve(mode: Mode, *, ray: bool = False) -> tuple[str, str | None]:
    """``(ISOLATED or HOST, why not isolated)`` for the setting ``mode``; raises :class:`NetworkIsolationError`
    when ``mode`` is ``isolated`` and this process cannot isolate."""
    if mode == HOST:
        return HOST, "NNQUEUE_ENGINE_NETWORK=host"
    if ray:
        return HOST, "the Ray executor needs the network between its nodes"
    if os.geteuid() != 0:
        if mode == ISOLATED:
            raise NetworkIsolationError(
                "NNQUEUE_ENGINE_NETWORK=isolated needs a root worker (CAP_SYS_ADMIN, to make a network namespace)"
            )
        return HOST, "the worker is not root (a network namespace needs CAP_SYS_ADMIN)"
    try:  # on a thread of its own, which ends with its namespace
        with ThreadPoolExecutor(1, thread_name_prefix="nnqueue-netns-check") as pool:
            pool.submit(new_namespace).result()
    except (OSError, NetworkIsolationError) as error:
        why = f"a network namespace could not be made here ({error}): a container must grant CAP_SYS_ADMIN"
        if mode == ISOLATED:
            raise NetworkIsolationError(f"NNQUEUE_ENGINE_NETWORK=isolated, but {why}") from None
        return HOST, why
    return ISOLATED, None


def _check(result: int, what: str) -> None:
    check(result, what, NetworkIsolationError)


def new_namespace() -> None:
    """Move the calling thread into a fresh network namespace and bring its loopback up."""
    _check(libc().unshare(_CLONE_NEWNET), "unshare(CLONE_NEWNET)")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # a socket of the new namespace
        answer = fcntl.ioctl(probe, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0))
        flags = struct.unpack(_IFREQ, answer)[1]
        fcntl.ioctl(probe, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


def isolate_this_process() -> None:
    """Move this whole process into a fresh, loopback-only network namespace. Only a single-threaded
    process can (``unshare`` moves the calling thread alone): call it first thing in ``main``."""
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise NetworkIsolationError(f"cannot isolate a process that already runs {threads} threads")
    new_namespace()


def isolate_if_asked() -> bool:
    """What a child that runs users' code calls first: isolate it when the worker said so
    (``$NNQUEUE_ENGINE_NETWORK=isolated``); whether it did."""
    if os.environ.get(NETWORK_ENV) != ISOLATED:
        return False
    isolate_this_process()
    return True


def engine_environment(network: str) -> dict[str, str]:
    """What the engine's processes inherit for ``network``: the mode, and loopback as vLLM's host address."""
    environ = {NETWORK_ENV: network}
    if network == ISOLATED:
        environ["VLLM_HOST_IP"] = "127.0.0.1"
    return environ
