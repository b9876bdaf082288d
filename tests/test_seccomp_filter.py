"""nnqueue.seccomp_filter in a process of its own (an engine-like one: threads already running, the filter applied
after start-up): exec, non-unix sockets, ptrace, signals (or a limit, a priority) aimed at any other process, of its
user too, a file's signal owner, stop signals and a process of its own fail with EPERM in every thread; what the
engine still needs (unix sockets, threads, signalling itself, its own limits) works; without a binding nothing
breaks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

ENGINE_LIKE = textwrap.dedent(
    """
    import ctypes, errno, fcntl, json, os, resource, signal, socket, struct, subprocess, sys, threading
    from nnqueue import seccomp_filter

    # Stand in for the worker and for a process of the same user (another domain's trace builder, another worker's
    # engine), which both outlive this process: not on its output pipes, which the test reads to their end.
    worker, sibling = (
        subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)
    )
    started, go, from_thread = threading.Event(), threading.Event(), {}

    def attempt(action):
        try:
            action()
        except OSError as error:
            return errno.errorcode[error.errno]
        return "done"

    def early_thread():  # started before the filter, as vLLM's and ZMQ's threads are
        started.set()
        go.wait()
        from_thread["tcp"] = attempt(lambda: socket.socket(socket.AF_INET).close())

    thread = threading.Thread(target=early_thread)
    thread.start()
    started.wait()
    applied = seccomp_filter.install()
    signal.signal(signal.SIGUSR1, lambda *_: None)
    signal.signal(signal.SIGTSTP, lambda *_: None)  # were it delivered, the process would go on
    go.set()
    thread.join()
    libc = ctypes.CDLL(None, use_errno=True)
    ptrace = libc.ptrace(16, worker.pid, 0, 0)  # PTRACE_ATTACH
    proc_dir = os.open(f"/proc/{sibling.pid}", os.O_DIRECTORY)  # a pidfd to pidfd_send_signal (nr 424)
    pidfd_signal = libc.syscall(424, proc_dir, 0, None, 0)
    pidfd_errno = errno.errorcode[ctypes.get_errno()] if pidfd_signal == -1 else "done"
    high_pid = libc.syscall(62, (1 << 32) | sibling.pid, 0)  # kill: the kernel would read only the low 32 bits
    high_errno = errno.errorcode[ctypes.get_errno()] if high_pid == -1 else "done"
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    sigio_read, sigio_write = os.pipe()

    def syscall_errno(number, *args):
        return errno.errorcode[ctypes.get_errno()] if libc.syscall(number, *args) == -1 else "done"

    def forked():
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    print(json.dumps({
        "applied": applied,
        "exec": attempt(lambda: os.execv("/bin/true", ["true"])),
        "subprocess": attempt(lambda: subprocess.run(["/bin/true"])),
        "tcp": attempt(lambda: socket.socket(socket.AF_INET).close()),
        "tcp6": attempt(lambda: socket.socket(socket.AF_INET6).close()),
        "netlink": attempt(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW).close()),
        "ptrace": errno.errorcode[ctypes.get_errno()] if ptrace == -1 else "done",
        "signal_worker": attempt(lambda: os.kill(worker.pid, 0)),
        "signal_sibling": attempt(lambda: os.kill(sibling.pid, 0)),
        "signal_group": attempt(lambda: os.kill(0, 0)),
        "signal_everyone": attempt(lambda: os.kill(-1, 0)),
        "signal_high_bits": high_errno,
        "pidfd_signal": pidfd_errno,
        "stop_self": attempt(lambda: os.kill(os.getpid(), signal.SIGTSTP)),
        "stop_thread": attempt(lambda: signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)),
        "limit_sibling": attempt(lambda: resource.prlimit(sibling.pid, resource.RLIMIT_NOFILE, (1, 1))),
        "renice_user": attempt(lambda: os.setpriority(os.PRIO_USER, 0, 19)),
        "sigio_owner": attempt(lambda: fcntl.fcntl(sigio_read, fcntl.F_SETOWN, sibling.pid)),
        "sigio_signal": attempt(lambda: fcntl.fcntl(sigio_read, 10, signal.SIGSTOP)),  # F_SETSIG
        "sigio_ioctl": attempt(lambda: fcntl.ioctl(sigio_read, 0x8901, struct.pack("i", sibling.pid))),  # FIOSETOWN
        "fork": attempt(forked),
        # perf_event_open (298; an attr of zeros, this process, any CPU) and syslog (103; SYSLOG_ACTION_SIZE_BUFFER)
        "perf_event": syscall_errno(298, ctypes.create_string_buffer(128), 0, -1, -1, 0),
        "syslog": syscall_errno(103, 10, None, 0),
        "unix": attempt(lambda: socket.socket(socket.AF_UNIX).close()),
        "socketpair": attempt(lambda: [end.close() for end in socket.socketpair()]),
        "signal_self": attempt(lambda: os.kill(os.getpid(), signal.SIGUSR1)),
        "signal_thread": attempt(lambda: signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)),
        "limit_self": attempt(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limits)),
        "renice_self": attempt(lambda: os.setpriority(os.PRIO_PROCESS, 0, 1)),
        "thread": attempt(lambda: threading.Thread(target=lambda: None).start()),
        "early_thread": from_thread["tcp"],
    }))
    """
)


def test_the_filter_refuses_exec_network_sockets_ptrace_and_signals_to_any_other_process_in_every_thread() -> None:
    done = subprocess.run([sys.executable, "-c", ENGINE_LIKE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "applied": True,
        "exec": "EPERM",
        "subprocess": "EPERM",
        "tcp": "EPERM",
        "tcp6": "EPERM",
        "netlink": "EPERM",
        "ptrace": "EPERM",
        "signal_worker": "EPERM",
        "signal_sibling": "EPERM",
        "signal_group": "EPERM",
        "signal_everyone": "EPERM",
        "signal_high_bits": "EPERM",
        "pidfd_signal": "EPERM",
        "stop_self": "EPERM",
        "stop_thread": "EPERM",
        "limit_sibling": "EPERM",
        "renice_user": "EPERM",
        "sigio_owner": "EPERM",
        "sigio_signal": "EPERM",
        "sigio_ioctl": "EPERM",
        "fork": "EPERM",
        "perf_event": "EPERM",
        "syslog": "EPERM",
        "unix": "done",
        "socketpair": "done",
        "signal_self": "done",
        "signal_thread": "done",
        "limit_self": "done",
        "renice_self": "done",
        "thread": "done",
        "early_thread": "EPERM",
    }


def test_without_a_binding_the_filter_is_reported_unavailable_and_nothing_breaks() -> None:
    script = textwrap.dedent(
        """
        import socket, sys
        sys.modules["pyseccomp"] = None  # neither pyseccomp nor libseccomp's own binding can be imported
        sys.modules["seccomp"] = None
        from nnqueue import seccomp_filter
        print(seccomp_filter.unavailable_reason())
        print(seccomp_filter.install())
        socket.socket(socket.AF_INET).close()
        print("still unfiltered")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    reason, applied, after = done.stdout.strip().splitlines()[-3:]
    assert reason.startswith("seccomp filter unavailable: ModuleNotFoundError") and "pip install pyseccomp" in reason
    assert (applied, after) == ("False", "still unfiltered")
    assert "NOT applying the seccomp filter" in done.stderr


