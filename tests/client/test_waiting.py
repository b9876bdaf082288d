"""Waiting rides out a failed poll: a harvest's wait, like a job's, is not ended by a proxy's 502.

The client talks to the real API (uvicorn, on the suite's Postgres, Redis and S3) through a small HTTP proxy
of the test's own that answers 502 to one poll of the harvest, as a load balancer does while the API behind
it restarts. The harvest runs on no engine: a worker row that published capture points admits it, and the
test cancels it once the 502 has been served, so the wait ends with the harvest's own outcome.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from nnqueue.client import Client, HarvestFailed
from nnqueue.embedded import ApiServer
from tests.utils.api import CAPTURE_POINTS, HARVEST_MODEL, create_secret, register_worker
from tests.utils.services import Services

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}


class FlakyProxy(ThreadingHTTPServer):
    """Forwards every request to ``upstream``, except one GET of ``fail_path`` (once armed): that gets a 502."""

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _Forward)
        self.upstream = upstream
        self.fail_path: str | None = None
        self.failed = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Forward(BaseHTTPRequestHandler):
    server: FlakyProxy

    def _handle(self) -> None:
        proxy = self.server
        if self.command == "GET" and proxy.fail_path is not None and self.path == proxy.fail_path:
            proxy.fail_path = None
            body = b"<html><body><h1>502 Bad Gateway</h1></body></html>"
            self.send_response(502)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            proxy.failed.set()
            return
        length = int(self.headers.get("Content-Length") or 0)
        headers = {name: value for name, value in self.headers.items() if name.lower() not in HOP_BY_HOP | {"host"}}
        answer = httpx.request(
            self.command, proxy.upstream + self.path, headers=headers, content=self.rfile.read(length), timeout=30
        )
        self.send_response(answer.status_code)
        for name, value in answer.headers.items():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(answer.content)))
        self.end_headers()
        self.wfile.write(answer.content)

    do_GET = do_POST = do_DELETE = _handle

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class names it so
        pass


@pytest.fixture
def proxy(api_server: ApiServer) -> Iterator[FlakyProxy]:
    server = FlakyProxy(api_server.url)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_a_502_during_a_harvest_does_not_end_its_wait(
    proxy: FlakyProxy, api_server: ApiServer, services: Services
) -> None:
    register_worker(services.sessions, HARVEST_MODEL, capture_points=CAPTURE_POINTS)
    secret = create_secret(services.sessions, "hana", ("harvest",))
    spec = {
        "model_key": HARVEST_MODEL,
        "dataset": {"prompts": ["one", "two", "three"]},
        "captures": [{"module": "model.layers.1"}],
    }
    with Client(proxy.url, secret) as client:
        harvest = client.harvest(spec)
        assert harvest.status == "queued"
        proxy.fail_path = f"/v1/harvests/{harvest.id}"

        def cancel_after_the_502() -> None:
            assert proxy.failed.wait(30)
            headers = {"Authorization": f"Bearer {secret}"}
            httpx.post(f"{api_server.url}/v1/harvests/{harvest.id}/cancel", headers=headers).raise_for_status()

        canceller = threading.Thread(target=cancel_after_the_502)
        canceller.start()
        with pytest.raises(HarvestFailed, match="cancelled"):
            harvest.wait(timeout=60, progress=False)
        canceller.join(30)
    assert proxy.failed.is_set() and harvest.status == "cancelled"
