"""nnsight's ``/ndif/subscribe`` websocket takes the key nnsight's client sends on its handshake, and caps the
sockets open per key and in all (nnqueue.api.subscriptions); it once held any number of anonymous sockets.

Through websocket-client, the library nnsight's RemoteBackend connects with, on the API under uvicorn."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
import websocket

from nnqueue.settings import Settings
from tests.utils.api import create_secret, served
from tests.utils.services import Services


@pytest.fixture
def ws_url(services: Services) -> Iterator[str]:
    """A fresh API (its own counts) allowing two subscriptions per key and three in all."""
    settings = Settings(
        _env_file=None,
        **{**services.settings.model_dump(), "ndif_subscriptions_per_key": 2, "ndif_subscriptions_max": 3},
    )
    with served(settings) as url:
        yield url.replace("http://", "ws://") + "/ndif/subscribe"


def subscribe(url: str, key: str | None) -> websocket.WebSocket:
    """Connect as nnsight's client does, and read the session id it is handed."""
    connection = websocket.create_connection(url, header={"ndif-api-key": key} if key else None, timeout=10)
    assert json.loads(connection.recv())["session_id"]
    return connection


def refused(url: str, key: str | None) -> websocket.WebSocketBadStatusException:
    with pytest.raises(websocket.WebSocketBadStatusException) as caught:
        subscribe(url, key)
    return caught.value


def test_a_subscription_needs_a_trace_key(ws_url: str, services: Services) -> None:
    missing = refused(ws_url, None)
    assert missing.status_code == 401 and "missing API key" in str(missing)
    unknown = refused(ws_url, "nnq_not-a-key")
    assert unknown.status_code == 401 and "unknown API key" in str(unknown)
    harvest_only = refused(ws_url, create_secret(services.sessions, "alice", ("harvest",)))
    assert harvest_only.status_code == 403 and "lacks the 'trace' scope" in str(harvest_only)
    subscribe(ws_url, create_secret(services.sessions, "alice")).close()


def test_open_subscriptions_are_capped_per_key_and_in_all(ws_url: str, services: Services) -> None:
    alice, bob = create_secret(services.sessions, "alice"), create_secret(services.sessions, "bob")
    with ExitStack() as held:
        first = subscribe(ws_url, alice)
        held.callback(first.close)
        second = subscribe(ws_url, alice)
        held.callback(second.close)
        over_key = refused(ws_url, alice)
        assert over_key.status_code == 429 and "NNQUEUE_NDIF_SUBSCRIPTIONS_PER_KEY" in str(over_key)
        held.callback(subscribe(ws_url, bob).close)
        over_all = refused(ws_url, bob)  # bob has one of his two, but the server holds its three
        assert over_all.status_code == 429 and "NNQUEUE_NDIF_SUBSCRIPTIONS_MAX" in str(over_all)

        first.close()  # a closed socket frees its place once the server notices
        deadline = time.monotonic() + 15
        while True:
            try:
                held.callback(subscribe(ws_url, alice).close)
                break
            except websocket.WebSocketBadStatusException:
                assert time.monotonic() < deadline, "a closed subscription kept its place"
                time.sleep(0.2)
