"""Session-wide fixtures for real backing servers: PostgreSQL, Redis and an S3-compatible store.

A server starts only when a test first asks for its fixture, and stops at the end of the session.
To test against servers you already run, set ``NNQUEUE_TEST_DATABASE_URL``, ``NNQUEUE_TEST_REDIS_URL``
or ``NNQUEUE_TEST_S3_ENDPOINT`` (with ``NNQUEUE_TEST_S3_ACCESS_KEY_ID``,
``NNQUEUE_TEST_S3_SECRET_ACCESS_KEY``, ``NNQUEUE_TEST_S3_REGION``, ``NNQUEUE_TEST_S3_BUCKET``); then
nothing is started. How the servers are started lives in ``tests/utils/servers.py``.

Also here, so that every test directory finds them: the tiny model (in-process engine and client meta
model), per-module service namespaces (``services``) with real ``nnqueue worker`` processes
(``start_worker``), and the real API under uvicorn with a key and a client (``api_server``, ``secret``, ``client``).
Helpers are in ``tests/utils/``.

Starting a worker costs 30-60 s of the suite's budget (docs/development.md), so the tests that only need one
running share the session's: ``worker`` (``MODEL_KEY``) and ``path_worker`` (keyed by the model's path, as
nnsight's own clients ask), in modules marked ``shared_worker``, whose ``services`` (and so ``api_server``,
``secret`` and ``client``) are then the session's shared namespace. Those modules run one after another (first,
in one process, under pytest-xdist: tests/utils/scheduling.py), and each shared worker stops after its last test. A
test that kills, poisons or reconfigures a worker starts its own with ``start_worker``, in a module not so marked
(or, in a marked one, for a model key of its own).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from pydantic import SecretStr

from nnqueue.settings import S3Settings, Settings
from tests.utils import servers
from tests.utils.tiny_model import TAPS, TINY_ENGINE_KWARGS

# Only what each fixture needs, imported when it runs: every pytest process imports this file before its first
# test, and the engine, nnsight and the API would cost it about 25 s (collection <= 10 s: docs/development.md).
if TYPE_CHECKING:
    from nnqueue.client import Client
    from nnqueue.embedded import ApiServer
    from nnqueue.isolation import EngineUser
    from tests.utils.engines import InProcessEngine
    from tests.utils.services import Services, WorkerProcess

TEST_BUCKET = "nnqueue-test"
# The CLIs' rich consoles take their width from COLUMNS when they are made (at the first import of a CLI module),
# else 80 where no stream is a terminal: a wrapped message would then depend on which test imported a CLI first.
os.environ["COLUMNS"] = "200"
# Keep compiled and assertion-rewritten modules where PYTHONDONTWRITEBYTECODE is set (this machine's shells): every
# pytest process otherwise rewrites each test module again (6 s of its start), and every process a test starts
# compiles the nnqueue modules it imports.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# Trust-domain switches check the live engine here (NNQUEUE_DOMAIN_SWITCH=verify): the default, a fresh engine at each
# switch, costs 6-10 s a switch on a 2-core machine, which the tests of several owners' traces would pay at every
# turn. The tests of the fresh engine set "restart" themselves (tests/workers/test_isolation.py).
os.environ.setdefault("NNQUEUE_DOMAIN_SWITCH", "verify")


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[None]:
    """A CLI command run in-process (``worker``, ``beat``) points the root logger at that run's stderr, which
    closes with it; later records in this process would then fail ("--- Logging error ---" in another CLI
    run's output). Each test gets back the root logger it began with."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A folder that anyone can reach (pytest's own temporary folders are private to their user)."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp())
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


@pytest.fixture(scope="session")
def spare_engine_account() -> EngineUser:
    """An account made as the dedicated engine account is, for the tests that run strangers (squatters, probes) as
    an engine account: on the workers' own, a worker starting meanwhile in the suite's other process would find them
    and refuse to start."""
    from nnqueue.isolation import EngineUserError, ensure_account

    name = "nnqueue-test-engine"
    for _ in range(10):
        try:
            return ensure_account(name)
        except EngineUserError:
            command = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name]
            # 9: made meanwhile; 10: the password file is locked (a worker making the dedicated account)
            if subprocess.run(command, capture_output=True).returncode not in (0, 9, 10):
                raise
            time.sleep(0.2)
    raise AssertionError(f"could not create the account {name}")


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """SQLAlchemy URL (``postgresql+psycopg://...``) of an empty database."""
    if url := os.environ.get("NNQUEUE_TEST_DATABASE_URL"):
        yield url
        return
    server = servers.start_postgres()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """``redis://127.0.0.1:<port>/0``."""
    if url := os.environ.get("NNQUEUE_TEST_REDIS_URL"):
        yield url
        return
    server = servers.start_redis()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_settings() -> Iterator[S3Settings]:
    """Settings for an S3 endpoint that requires SigV4-signed requests. The bucket may not exist yet."""
    if endpoint := os.environ.get("NNQUEUE_TEST_S3_ENDPOINT"):
        secret = os.environ.get("NNQUEUE_TEST_S3_SECRET_ACCESS_KEY")
        yield S3Settings(
            endpoint_url=endpoint,
            bucket=os.environ.get("NNQUEUE_TEST_S3_BUCKET", TEST_BUCKET),
            region=os.environ.get("NNQUEUE_TEST_S3_REGION", "us-east-1"),
            access_key_id=os.environ.get("NNQUEUE_TEST_S3_ACCESS_KEY_ID"),
            secret_access_key=SecretStr(secret) if secret else None,
        )
        return
    server = servers.start_s3()
    try:
        yield S3Settings(
            endpoint_url=server.endpoint_url,
            bucket=TEST_BUCKET,
            region=server.region,
            access_key_id=server.access_key_id,
            secret_access_key=SecretStr(server.secret_access_key),
        )
    finally:
        server.stop()


