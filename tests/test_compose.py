"""docker-compose.yml: Compose accepts it with .env.example, it holds the deployment docs/operator/compose.md describes, and
each of its command lines works: run against the suite's Postgres, Redis and S3 (no Docker engine runs here).

Compose is Debian's ``docker-compose`` (1.29, which validates against the Compose schema without a daemon);
the README's test command installs it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import typer
import yaml
from sqlalchemy import create_engine, inspect

from nnqueue.cli import app, engine_args
from nnqueue.embedded import redis_server_binary
from tests.utils.api import api_command
from tests.utils.servers import free_ports
from tests.utils.services import Services

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = shutil.which("docker-compose")
needs_compose = pytest.mark.skipif(
    COMPOSE is None,
    reason="NO docker-compose: Debian's docker-compose validates docker-compose.yml (the README's test command installs it)",
)
OUR_SERVICES = {"migrate", "api", "worker", "worker-cpu", "beat"}


def compose_config(env_file: Path, **env: str) -> subprocess.CompletedProcess[str]:
    assert COMPOSE is not None
    return subprocess.run(
        [COMPOSE, "--env-file", str(env_file), "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], **env},
    )


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    result = compose_config(ROOT / ".env.example")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def command(service: dict[str, Any]) -> list[str]:
    """The service's command line as Compose would run it (a string is split like a shell line)."""
    line = service["command"]
    return shlex.split(line) if isinstance(line, str) else list(line)


@needs_compose
def test_compose_accepts_the_file_and_holds_the_deployment(config: dict[str, Any]) -> None:
    services = config["services"]
    assert set(services) == {"preflight", "postgres", "redis", "minio", "minio-bucket", *OUR_SERVICES, "flower"}
    assert set(config["volumes"]) == {"postgres", "redis", "minio", "huggingface"}
    assert "--appendonly" in command(services["redis"]) and "yes" in command(services["redis"])
    for name in ("postgres", "redis", "minio", "api", "worker", "worker-cpu", "flower"):
        assert services[name]["healthcheck"]["test"], f"{name} has no healthcheck"
    for name in ("postgres", "redis", "minio", "api", "worker", "worker-cpu", "beat", "flower"):
        assert services[name]["restart"] == "unless-stopped", name
    assert services["migrate"]["restart"] == services["minio-bucket"]["restart"] == "no"
    assert services["api"]["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert services["worker"]["profiles"] == ["gpu"] and services["worker-cpu"]["profiles"] == ["cpu"]
    assert services["flower"]["profiles"] == ["flower"]
    [gpus] = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpus["capabilities"] == ["gpu"] and str(gpus["count"]) == "1"
    assert "mc mb --ignore-existing" in " ".join(services["minio-bucket"]["entrypoint"])
    # Every nnqueue process talks to the same servers.
    urls = {services[name]["environment"]["NNQUEUE_DATABASE_URL"] for name in OUR_SERVICES}
    assert urls == {"postgresql+psycopg://nnqueue:change-me-postgres@postgres:5432/nnqueue"}


@needs_compose
def test_nothing_starts_while_a_secret_is_the_placeholder(config: dict[str, Any]) -> None:
    services = config["services"]
    for name in ("postgres", "redis", "minio"):
        assert services[name]["depends_on"]["preflight"] == {"condition": "service_completed_successfully"}, name
    preflight = services["preflight"]
    script = command(preflight)[0].replace("$$", "$")  # `config` writes a literal $ as $$ again
    assert preflight["entrypoint"] == ["/bin/sh", "-c"] and preflight["restart"] == "no"

    def run(**secrets: str) -> subprocess.CompletedProcess[str]:
        env = {"PATH": os.environ["PATH"], **secrets}
        return subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)

    refused = run(**preflight["environment"])  # .env.example's values
    assert refused.returncode == 1, refused.stderr
    for name in ("POSTGRES_PASSWORD", "REDIS_PASSWORD", "MINIO_ROOT_PASSWORD"):
        assert f"{name} is still the placeholder of .env.example" in refused.stderr
    chosen = {name: f"{name.lower()}-0d1f" for name in preflight["environment"]}
    one_left = run(**{**chosen, "REDIS_PASSWORD": "change-me-redis"})
    assert (
        one_left.returncode == 1 and one_left.stderr.count("placeholder") == 1 and "REDIS_PASSWORD" in one_left.stderr
    )
    started = run(**chosen)
    assert started.returncode == 0 and not started.stderr, started.stderr


