"""tests/utils/scheduling.py: how pytest-xdist shares the modules between its processes."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.conftest import module_marked, module_of
from tests.utils.scheduling import SHARED_UNIT, ModuleScheduling, declared_shared

ROOT = Path(__file__).resolve().parents[1]


def scope(nodeid: str) -> str:
    scheduling = ModuleScheduling.__new__(ModuleScheduling)  # the controller's config is not needed to split
    scheduling.root = ROOT
    return scheduling._split_scope(nodeid)


def test_the_modules_marked_shared_worker_are_one_unit_and_every_other_module_its_own() -> None:
    assert scope("tests/api/test_results.py::test_models_shows_the_running_worker") == SHARED_UNIT
    assert scope("tests/client/test_conformance.py::test_a_feature[layer_output-eager]") == SHARED_UNIT
    assert scope("tests/workers/test_main.py::test_x") == SHARED_UNIT  # marked alone, not in a list
    assert (
        scope("tests/test_settings.py::test_a") == scope("tests/test_settings.py::test_b") == "tests/test_settings.py"
    )
    assert scope("tests/workers/test_engine_restart.py::test_c[x::y]") == "tests/workers/test_engine_restart.py"


def test_a_mark_in_a_docstring_or_on_a_test_does_not_make_a_module_shared(tmp_path: Path) -> None:
    module = tmp_path / "test_m.py"
    module.write_text(
        '"""pytestmark = pytest.mark.shared_worker, say"""\n@pytest.mark.shared_worker\ndef test_a(): ...\n'
    )
    assert not declared_shared(module)
    module.write_text("import pytest\n\npytestmark = [pytest.mark.slow, pytest.mark.shared_worker]  # why\n")
    assert declared_shared.__wrapped__(module)


def test_the_session_runs_the_shared_unit_then_the_slow_modules_then_the_rest_each_module_in_one_piece(
    request: pytest.FixtureRequest,
) -> None:
    """The order this session collected (tests/conftest.py), which xdist's units follow: the slow modules (their own
    workers) early, so that the processes end together on short ones; a module split in two would start its fixtures
    twice."""
    items = request.session.items
    runs = [module for module, _ in itertools.groupby(items, key=module_of)]
    assert len(runs) == len(set(runs)), "a module's tests are not together"
    first = {module_of(item): item for item in reversed(items)}
    kinds = [
        0 if module_marked(first[module], "shared_worker") else 1 if module_marked(first[module], "slow") else 2
        for module in runs
    ]
    assert kinds == sorted(kinds), list(zip(runs, kinds, strict=True))