@pytest.fixture(scope="session")
def database_factory(postgres_url: str) -> Iterator[Callable[..., str]]:
    """Makes fresh databases on the suite's Postgres server, migrated to head; drops them at the end."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from nnqueue.db import migrate

    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    names: list[str] = []

    def create(migrated: bool = True) -> str:
        name = f"t_{uuid.uuid4().hex[:12]}"
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        names.append(name)
        url = make_url(postgres_url).set(database=name).render_as_string(hide_password=False)
        if migrated:
            migrate.upgrade(url)
        return url

    yield create
    with admin.connect() as connection:
        for name in names:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(params=["postgres", "sqlite"])
def any_database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database migrated to head: once on the suite's Postgres, once an embedded SQLite file."""
    from nnqueue.db import migrate

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'nnqueue.db'}"
        migrate.upgrade(url)
        return url
    return str(request.getfixturevalue("database_factory")())


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint with a locally trained tokenizer (see tests/utils/tiny_model.py)."""
    from tests.utils.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama")


@pytest.fixture(scope="session")
def inprocess_engine(tiny_model_path: Path) -> Iterator[InProcessEngine]:
    """The tiny model on a dispatched async engine with nnqueue's worker class, shared by the session."""
    from tests.utils.engines import running_engine

    with running_engine(tiny_model_path, **TINY_ENGINE_KWARGS) as engine:
        yield engine


@pytest.fixture(scope="session")
def taps_engine(request: pytest.FixtureRequest, tiny_model_path: Path) -> Iterator[InProcessEngine]:
    """The tiny model on an engine serving ``TAPS`` (nnsight's ``VLLM(..., taps=TAPS)``): the tapped worker's
    reference, and the weights guard's engine with taps. Shut down after its last test."""
    from tests.utils.engines import running_engine

    with ExitStack() as resources:
        engine = resources.enter_context(running_engine(tiny_model_path, taps=TAPS, **TINY_ENGINE_KWARGS))
        release_after_last_module(request, resources.close)
        yield engine


@pytest.fixture(scope="session")
def client_model(tiny_model_path: Path) -> Any:
    """A meta model, as a CPU-only client writes traces against (stock nnsight class)."""
    from nnsight.modeling.vllm import VLLM

    from nnqueue.engines.platform import prepare_process

    prepare_process()
    return VLLM(str(tiny_model_path), **TINY_ENGINE_KWARGS)


def new_namespace(database_factory: Callable[[], str], redis_url: str, s3_settings: S3Settings) -> Services:
    """A service namespace of its own: a fresh migrated database, a Redis database number, an S3 bucket."""
    from tests.utils.services import Services

    redis = servers.redis_database_url(redis_url)
    s3 = s3_settings.model_copy(update={"bucket": f"nnqueue-{uuid.uuid4().hex[:8]}"})
    return Services(database_factory(), redis, s3)


@pytest.fixture(scope="session")
def shared_services(database_factory: Callable[[], str], redis_url: str, s3_settings: S3Settings) -> Services:
    """The namespace of the session's shared workers: the ``services`` of every module marked ``shared_worker``."""
    return new_namespace(database_factory, redis_url, s3_settings)


@pytest.fixture(scope="module")
def services(
    request: pytest.FixtureRequest, database_factory: Callable[[], str], redis_url: str, s3_settings: S3Settings
) -> Services:
    """The module's service namespace: its own, or, in a module marked ``shared_worker``, the session's shared one
    (``shared_services``), where the shared workers run."""
    if request.node.get_closest_marker("shared_worker") is not None:
        return request.getfixturevalue("shared_services")
    return new_namespace(database_factory, redis_url, s3_settings)