@needs_compose
def test_the_api_and_minio_listen_on_this_host_only_unless_opened(config: dict[str, Any], tmp_path: Path) -> None:
    published = {name: config["services"][name]["ports"] for name in ("api", "minio", "worker", "flower")}
    assert published == {
        "api": ["127.0.0.1:8000:8000/tcp"],
        "minio": ["127.0.0.1:9000:9000/tcp"],
        "worker": ["127.0.0.1:9100:9100/tcp"],
        "flower": ["127.0.0.1:5555:5555/tcp"],
    }
    env_file = tmp_path / ".env"
    env_file.write_text((ROOT / ".env.example").read_text() + "NNQUEUE_API_PUBLISH=0.0.0.0:8000\n")
    opened = compose_config(env_file)
    assert opened.returncode == 0, opened.stderr
    assert yaml.safe_load(opened.stdout)["services"]["api"]["ports"] == ["0.0.0.0:8000:8000/tcp"]


@needs_compose
def test_the_model_and_gpus_come_from_env(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text(
        (ROOT / ".env.example").read_text()
        + "NNQUEUE_MODEL=org/big-model\nNNQUEUE_TENSOR_PARALLEL_SIZE=4\n"
        + "NNQUEUE_ENGINE_ARGS=--max-model-len=4096 --enforce-eager --max-concurrent-jobs=8\n"
    )
    result = compose_config(env_file)
    assert result.returncode == 0, result.stderr
    worker = yaml.safe_load(result.stdout)["services"]["worker"]
    line = command(worker)
    assert "--model=org/big-model" in line and "--tensor-parallel-size=4" in line
    assert line[-3:] == ["--max-model-len=4096", "--enforce-eager", "--max-concurrent-jobs=8"]
    context = typer.main.get_command(app).commands["worker"].make_context("nnqueue worker", line[2:])  # type: ignore[attr-defined]
    assert context.params["max_concurrent_jobs"] == 8  # the worker's own option, from the engine arguments' line
    assert engine_args(context.args) == {"max_model_len": 4096, "enforce_eager": True}
    assert str(worker["deploy"]["resources"]["reservations"]["devices"][0]["count"]) == "4"


@needs_compose
@pytest.mark.parametrize("secret", ["POSTGRES_PASSWORD", "REDIS_PASSWORD"])
def test_a_missing_secret_is_named(tmp_path: Path, secret: str) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text(re.sub(rf"(?m)^{secret}=.*$", "", (ROOT / ".env.example").read_text()))
    result = compose_config(env_file)
    assert result.returncode != 0 and f"set {secret} in .env" in result.stderr


@needs_compose
def test_the_images_build_from_what_the_files_name(config: dict[str, Any]) -> None:
    """Each build names a Dockerfile and target that exist, and what they COPY is in the build context."""
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    context_files = {line[1:].rstrip("/") for line in ignored if line.startswith("!")}
    for name in OUR_SERVICES:
        build = config["services"][name]["build"]
        dockerfile = (ROOT / build["dockerfile"]).read_text()
        if "target" in build:
            assert re.search(rf"(?im)^FROM\s+\S+\s+AS\s+{build['target']}\s*$", dockerfile), (name, build)
        for sources in re.findall(r"(?m)^COPY\s+(.+?)\s+\S+$", dockerfile):
            for source in sources.split():
                assert (ROOT / source).exists() and source.rstrip("/") in context_files, (build["dockerfile"], source)


@pytest.fixture
def env(services: Services) -> dict[str, str]:
    """The environment of a compose service, pointed at the suite's servers instead of the compose network."""
    return {**os.environ, **services.env, "NNQUEUE_LOG_FORMAT": "json"}


@needs_compose
def test_the_migrate_command_migrates(config: dict[str, Any], database_factory: Callable[..., str]) -> None:
    url = database_factory(migrated=False)
    line = command(config["services"]["migrate"])
    result = subprocess.run(
        [sys.executable, "-m", *line], env={**os.environ, "NNQUEUE_DATABASE_URL": url}, capture_output=True, text=True
    )
    assert line[0] == "nnqueue" and result.returncode == 0, result.stdout + result.stderr
    assert {"jobs", "workers", "api_keys"} <= set(inspect(create_engine(url)).get_table_names())


@needs_compose
def test_the_api_command_serves_and_passes_its_healthcheck(config: dict[str, Any], env: dict[str, str]) -> None:
    api = config["services"]["api"]
    line = command(api)
    [port] = free_ports(1)
    line[line.index("--port") + 1] = str(port)
    assert line[:2] == ["nnqueue", "serve-api"] and "--workers" in line
    with api_command(line[1:], env, port) as url:
        ready = httpx.get(f"{url}/readyz")
        assert ready.status_code == 200, ready.text
        check = [part.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for part in api["healthcheck"]["test"][1:]]
        assert check[0] == "python"
        subprocess.run([sys.executable, *check[1:]], check=True, timeout=30)


@needs_compose
@pytest.mark.parametrize("name", ["worker", "worker-cpu"])
def test_the_worker_commands_parse(config: dict[str, Any], name: str) -> None:
    """The worker's command line is one that `nnqueue worker` accepts (starting an engine is the worker tests' job)."""
    service = config["services"][name]
    line = command(service)
    assert line[:2] == ["nnqueue", "worker"]
    worker = typer.main.get_command(app).commands["worker"]  # type: ignore[attr-defined]
    context = worker.make_context("nnqueue worker", line[2:])
    assert context.params["model"] == "meta-llama/Llama-3.1-8B" and context.params["tensor_parallel_size"] == 1
    assert context.params["max_concurrent_jobs"] is None  # the engine's max_num_seqs
    engine_args(context.args)
    check = service["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python3", "-c"] and "9100" in check[3]
    compile(check[3], "healthcheck", "exec")
    assert service["environment"]["NNQUEUE_WORKER_METRICS_PORT"] == "9100"


@needs_compose
def test_the_beat_command_starts(config: dict[str, Any], env: dict[str, str], tmp_path: Path) -> None:
    line = command(config["services"]["beat"])
    assert line == ["nnqueue", "beat"]
    log_path = tmp_path / "beat.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", *line],
            env={**env, "NNQUEUE_BEAT_INTERVAL_S": "0.2"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while "firing due harvest schedules" not in log_path.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(1.0)  # a few of its ticks, each a query of the schedules table
        assert process.poll() is None, log_path.read_text()[-3000:]
        assert "firing schedules failed" not in log_path.read_text()
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


@needs_compose
def test_the_redis_command_keeps_an_append_only_file_behind_a_password(config: dict[str, Any], tmp_path: Path) -> None:
    service = config["services"]["redis"]
    line = command(service)
    password = service["environment"]["REDISCLI_AUTH"]
    assert password == "change-me-redis" and line[line.index("--requirepass") + 1] == password
    urls = {config["services"][name]["environment"]["NNQUEUE_BROKER_URL"] for name in OUR_SERVICES}
    assert urls == {f"redis://:{password}@redis:6379/0"}
    assert f"--broker=redis://:{password}@redis:6379/0" in command(config["services"]["flower"])
    [port] = free_ports(1)
    argv = [str(redis_server_binary()), *line[1:], "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        client = redis.Redis(port=port, password=password)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert process.poll() is None and time.monotonic() < deadline, "redis did not start"
                time.sleep(0.1)
        persistence = client.info("persistence")
        assert persistence["aof_enabled"] == 1
        with pytest.raises(redis.ResponseError, match="unknown command"):
            client.config_get("dir")  # renamed away: no CONFIG SET dir + SAVE
        client.close()
        with redis.Redis(port=port) as anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.ping()
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
