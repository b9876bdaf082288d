"""The suite starts quickly: every pytest process imports tests/conftest.py, and collecting imports every test
module, so neither may import vLLM (seconds, with torch's compiler stack), TRL, nnsight, transformers or torch; the
fixtures, helpers and tests that need them import them when they run (docs/development.md: the suite's time budget)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import COLLECTION_IMPORTED, SLOW_IMPORTS

ROOT = Path(__file__).resolve().parents[1]
# Everything a test module may import at its top without paying for an engine, nnsight or torch.
CHEAP = [
    "tests.conftest",
    "tests.api.conftest",
    "tests.client.conftest",
    "tests.db.conftest",
    "tests.protocols.conftest",
    "tests.utils.api",
    "tests.utils.engines",
    "tests.utils.light_client",
    "tests.utils.outage",
    "tests.utils.payloads",
    "tests.utils.queued",
    "tests.utils.reference",
    "tests.utils.results",
    "tests.utils.scheduling",
    "tests.utils.servers",
    "tests.utils.services",
    "tests.utils.snooping",
    "tests.utils.tiny_model",
]


def test_the_conftest_files_and_helpers_import_no_engine_nnsight_or_torch() -> None:
    probe = f"import sys, {', '.join(CHEAP)}; print(sorted(set({SLOW_IMPORTS!r}) & set(sys.modules)))"
    imported = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    assert imported.stdout.strip() == "[]", imported.stdout


def test_collecting_the_tests_imported_no_engine_nnsight_or_torch(pytestconfig: pytest.Config) -> None:
    """In the whole suite's run: what the test modules import at their top, before any test ran."""
    imported = pytestconfig.stash[COLLECTION_IMPORTED]
    assert imported == [], (
        f"a test module imports {imported} at its top: import it in the tests that use it"
        " (under TYPE_CHECKING where only annotations name it)"
    )
