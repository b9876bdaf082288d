"""A seccomp filter for the processes that run users' code: no exec, no network sockets, no ptrace.

Applied (with ``no_new_privs``) in each engine process once the engine is up, right after the switch to
the engine user (:mod:`nnqueue.enginecore.sandbox`), and in each trace builder after its meta model is
loaded. From then on the kernel answers ``EPERM`` to, in every thread of the process (libseccomp's
``CTL_TSYNC``: the threads vLLM, ZMQ and OpenMP started earlier too):

* ``execve`` / ``execveat``: no program can be started (a shell, ``curl``, a setuid binary);
* ``socket`` of any family but ``AF_UNIX``: no TCP/UDP, raw, netlink or packet socket (with vLLM's Ray executor,
  which opens sockets to Ray after start-up, the worker exports ``NNQUEUE_ENGINE_SECCOMP_NETWORK`` and
  ``AF_INET``/``AF_INET6`` stay allowed). Results leave through files the worker uploads. What the engine
  needs after start-up is ``AF_UNIX`` only: vLLM's ZMQ ``ipc://`` sockets are connected before users' code
  runs (ZMQ's internal signalling uses socketpairs), and NCCL/Gloo open their TCP sockets when the
  process group is created, at start-up. Sockets already open stay usable (the netns layer confines
  them to the engine's own loopback);
* ``ptrace``, ``process_vm_readv`` / ``process_vm_writev``, ``pidfd_getfd``, ``kcmp``, ``process_madvise`` /
  ``process_mrelease``: no reading or steering another process;
* ``kill`` & co. and ``pidfd_open`` aimed at any process but itself (its worker, its supervisor, a process
  group, every process: ``0``, ``-1``), and ``pidfd_send_signal`` (whose target, a pidfd or a ``/proc/<pid>``
  folder, the filter cannot read); the stop signals (``SIGSTOP``, ``SIGTSTP``, ``SIGTTIN``, ``SIGTTOU``) even to
  itself, nor as the exit signal of a child it makes; ``prlimit64`` on another process and ``setpriority`` on
  anything but itself. The engine processes of every worker on a host, and the trace builders that run every
  trust domain's code, share the engine user, and the kernel lets a process signal, limit or renice any process
  of its own user: without this, code that took one of them over could freeze another domain's builder or
  another worker's engine (a red-team round did: ``SIGSTOP``), and a process that stopped itself would hold every
  job on its engine. None of them signals another process once it runs users' code: a tensor-parallel engine
  core's workers exit when their death pipe closes (vLLM's SIGTERM after a grace period is refused, and the
  worker, root, ends what is left). Nor may it name a
  file's signal owner (``fcntl`` ``F_SETOWN``, ``F_SETOWN_EX``, ``F_SETSIG``; ``ioctl`` ``FIOSETOWN``,
  ``SIOCSPGRP``): the kernel sends a file's SIGIO to its owner, of the same user, without ``kill``'s path (a
  red-team round stopped builders and another worker's engine that way);
* without ``exec_allowed``, a process of its own: ``fork``, ``vfork``, ``clone`` without ``CLONE_THREAD`` (threads
  stay allowed) and ``clone3`` (answered ``ENOSYS``: its flags are in memory the filter cannot read, and glibc then
  makes threads with ``clone``). A process forked by the engine would outlive it, and a fresh engine at a
  trust-domain switch would run beside it (a red-team round's daemon read the next domain's results from the
  worker's handoff folder);
* what an escape could use to get around these or the kernel's other boundaries: ``io_uring_*`` (its
  ``IORING_OP_SOCKET`` makes sockets without ``socket()``), ``bpf``, ``perf_event_open`` (hardware counters and
  the kernel's sampling of other processes: side channels), ``syslog`` (the kernel's log), ``userfaultfd``,
  ``keyctl`` / ``add_key`` / ``request_key``, ``unshare`` / ``setns`` / ``mount`` / ``umount2`` / ``pivot_root``
  / ``chroot``, ``kexec_*`` and kernel-module loading.

Just-in-time compilers exec a compiler (torch's inductor runs ``g++`` on CPU; Triton runs ``ptxas`` and
``gcc`` on GPU). On the CPU, vLLM compiles its model graphs at start-up, before the filter, and the sampler's
small ``torch.compile`` kernels that vLLM builds on first use (logprobs' ``batched_count_greater_than``) are
built by :func:`nnqueue.enginecore.sandbox.warm_up_jit` before it. On a CUDA engine vLLM's Triton kernels are
compiled when a step first needs them (measured on the H100, vLLM 0.24: the block table's
``_compute_slot_mapping_kernel`` at the first request, running ``ptxas``), so there ``execve`` stays allowed
(``exec_allowed``) and what confines a started program is the engine user, the network namespace and the
protected environment's lock-down (which refuses process creation to every frame but the compilers').

The binding is pyseccomp (ctypes over the system's ``libseccomp.so.2``; API-compatible with libseccomp's
own ``seccomp`` module, used instead when it is importable). Without either, or without libseccomp, the
filter is not applied: :func:`unavailable_reason` says why (the worker logs it and reports it on
``/readyz``), and :func:`install` logs it and returns False; it never fails the engine.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
from types import ModuleType

log = logging.getLogger(__name__)

# What a CUDA engine keeps (``exec_allowed``): Triton execs ptxas for a kernel first compiled at a step, and
# torch.distributed's TCPStore runs a libuv loop on io_uring (both seen on the H100, vLLM 0.24, torch 2.11).
CUDA_RUNTIME_SYSCALLS = ("execve", "execveat", "io_uring_setup", "io_uring_enter", "io_uring_register")
REFUSED_SYSCALLS = (
    "execve",
    "execveat",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "pidfd_send_signal",
    "kcmp",
    "process_madvise",
    "process_mrelease",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "bpf",
    "perf_event_open",
    "syslog",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
)


def _binding() -> ModuleType:
    """pyseccomp, or libseccomp's own binding; raises ImportError/OSError/RuntimeError when neither loads."""
    try:
        import pyseccomp

        return pyseccomp
    except ImportError:
        import seccomp  # Debian's python3-seccomp (outside a venv)

        return seccomp


