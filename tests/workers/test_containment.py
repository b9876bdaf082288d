"""nnqueue.workers.containment: what a worker decides about its engine at start-up and says on its console (in a
fresh interpreter: the decision scrubs and exports its process's environment), and the engine arguments that
sandbox a multi-rank engine core. The engine in its containment: tests/workers/test_isolation.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nnqueue.workers.containment import compiler_paths, engine_core_kwargs, engine_reads

DECIDE = textwrap.dedent(
    """
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    from nnqueue.settings import Settings
    from nnqueue.workers.containment import isolate
    containment = isolate(Settings(_env_file=None), "/no/such/model", {})
    print(json.dumps(containment.report()))
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="the filesystem view and the engine user are a root worker's")
def test_a_worker_without_the_filesystem_view_says_its_isolation_is_degraded_and_whose_traces_it_runs() -> None:
    env = {name: value for name, value in os.environ.items() if not name.startswith("NNQUEUE_")}
    env.update(NNQUEUE_ENGINE_FILESYSTEM="host", NNQUEUE_OPERATOR_OWNERS="alice,bob")
    done = subprocess.run([sys.executable, "-c", DECIDE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])

    assert report["filesystem"] == "the host's filesystem: NNQUEUE_ENGINE_FILESYSTEM=host"
    assert report["network"] == "a network namespace of its own (loopback only)"
    assert report["isolation"].startswith("degraded: ") and "NNQUEUE_ENGINE_FILESYSTEM=host" in report["isolation"]
    assert report["traces"] == "only its operator's (NNQUEUE_OPERATOR_OWNERS: alice, bob), harvests and steering"
    warning = [line for line in done.stderr.splitlines() if "engine isolation DEGRADED" in line]
    assert len(warning) == 1 and warning[0].startswith("WARNING ") and "alice, bob" in warning[0], done.stderr


def test_a_multi_rank_engine_gets_the_executor_that_sandboxes_its_engine_core() -> None:
    from nnqueue.enginecore.parallel_executor import SandboxedMultiprocExecutor

    for parallel in ({"tensor_parallel_size": 2}, {"tensor_parallel_size": 1, "pipeline_parallel_size": 2}):
        assert engine_core_kwargs({"dtype": "float32", **parallel}) == {
            "dtype": "float32",
            **parallel,
            "distributed_executor_backend": SandboxedMultiprocExecutor,
        }
    for kept in ({"tensor_parallel_size": 1}, {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}):
        assert engine_core_kwargs(kept) == kept  # one rank in the engine core's own process; Ray's own workers


def test_a_compiler_outside_usr_is_in_the_engines_view(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton builds its CUDA helper with $CC at the engine's first sampling step: on a machine whose gcc lives in
    /opt/gcc, the view must hold /opt/gcc (its bin/, libexec/, include/), or the contained engine fails to start."""
    compiler = tmp_path / "opt" / "gcc" / "bin" / "gcc"
    compiler.parent.mkdir(parents=True)
    compiler.write_text("#!/bin/sh\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    assert tmp_path / "opt" / "gcc" in compiler_paths()
    assert tmp_path / "opt" / "gcc" in engine_reads(str(tmp_path / "no-model"), {})
    monkeypatch.setenv("CC", str(tmp_path / "missing" / "bin" / "gcc"))
    assert tmp_path / "missing" not in compiler_paths()
