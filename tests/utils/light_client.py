"""Running code as on a client install: the server's libraries unimportable.

:func:`run_light` runs Python code in a fresh interpreter whose first act hides every one of
:data:`nnqueue.cli.SERVER_MODULES` (sqlalchemy, celery, boto3, fastapi, uvicorn, vllm, ...) from the import
system, as if they were not installed: ``pip install 'nnqueue[trace]'``, where nnsight, transformers and torch
import as usual. With ``thin=True`` those are hidden too (:data:`nnqueue.cli.TRACE_MODULES`): ``pip install nnqueue``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from nnqueue.cli import SERVER_MODULES, TRACE_MODULES

ROOT = Path(__file__).resolve().parents[2]


# The path finder is replaced by one that does not see the server's packages: importing one fails, and
# ``importlib.util.find_spec`` says it is missing (libraries probing for optional packages take it as absent).
def prelude(hidden: frozenset[str]) -> str:
    return f"""
import importlib.machinery, sys

class _WithoutServer(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in {sorted(hidden)!r}:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)

sys.meta_path[:] = [_WithoutServer if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def run_light(
    code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300, thin: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (with ``args`` in ``sys.argv[1:]``) in a fresh interpreter without the server's libraries (and,
    ``thin``, without nnsight, torch and theirs)."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith("NNQUEUE_")}
    environment["PYTHONPATH"] = str(ROOT)
    environment.update(env or {})
    hidden = SERVER_MODULES | TRACE_MODULES if thin else SERVER_MODULES
    return subprocess.run(
        [sys.executable, "-c", prelude(hidden) + code, *args],
        env=environment,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_light_cli(
    *args: str, env: dict[str, str] | None = None, thin: bool = False
) -> subprocess.CompletedProcess[str]:
    """The ``nnqueue`` command with ``args``, without the server's libraries (and, ``thin``, nnsight's)."""
    code = "import sys; from nnqueue.cli import main; sys.argv[0] = 'nnqueue'; main()"
    return run_light(code, *args, env=env, thin=thin)
