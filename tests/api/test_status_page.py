"""The status page in a real browser: headless Chromium (Debian's) driven by Playwright, against the API served
by uvicorn on the suite's Postgres, Redis and S3.

Jobs are put in every state through the API and the status machine (a worker's part, a result written with
the worker's own writer), so the page shows queue positions, progress, errors and downloads without an engine.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nnqueue.api import auth
from nnqueue.db.lifecycle import transition
from nnqueue.db.models import JobStatus
from nnqueue.db.session import transaction
from nnqueue.scheduler import registry
from nnqueue.scheduler.chunks import ChunkOutput, finish_chunk
from nnqueue.scheduler.claim import claim_next_chunk
from nnqueue.settings import Settings
from nnqueue.storage.results import load_result
from tests.utils.api import (
    CAPTURE_POINTS,
    HARVEST_MODEL,
    LIVE_MODEL,
    complete,
    create_secret,
    register_worker,
    served,
    submit_harvest,
)
from tests.utils.payloads import fake_trace
from tests.utils.services import Services

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="NO CHROMIUM: the status page's browser tests need Debian's chromium (the README's test command installs it)",
)
# The flags a root, offline, headless machine needs (see the README's test notes).
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = Path(os.environ.get("NNQUEUE_TEST_SCREENSHOT_DIR", "/tmp")) / "nnqueue-status-page.png"


@pytest.fixture(scope="module")
def server(services: Services) -> Iterator[str]:
    with served(Settings(_env_file=None, **{**services.settings.model_dump(), "worker_stale_after_s": 3600})) as url:
        yield url


@pytest.fixture(scope="module")
def jobs(server: str, services: Services) -> dict[str, Any]:
    """Alice's jobs in every state, bob's one queued job, and their keys."""
    import torch

    worker = register_worker(services.sessions, capacity=4, weights=("base-3f2a1c", {"kind": "checkpoint"}))
    registry.set_domain(services.sessions, worker, "owner:alice")  # its engine runs alice's traces now
    alice, bob = (create_secret(services.sessions, owner, ("trace", "harvest")) for owner in ("alice", "bob"))
    with transaction(services.sessions) as session:
        _, admin = auth.create_key(session, "root", ["admin"])

    def submit(secret: str) -> uuid.UUID:
        response = httpx.post(
            f"{server}/v1/jobs",
            headers={"Authorization": f"Bearer {secret}"},
            data={"spec": f'{{"model_key": "{LIVE_MODEL}"}}'},
            files={"payload": ("trace", fake_trace())},
        )
        assert response.status_code == 201, response.text
        return uuid.UUID(response.json()["id"])

    completed, failed, running, queued = (submit(alice) for _ in range(4))
    bobs = submit(bob)
    saves = {"logits": torch.arange(6.0).reshape(2, 3)}
    complete(services, completed, saves, progress_done=2, progress_total=2)
    with transaction(services.sessions) as session:
        for job_id in (failed, running):
            transition(session, job_id, JobStatus.RUNNING, worker_id="w", progress_done=1, progress_total=2)
        transition(
            session,
            failed,
            JobStatus.FAILED,
            error_type="ValueError",
            error_message="user code broke on <shape>",
            error_traceback='Traceback (most recent call last):\n  raise ValueError("user code broke")',
        )
    return {
        "alice": alice,
        "bob": bob,
        "admin": admin,
        "completed": completed,
        "failed": failed,
        "running": running,
        "queued": queued,
        "bobs": bobs,
        "saves": saves,
        "worker": worker,
    }


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, chromium_sandbox=False)
        yield browser
        browser.close()


def sign_in(browser: Any, server: str, secret: str) -> Any:
    """A fresh browser context (its own cookies) signed in through the form; returns its page on /status."""
    page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
    page.goto(f"{server}/status")
    assert page.url == f"{server}/status/sign-in"  # not signed in: sent to the form
    page.fill("#key", secret)
    page.click("button[type=submit]")
    page.wait_for_load_state()
    return page


def test_a_user_sees_their_jobs_with_progress_errors_and_downloads(
    browser: Any, server: str, jobs: dict[str, Any]
) -> None:
    import torch

    page = sign_in(browser, server, jobs["alice"])
    assert page.url == f"{server}/status"
    assert "alice" in page.inner_text("#viewer") and "admin" not in page.inner_text("#viewer")

    rows = {row.get_attribute("id"): row for row in page.query_selector_all("tr.job")}
    mine = {jobs[name] for name in ("completed", "failed", "running", "queued")}
    assert set(rows) == {f"job-{job_id}" for job_id in mine}  # bob's job is not shown
    status_of = {job_id: rows[f"job-{job_id}"].get_attribute("data-status") for job_id in mine}
    assert status_of == {
        jobs["completed"]: "completed",
        jobs["failed"]: "failed",
        jobs["running"]: "running",
        jobs["queued"]: "queued",
    }
    progress = lambda name: rows[f"job-{jobs[name]}"].query_selector("progress").get_attribute("value")  # noqa: E731
    assert (progress("running"), progress("completed"), progress("queued")) == ("50", "100", "0")
    assert "in queue" in rows[f"job-{jobs['queued']}"].inner_text()
    failed = rows[f"job-{jobs['failed']}"].inner_text()
    assert "ValueError" in failed and "user code broke on <shape>" in failed  # escaped, shown as text

    models = page.inner_text("#models")
    assert LIVE_MODEL in models
    assert page.inner_text(f"#models tr[data-model='{LIVE_MODEL}'] td.queued") == "2"  # alice's and bob's
    assert LIVE_MODEL in page.inner_text("#workers")
    assert "base-3f2a1c (since" in page.inner_text("#workers")  # the weights version it serves
    assert "owner:alice (since" in page.inner_text("#workers")  # and the trust domain: hers

    links = rows[f"job-{jobs['completed']}"].query_selector_all("a.download")
    assert [link.inner_text() for link in links] == ["saves.pt", "safetensors"]
    download = page.context.request.get(server + links[0].get_attribute("href"))  # the page's cookie
    assert download.ok
    torch.testing.assert_close(load_result(download.body())["logits"], jobs["saves"]["logits"])

    page.screenshot(path=str(SCREENSHOT), full_page=True)
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and SCREENSHOT.stat().st_size > 10_000


@pytest.fixture(scope="module")
def harvests(server: str, services: Services, jobs: dict[str, Any]) -> dict[str, str]:
    """A queued harvest of alice's (three chunks) and one of bob's, and the harvest worker's id."""
    ids = {"worker": register_worker(services.sessions, HARVEST_MODEL, capture_points=CAPTURE_POINTS)}
    spec = {
        "model_key": HARVEST_MODEL,
        "dataset": {"prompts": ["a", "b", "c", "d", "e"]},
        "captures": [{"module": "model.layers.0"}],
        "prompts_per_chunk": 2,
    }
    with httpx.Client(base_url=server) as http:
        for owner in ("alice", "bob"):
            response = submit_harvest(http, {"Authorization": f"Bearer {jobs[owner]}"}, spec)
            assert response.status_code == 201, response.text
            ids[owner] = response.json()["id"]
    return ids