@pytest.fixture(scope="module")
def api_server(services: Services) -> Iterator[ApiServer]:
    """The HTTP API under uvicorn, in a thread of the test process, on the module's services."""
    from nnqueue.embedded import ApiServer

    server = ApiServer(Settings(_env_file=None, **services.settings.model_dump()))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def secret(services: Services) -> str:
    """A key of alice's on the module's services."""
    from tests.utils.api import create_secret

    return create_secret(services.sessions, "alice")


@pytest.fixture(scope="module")
def client(api_server: ApiServer, secret: str) -> Iterator[Client]:
    """The nnqueue client on ``api_server`` with alice's key."""
    from nnqueue.client import Client

    with Client(api_server.url, secret) as client:
        yield client


@pytest.fixture(scope="module")
def start_worker(
    request: pytest.FixtureRequest,
    services: Services,
    tiny_model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., WorkerProcess]]:
    """Starts ``nnqueue worker`` processes for the tiny model on the module's services; stops them at the end. In a
    module marked ``shared_worker``, only under a key of its own: one the shared workers serve would share their
    jobs (and a harvest's chunks) with them, by chance."""
    from tests.utils.services import MODEL_KEY, WorkerProcess

    started: list[WorkerProcess] = []
    logs = tmp_path_factory.mktemp("worker-logs")
    shared_keys = {MODEL_KEY, str(tiny_model_path)} if request.node.get_closest_marker("shared_worker") else set()

    def start(model_path: Path = tiny_model_path, **kwargs: Any) -> WorkerProcess:
        """``kwargs``: WorkerProcess's (max_concurrent_jobs, model_key, engine, env, cwd, user)."""
        if kwargs.get("model_key", MODEL_KEY) in shared_keys:
            raise pytest.UsageError(f"{request.node.nodeid} is marked shared_worker: use the shared worker's fixture")
        worker = WorkerProcess(services, model_path, logs / f"worker-{len(started)}.log", **kwargs)
        started.append(worker)
        worker.wait_registered()
        return worker

    yield start
    for worker in started:
        worker.stop()


@contextmanager
def running_worker(
    services: Services, model_path: Path, log: Path, model_key: str, env: dict[str, str] | None = None
) -> Iterator[WorkerProcess]:
    """An ``nnqueue worker`` for ``model_path`` (four jobs at once), run from the model's parent directory (a
    harvest's manifest names the model by its path relative to the worker's: ``tiny-llama``, as `nnqueue up` run
    beside its data directory does), registered, stopped on exit."""
    from tests.utils.services import WorkerProcess

    worker = WorkerProcess(services, model_path, log, 4, env, model_key=model_key, cwd=model_path.parent)
    try:
        worker.wait_registered()
        yield worker
    finally:
        worker.stop()


# The shared workers, and the modules marked shared_worker that use them, which run one after another.
SHARED_WORKERS = ("shared_worker", "shared_path_worker")
# Session fixtures that start when their first test needs them and stop after the last module whose tests take
# them as arguments (pytest_runtest_teardown), not at the end of the session: each holds processes, gigabytes and
# some CPU that the tests after it need. (A test that asks with request.getfixturevalue alone would get it stopped.)
RELEASED_EARLY = (*SHARED_WORKERS, "taps_engine")
LAST_USER = pytest.StashKey[dict[str, str]]()
RELEASE = pytest.StashKey[dict[str, Callable[[], object]]]()


def release_after_last_module(request: pytest.FixtureRequest, release: Callable[[], object]) -> None:
    """Call ``release`` after the last module that uses the (session) fixture of ``request``, one of RELEASED_EARLY."""
    request.config.stash[RELEASE][request.fixturename] = release


def module_of(item: pytest.Item | None) -> str | None:
    module = item.getparent(pytest.Module) if item is not None else None
    return module.nodeid if module is not None else None


@pytest.fixture(scope="session")
def shared_worker(
    request: pytest.FixtureRequest,
    shared_services: Services,
    tiny_model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerProcess]:
    """The session's tiny-model worker (``MODEL_KEY``, four jobs at once, two trace builders): JSON logs, its metrics
    on a port (``NNQUEUE_WORKER_METRICS_PORT``) and TRL's server protocol on another (``NNQUEUE_TRAINER_PORT``),
    both in its ``env``. Tests leave it as they found it: no weights update, no kill, no job left running."""
    from tests.utils.services import MODEL_KEY

    metrics, trainer = servers.free_ports(2)
    env = {
        "NNQUEUE_LOG_FORMAT": "json",
        "NNQUEUE_WORKER_METRICS_PORT": str(metrics),
        "NNQUEUE_TRAINER_PORT": str(trainer),
    }
    log = tmp_path_factory.mktemp("shared-worker") / "worker.log"
    with running_worker(shared_services, tiny_model_path, log, MODEL_KEY, env) as worker:
        release_after_last_module(request, worker.stop)
        yield worker


