"""An engine crash report says what failed (nnqueue.enginecore.crash_report) and the worker words the job's
error by it (nnqueue.workers.engine_health.blame): a host problem is not the job's fault."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from nnqueue.enginecore.crash_report import CRASH_DIR_ENV, write_report
from nnqueue.workers.engine_health import blame, read_crash_report

TRACE_FILE = "/home/alice/experiment.py"


def raised(make: object) -> BaseException:
    try:
        make()  # type: ignore[operator]
    except BaseException as error:  # noqa: BLE001 - the error under test
        return error
    raise AssertionError("nothing raised")


def inductor_permission() -> None:
    from torch._inductor.exc import InductorError  # torch's compiler stack: seconds to import, so only here

    try:
        open("/proc/1/mem", "rb").read(1)  # noqa: SIM115 - a real PermissionError (or EIO) from the host
    except OSError as error:
        raise InductorError(
            PermissionError(13, "Permission denied", "/usr/include/python3.11/Python.h"), None
        ) from error


def missing_module() -> None:
    import nnsight.intervention.no_such_module  # type: ignore[import-not-found]  # noqa: F401


def trace_imports_a_missing_module() -> None:
    code = compile("import no_such_module_of_alice\n", TRACE_FILE, "exec")
    exec(code, {})


def trace_calls_a_library_that_cannot_import() -> None:
    code = compile("missing()\n", TRACE_FILE, "exec")
    exec(code, {"missing": missing_module})


def trace_code() -> None:
    code = compile("def block():\n    raise ValueError('my trace is wrong')\nblock()\n", TRACE_FILE, "exec")
    exec(code, {})  # stands for nnsight running a trace's compiled block


def report_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException) -> str:
    monkeypatch.setenv(CRASH_DIR_ENV, str(tmp_path))
    job = uuid.uuid4()
    write_report([f"{job}-1-0-0123abcd"], error, frozenset({TRACE_FILE}))
    report = read_crash_report(tmp_path, wait_s=0)
    assert report is not None and report.jobs == {job}
    return blame(report)


@pytest.mark.parametrize("make", [inductor_permission, missing_module], ids=["inductor-permission", "missing-module"])
def test_a_host_problem_is_not_the_jobs_fault(make: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    why = report_for(tmp_path, monkeypatch, raised(make))
    assert "not in this job's code" in why and "this job's trace crashed" not in why, why
    assert ("InductorError" in why) or ("No module named 'nnsight.intervention.no_such_module'" in why), why


def test_a_traces_own_import_is_the_trace_and_a_librarys_is_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = report_for(tmp_path, monkeypatch, raised(trace_imports_a_missing_module))
    assert f"its code at {TRACE_FILE}:1 raised" in own and "no_such_module_of_alice" in own, own
    for path in tmp_path.glob("crash-*.json"):
        path.unlink()
    library = report_for(tmp_path, monkeypatch, raised(trace_calls_a_library_that_cannot_import))
    assert "not in this job's code" in library and "nnsight.intervention.no_such_module" in library, library


def test_the_jobs_own_code_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    why = report_for(tmp_path, monkeypatch, raised(trace_code))
    assert f"its code at {TRACE_FILE}:2 raised" in why and "my trace is wrong" in why, why


def test_vllms_code_failing_on_a_trace_is_the_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    why = report_for(tmp_path, monkeypatch, raised(lambda: [].pop()))
    assert "this job's trace crashed the engine" in why and "vLLM's code raised" in why, why


def test_a_report_without_a_cause_reads_as_before(tmp_path: Path) -> None:
    (tmp_path / "crash-1.json").write_text('{"request_ids": [], "error": "ValueError: x", "cause": "bogus"}')
    report = read_crash_report(tmp_path, wait_s=0)
    assert report is not None and report.cause == "engine" and "ValueError: x" in blame(report)