def test_a_user_sees_their_harvests_with_their_progress(
    browser: Any, server: str, jobs: dict[str, Any], harvests: dict[str, str]
) -> None:
    page = sign_in(browser, server, jobs["alice"])
    rows = page.query_selector_all("tr.harvest")
    assert [row.get_attribute("id") for row in rows] == [f"harvest-{harvests['alice']}"]  # not bob's
    assert rows[0].get_attribute("data-status") == "queued"
    assert rows[0].query_selector(".chunks").inner_text() == "0/3" and "0/5" in rows[0].inner_text()
    admin = sign_in(browser, server, jobs["admin"])
    assert {row.get_attribute("id") for row in admin.query_selector_all("tr.harvest")} == {
        f"harvest-{harvests[owner]}" for owner in ("alice", "bob")
    }


def test_a_harvests_progress_follows_its_chunks(
    browser: Any, server: str, services: Services, jobs: dict[str, Any], harvests: dict[str, str]
) -> None:
    # The harvest worker runs one chunk of alice's to the end (as chunk execution records it) and holds another.
    claimed = [claim_next_chunk(services.sessions, HARVEST_MODEL, harvests["worker"]) for _ in range(3)]
    alices = [chunk for chunk in claimed if chunk is not None and str(chunk.harvest_id) == harvests["alice"]]
    assert len(alices) == 2, "fair claims alternate between alice's and bob's harvests"
    output = ChunkOutput(rows=7, bytes=4096, sha256="0" * 64, tokens=7, offsets=[0, 3, 7])
    assert finish_chunk(services.sessions, alices[0].id, harvests["worker"], output)
    row = sign_in(browser, server, jobs["alice"]).query_selector(f"#harvest-{harvests['alice']}")
    assert row is not None and row.get_attribute("data-status") == "running"
    assert row.query_selector(".chunks").inner_text() == "1/3" and "2/5" in row.inner_text()
    assert row.query_selector("progress").get_attribute("value") == "33"
    tokens_per_s, eta = (cell.inner_text() for cell in row.query_selector_all("td.num")[1:3])
    assert tokens_per_s.replace(",", "").isdigit() and eta != ""  # from the completed chunk's tokens and time


