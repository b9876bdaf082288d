"""Client-side settings: where the API is and which key to use, from ``NNQUEUE_URL`` / ``NNQUEUE_API_KEY``.

Separate from :class:`nnqueue.settings.Settings` (the servers' settings): a researcher's laptop needs
only these two values, and sets them in the environment or a ``.env`` file.
"""

from __future__ import annotations

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_URL = "http://127.0.0.1:8000"


class ClientSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NNQUEUE_", env_file=".env", extra="ignore")

    # The API's base URL, e.g. https://nnqueue.example.org
    url: str = DEFAULT_URL
    api_key: SecretStr | None = None
    # Seconds for one HTTP request (not for waiting on a job: see Job.wait's timeout).
    http_timeout_s: float = 60.0
    # Stream results through the API (?inline=1) instead of following its redirect to the object store:
    # for stores that clients cannot reach.
    inline_results: bool = False
    # The default of ``client.backend(blocking=...)``: wait for each trace's job and fill in its saved
    # variables. ``nnqueue submit`` sets ``NNQUEUE_BLOCKING=0`` unless ``--wait``, so a script's traces
    # are only queued.
    blocking: bool = True