@pytest.fixture(scope="session")
def shared_path_worker(
    request: pytest.FixtureRequest,
    shared_services: Services,
    tiny_model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerProcess]:
    """The session's tiny-model worker under the key nnsight's own clients send for ``VLLM(<path>)``: the path."""
    log = tmp_path_factory.mktemp("shared-path-worker") / "worker.log"
    with running_worker(shared_services, tiny_model_path, log, str(tiny_model_path)) as worker:
        release_after_last_module(request, worker.stop)
        yield worker


def alive(worker: WorkerProcess) -> WorkerProcess:
    """A shared worker whose process still runs; a test fails saying why when it does not."""
    if (code := worker.process.poll()) is not None:
        pytest.fail(
            f"the shared worker exited ({code}): a test killed it, or it was stopped after the last module that"
            f" takes it as an argument (take it as one: not with request.getfixturevalue alone). Log: {worker.log_path}",
            pytrace=False,
        )
    return worker


@pytest.fixture(scope="module")
def worker(shared_worker: WorkerProcess) -> WorkerProcess:
    """The session's shared tiny-model worker, for modules marked ``shared_worker``."""
    return alive(shared_worker)


@pytest.fixture(scope="module")
def path_worker(shared_path_worker: WorkerProcess) -> WorkerProcess:
    """The session's shared worker keyed by the model's path, for modules marked ``shared_worker``."""
    return alive(shared_path_worker)


def marked_shared(item: pytest.Item) -> bool:
    """Whether ``item``'s module is marked ``shared_worker`` (the mark is a module's: ``services`` reads it there)."""
    return module_marked(item, "shared_worker")


def module_marked(item: pytest.Item, mark: str) -> bool:
    module = item.getparent(pytest.Module)
    return module is not None and module.get_closest_marker(mark) is not None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a shared worker to a module not marked ``shared_worker`` (its jobs would never reach it), or a mark that
    pytest-xdist's scheduler cannot read; run the marked modules one after another (first under xdist), then the
    modules marked ``slow``; note the last module that uses each of RELEASED_EARLY."""
    from tests.utils.scheduling import declared_shared

    for item in items:
        marked = marked_shared(item)
        if not marked and any(name in item.fixturenames for name in SHARED_WORKERS):
            raise pytest.UsageError(
                f"{item.nodeid} uses a shared worker: mark its module (pytestmark = pytest.mark.shared_worker) so"
                " that it runs on the workers' services, or start a worker of its own with start_worker"
                " (docs/development.md)"
            )
        if item.path.suffix == ".py" and declared_shared(item.path) != marked:
            raise pytest.UsageError(
                f"{item.nodeid}: mark a module shared_worker with a line of its own that starts 'pytestmark = ',"
                " where pytest-xdist's scheduler reads it (tests/utils/scheduling.py)"
            )
    shared = [item for item in items if marked_shared(item)]
    # The modules marked slow (their own workers or stacks: 60-300 s each) before the others, so that the two
    # processes end on short modules together instead of one waiting out the other's last worker start.
    rest = sorted((item for item in items if not marked_shared(item)), key=lambda item: not module_marked(item, "slow"))
    # The marked ones first: under xdist they are one unit (tests/utils/scheduling.py), the longest, which one
    # process starts with while the other takes the remaining modules. Among them, the modules of the path-keyed
    # worker first, so that the two shared workers seldom run at once.
    by_path = {module_of(item) for item in shared if "shared_path_worker" in item.fixturenames}
    shared.sort(key=lambda item: module_of(item) not in by_path)
    items[:] = shared + rest
    config.stash[LAST_USER] = {
        name: str(module_of(item)) for item in items for name in RELEASED_EARLY if name in item.fixturenames
    }
    config.stash[RELEASE] = {}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist: a module at a time, the modules marked ``shared_worker`` as one unit."""
    from tests.utils.scheduling import ModuleScheduling

    return ModuleScheduling(config, log)


# What collecting the tests imported of the packages that take seconds to import (tests/test_collection.py).
SLOW_IMPORTS = ("vllm", "trl", "nnsight", "transformers", "torch")
COLLECTION_IMPORTED = pytest.StashKey[list[str]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[COLLECTION_IMPORTED] = [name for name in SLOW_IMPORTS if name in sys.modules]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last module that uses a fixture of RELEASED_EARLY, release what it holds (its teardown at the
    session's end then finds nothing left to stop)."""
    yield
    module = module_of(item)
    if module == module_of(nextitem):
        return
    for name, last in item.config.stash[LAST_USER].items():
        if last == module and (release := item.config.stash[RELEASE].pop(name, None)) is not None:
            release()