def test_an_admin_sees_everyones_jobs(browser: Any, server: str, jobs: dict[str, Any]) -> None:
    page = sign_in(browser, server, jobs["admin"])
    assert "admin" in page.inner_text("#viewer")
    row = page.query_selector(f"#job-{jobs['bobs']}")
    assert row is not None and "bob" in row.inner_text()
    assert page.query_selector(f"#job-{jobs['completed']}") is not None


def test_another_owners_trust_domain_is_shown_to_admins_only(browser: Any, server: str, jobs: dict[str, Any]) -> None:
    cell = f"#workers tr[data-worker='{jobs['worker']}'] td.domain"
    bobs_view, admins_view = (sign_in(browser, server, jobs[who]).inner_text(cell) for who in ("bob", "admin"))
    assert bobs_view == "other" and admins_view.startswith("owner:alice (since")


def test_the_sign_in_cookie_is_safe_and_only_for_the_status_page(
    browser: Any, server: str, jobs: dict[str, Any]
) -> None:
    page = sign_in(browser, server, jobs["bob"])
    [cookie] = page.context.cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/status"
    assert jobs["bob"] not in page.url
    # The cookie holds a session id, not the key: it is no API key, and it dies with its session.
    assert jobs["bob"] not in cookie["value"] and cookie["value"] not in jobs["bob"]
    assert httpx.get(f"{server}/v1/jobs", headers={"Authorization": f"Bearer {cookie['value']}"}).status_code == 401
    policy = page.context.request.get(f"{server}/status").headers["content-security-policy"]
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
    # The JSON API does not take the cookie, and another site cannot post the forms.
    cookies = {cookie["name"]: cookie["value"]}
    assert httpx.get(f"{server}/v1/jobs", cookies=cookies).status_code == 401
    forged = httpx.post(f"{server}/status/sign-in", data={"key": jobs["bob"]}, headers={"Origin": "http://evil.test"})
    assert forged.status_code == 403
    # Another user's result is not found through the page.
    other = httpx.get(f"{server}/status/jobs/{jobs['completed']}/result", cookies=cookies)
    assert other.status_code == 404

    assert httpx.get(f"{server}/status", cookies=cookies).status_code == 200
    page.click("text=Sign out")
    page.wait_for_load_state()
    assert page.url == f"{server}/status/sign-in" and page.context.cookies() == []
    # Signed out on the server: a copy of the cookie opens nothing any more.
    copied = httpx.get(f"{server}/status", cookies=cookies)
    assert copied.status_code == 303 and copied.headers["location"] == "/status/sign-in"


def test_a_wrong_key_is_refused_with_a_reason(browser: Any, server: str) -> None:
    page = browser.new_context().new_page()
    page.goto(f"{server}/status/sign-in")
    page.fill("#key", "nnq_not-a-key")
    page.click("button[type=submit]")
    page.wait_for_load_state()
    assert page.inner_text("#sign-in-error") == "unknown API key"
    assert page.context.cookies() == []


def test_a_worker_whose_engine_isolation_is_degraded_is_marked_with_the_reason(
    browser: Any, server: str, services: Services, jobs: dict[str, Any]
) -> None:
    degraded = "degraded: the engine's processes see the host's filesystem: NNQUEUE_ENGINE_FILESYSTEM=host"
    worker_id = registry.new_worker_id()
    registry.register(
        services.sessions, worker_id, LIVE_MODEL, f"queue-{LIVE_MODEL}", 1, containment={"isolation": degraded}
    )
    page = sign_in(browser, server, jobs["alice"])
    badges = page.query_selector_all("#workers .badge.isolation")
    assert [badge.inner_text() for badge in badges] == ["isolation degraded"]  # the other worker reported none
    assert badges[0].get_attribute("title") == degraded
    assert worker_id in badges[0].evaluate("badge => badge.parentElement.innerText")