# Calls that name a process by their first argument, refused for any but the calling process (compared as the
# register holds it: a pid with bits set above pid_t's 32, which the kernel would drop, is refused too), and the
# argument that holds their signal.
SIGNALLING_SYSCALLS = {
    "kill": 1,
    "tkill": 1,
    "tgkill": 2,
    "rt_sigqueueinfo": 1,
    "rt_tgsigqueueinfo": 2,
    "pidfd_open": None,
}
STOP_SIGNALS = (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
_PRIO_PROCESS = 0
# fcntl's F_SETOWN, F_SETSIG and F_SETOWN_EX; ioctl's FIOSETOWN and SIOCSPGRP: a file's signal owner and signal.
_SIGNAL_OWNER_FCNTLS = (8, 10, 15)
_SIGNAL_OWNER_IOCTLS = (0x8901, 0x8902)
_CLONE_THREAD = 0x00010000
_EXIT_SIGNAL = 0xFF  # clone's flags: the signal its parent gets when the child ends
_LOW_32 = 0xFFFFFFFF  # the kernel reads a signal as an int: what is above it must not hide a stop signal


# Address families below AF_INET6 other than AF_UNIX and AF_INET; every family above AF_INET6 is refused too.
_OTHER_LOW_FAMILIES = (0, 3, 4, 5, 6, 7, 8, 9)


def _build(binding: ModuleType, network: bool = False, exec_allowed: bool = False) -> object:
    refuse = binding.ERRNO(errno.EPERM)
    rules = binding.SyscallFilter(defaction=binding.ALLOW)
    rules.set_attr(binding.Attr.CTL_NNP, 1)
    rules.set_attr(binding.Attr.CTL_TSYNC, 1)
    for name in REFUSED_SYSCALLS:
        if exec_allowed and name in CUDA_RUNTIME_SYSCALLS:
            continue
        try:
            rules.add_rule(refuse, name)
        except (OSError, ValueError):  # a syscall this architecture does not have
            continue
    if network:  # AF_UNIX, AF_INET and AF_INET6 only (no packet, netlink, vsock... sockets)
        rules.add_rule(refuse, "socket", binding.Arg(0, binding.GT, socket.AF_INET6))
        for family in _OTHER_LOW_FAMILIES:
            rules.add_rule(refuse, "socket", binding.Arg(0, binding.EQ, family))
    else:
        rules.add_rule(refuse, "socket", binding.Arg(0, binding.NE, socket.AF_UNIX))
    for name, signal_arg in SIGNALLING_SYSCALLS.items():
        rules.add_rule(refuse, name, binding.Arg(0, binding.NE, os.getpid()))
        for stop in () if signal_arg is None else STOP_SIGNALS:
            rules.add_rule(refuse, name, binding.Arg(signal_arg, binding.MASKED_EQ, _LOW_32, stop))
    for command in _SIGNAL_OWNER_FCNTLS:
        rules.add_rule(refuse, "fcntl", binding.Arg(1, binding.MASKED_EQ, _LOW_32, command))
    for request in _SIGNAL_OWNER_IOCTLS:
        rules.add_rule(refuse, "ioctl", binding.Arg(1, binding.MASKED_EQ, _LOW_32, request))
    for stop in STOP_SIGNALS:  # a child's exit signal goes to its parent: this process
        rules.add_rule(refuse, "clone", binding.Arg(0, binding.MASKED_EQ, _EXIT_SIGNAL, stop))
    if not exec_allowed:
        rules.add_rule(refuse, "fork")
        rules.add_rule(refuse, "vfork")
        rules.add_rule(refuse, "clone", binding.Arg(0, binding.MASKED_EQ, _CLONE_THREAD, 0))
        rules.add_rule(binding.ERRNO(errno.ENOSYS), "clone3")
    rules.add_rule(refuse, "prlimit64", binding.Arg(0, binding.NE, 0))  # 0: this process (glibc's setrlimit)
    rules.add_rule(refuse, "setpriority", binding.Arg(0, binding.NE, _PRIO_PROCESS))
    rules.add_rule(refuse, "setpriority", binding.Arg(1, binding.NE, 0))
    return rules


def unavailable_reason() -> str | None:
    """Why the filter cannot be applied here (no binding, no libseccomp), or None when it can."""
    try:
        _build(_binding())
    except (ImportError, OSError, RuntimeError, AttributeError) as error:
        return f"seccomp filter unavailable: {type(error).__name__}: {error} (pip install pyseccomp; apt-get install libseccomp2)"
    return None


def install(network: bool = False, exec_allowed: bool = False) -> bool:
    """Apply the filter (and ``no_new_privs``) to every thread of this process; irreversible. From then on it
    signals nothing but itself: install it in the process it protects, after any fork that shares it.

    ``network``: also allow ``AF_INET``/``AF_INET6`` sockets, for an engine under vLLM's Ray executor
    (``NNQUEUE_ENGINE_SECCOMP_NETWORK``).
    ``exec_allowed``: leave ``execve``, io_uring and process creation allowed, for a CUDA engine
    (:data:`CUDA_RUNTIME_SYSCALLS`).
    Returns False, after logging why, when it cannot be applied; never raises for that.
    """
    try:
        rules = _build(_binding(), network, exec_allowed)
        rules.load()  # type: ignore[attr-defined]
    except (ImportError, OSError, RuntimeError, AttributeError) as error:
        log.error("NOT applying the seccomp filter to process: %s: %s", type(error).__name__, error)
        return False
    return True
