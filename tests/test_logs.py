"""Log lines as JSON objects naming their job, inside a job's task and the threads it hands work to."""

from __future__ import annotations

import asyncio
import json
import logging
import logging.config
import uuid

import pytest

from nnqueue import logs


def test_json_lines_name_the_job_in_its_task_and_threads(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("json")
    log = logging.getLogger("nnqueue.test")
    job_a, job_b = uuid.uuid4(), uuid.uuid4()

    async def job(job_id: uuid.UUID) -> None:
        with logs.job_context(job_id):
            log.info("claimed")
            await asyncio.to_thread(log.info, "stored")

    async def both() -> None:
        await asyncio.gather(job(job_a), job(job_b))

    asyncio.run(both())
    log.info("between jobs")
    log.info("requeued", extra={"job_id": job_a})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")

    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    by_message: dict[str, list[str | None]] = {}
    for line in lines:
        assert {"ts", "level", "logger", "message"} <= set(line)
        by_message.setdefault(line["message"], []).append(line.get("job_id"))
    assert sorted(by_message["claimed"]) == sorted(by_message["stored"]) == sorted([str(job_a), str(job_b)])
    assert by_message["between jobs"] == [None]
    assert by_message["requeued"] == [str(job_a)]
    assert "ValueError: boom" in lines[-1]["exc_info"]


def test_text_lines_end_with_the_job(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("text")
    job_id = uuid.uuid4()
    with logs.job_context(job_id):
        logging.getLogger("nnqueue.test").warning("slow")
    assert capsys.readouterr().err.rstrip().endswith(f"nnqueue.test: slow [job {job_id}]")


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_uvicorn_config_is_valid(log_format: logs.LogFormat) -> None:
    logging.config.dictConfig(logs.uvicorn_log_config(log_format))
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler.formatter, logs.JsonFormatter) is (log_format == "json")