def test_with_network_allowed_only_inet_and_unix_sockets_can_be_made() -> None:
    """What an engine that uploads results to an S3 store itself gets (NNQUEUE_ENGINE_SECCOMP_NETWORK)."""
    script = textwrap.dedent(
        """
        import errno, json, socket
        from nnqueue import seccomp_filter

        def attempt(family, kind=socket.SOCK_STREAM):
            try:
                socket.socket(family, kind).close()
            except OSError as error:
                return errno.errorcode[error.errno]
            return "done"

        assert seccomp_filter.install(network=True)
        print(json.dumps([attempt(socket.AF_INET), attempt(socket.AF_INET6), attempt(socket.AF_UNIX),
                          attempt(socket.AF_NETLINK, socket.SOCK_RAW), attempt(socket.AF_PACKET, socket.SOCK_RAW),
                          attempt(socket.AF_VSOCK), attempt(4, socket.SOCK_DGRAM)]))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["done", "done", "done"] + ["EPERM"] * 4


def test_a_cuda_engines_filter_lets_tritons_compiler_run_and_still_refuses_the_rest() -> None:
    """On the H100 vLLM's Triton kernels compile at a step's first use (ptxas): exec must stay allowed there."""
    script = textwrap.dedent(
        """
        import ctypes, errno, json, os, signal, socket, subprocess
        from nnqueue import seccomp_filter

        def attempt(action):
            try:
                action()
            except OSError as error:
                return errno.errorcode[error.errno]
            return "done"

        def stopping_child():  # a child whose end would stop this process (clone's exit signal)
            libc = ctypes.CDLL(None, use_errno=True)
            pid = libc.syscall(56, int(signal.SIGSTOP), 0, 0, 0, 0)  # clone, x86_64
            if pid == 0:
                os._exit(0)
            if pid == -1:
                raise OSError(ctypes.get_errno(), "clone")
            os.waitpid(pid, 0)

        applied = seccomp_filter.install(exec_allowed=True)
        print(json.dumps([
            applied,
            attempt(lambda: subprocess.run(["/bin/true"], check=True)),
            attempt(lambda: socket.socket(socket.AF_INET).close()),
            attempt(stopping_child),
        ]))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, "done", "EPERM", "EPERM"]
