"""The ``nnqueue`` command: help, migrations against real Postgres, and engine arguments (the demo runs in
tests/test_demo.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from sqlalchemy import create_engine, inspect
from typer.testing import CliRunner

from nnqueue.cli import SERVER_MODULES, app, engine_args, main
from nnqueue.client.cli_common import TRACE_MODULES
from tests.utils.light_client import run_light, run_light_cli

runner = CliRunner()


SERVER_COMMANDS = {"version", "db", "gc", "keys", "domains", "serve-api", "worker", "beat", "demo", "up"}
CLIENT_COMMANDS = {"submit", "status", "jobs", "cancel", "download", "models", "harvest", "schedules", "steer"}
COMMANDS = {
    (): SERVER_COMMANDS | CLIENT_COMMANDS,
    ("db",): {"upgrade", "downgrade"},
    ("keys",): {"create", "list", "revoke", "scopes"},
    ("domains",): {"list", "join", "leave"},
    ("harvest",): {"submit", "status", "list", "cancel", "manifest", "inspect", "download", "export"},
    ("schedules",): {"create", "list", "pause", "resume", "delete"},
    ("steer",): {"submit", "status", "list", "cancel", "result"},
}


def listed_commands(help_text: str) -> set[str]:
    """The names in the command column of Typer's help: the first word of each row of the Commands panel."""
    lines = help_text.splitlines()
    start = next(index for index, line in enumerate(lines) if re.match(r"\s*╭─ Commands", line))
    names = set()
    for line in lines[start + 1 :]:
        if line.lstrip().startswith("╰"):
            break
        if match := re.match(r"\s*│ (\S+)", line):  # a row; its wrapped description lines start with spaces
            names.add(match.group(1))
    return names


@pytest.mark.parametrize("group", sorted(COMMANDS))
def test_help_lists_the_commands(group: tuple[str, ...]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nnqueue", *group, "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert listed_commands(result.stdout) == COMMANDS[group]


def test_a_client_install_has_the_client_commands_and_names_the_extra_for_the_server_ones() -> None:
    listed = run_light_cli("--help", env={"COLUMNS": "200"})
    assert listed.returncode == 0, listed.stderr
    assert listed_commands(listed.stdout) == COMMANDS[()]
    for command in (["db", "upgrade"], ["keys", "list"], ["gc"], ["worker", "--model", "m"], ["beat"]):
        refused = run_light_cli(*command)
        assert refused.returncode == 1, (command, refused.stdout, refused.stderr)
        assert (
            "this command needs the server's libraries" in refused.stderr and "pip install 'nnqueue[" in refused.stderr
        )
    unreachable = run_light_cli("jobs", "--url", "http://127.0.0.1:9", "--api-key", "nnq_x")
    assert unreachable.returncode == 1 and "APIConnectionError" in unreachable.stderr


def test_a_thin_client_install_runs_the_client_commands_and_names_the_trace_extra(tmp_path: Path) -> None:
    """``pip install nnqueue`` has no nnsight, torch or numpy (tests/test_install.py): every command is listed, the
    client commands run, and a trace script says which extra it needs."""
    listed = run_light_cli("--help", env={"COLUMNS": "200"}, thin=True)
    assert listed.returncode == 0, listed.stderr
    assert listed_commands(listed.stdout) == COMMANDS[()]
    heavy = sorted(TRACE_MODULES | SERVER_MODULES)
    imported = run_light(
        f"import nnqueue.client, nnqueue.client.cli, sys; print(sorted(n for n in sys.modules if n.split('.')[0] in {heavy}))",
        thin=True,
    )
    assert imported.returncode == 0 and imported.stdout.strip() == "[]", imported.stderr
    offline = ["--url", "http://127.0.0.1:9", "--api-key", "nnq_x"]
    for command in (["harvest", "list"], ["steer", "list"], ["status", "6286"], ["download", "6286", "out.pt"]):
        refused = run_light_cli(*command, *offline, thin=True)
        assert refused.returncode == 1 and "APIConnectionError" in refused.stderr, (command, refused.stderr)
    script = tmp_path / "trace.py"
    script.write_text("from nnsight.modeling.vllm import VLLM\n")
    submitted = run_light_cli("submit", str(script), *offline, thin=True)
    assert submitted.returncode == 1 and "pip install 'nnqueue[trace]'" in submitted.stderr, submitted.stderr


def test_the_client_imports_without_the_servers_libraries() -> None:
    imported = run_light(
        "import nnqueue.client, nnqueue.client.backend, nnqueue.client.cli, sys;"
        "from nnqueue.cli import SERVER_MODULES;"
        "print(sorted(name for name in sys.modules if name.split('.')[0] in SERVER_MODULES))"
    )
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "[]"
    blocked = run_light("import sqlalchemy")
    assert blocked.returncode == 1 and "No module named 'sqlalchemy'" in blocked.stderr  # the hook works


def test_the_command_column_is_read_and_descriptions_are_not() -> None:
    panel = "╭─ Commands ─╮\n│ gc    Delete the payloads\n│       of jobs that ended\n│ db    Manage\n╰───╯\n│ after  x"
    assert listed_commands(panel) == {"gc", "db"}


def test_db_upgrade_migrates_the_configured_database(
    database_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = database_factory(migrated=False)
    monkeypatch.setenv("NNQUEUE_DATABASE_URL", url)
    result = runner.invoke(app, ["db", "upgrade"])
    assert result.exit_code == 0, result.output
    assert "jobs" in inspect(create_engine(url)).get_table_names()
    assert "***" in result.output or "@" not in result.output  # the password is not printed


def test_engine_args_become_vllm_keyword_arguments() -> None:
    assert engine_args(["--max-model-len", "256", "--enforce-eager", "--dtype=float32", "--seed", "-1"]) == {
        "max_model_len": 256,
        "enforce_eager": True,
        "dtype": "float32",
        "seed": -1,
    }


@pytest.mark.parametrize("extra", [["--engine", "transformers"], ["--enforce-eager"]])
def test_a_worker_refuses_taps_it_cannot_replay(extra: list[str]) -> None:
    refused = runner.invoke(app, ["worker", "--model", "m", "--taps", "model.layers.*.output", *extra])
    assert refused.exit_code == 2, refused.output
    assert "taps replay CUDA graphs" in refused.output


# -- every command with nothing configured ----------------------------------------------------------


def every_command(command: Any = None, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """``(path, command)`` for each command of the ``nnqueue`` app, groups walked (read from the app: a new one is in)."""
    command = command or typer.main.get_command(app)
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            yield from every_command(sub, (*path, name))
    else:
        yield path, command


# Required arguments, by parameter name: what the command gets (files are made in the working directory).
ARGUMENTS = {"spec": "spec.yaml", "script": "script.py", "schedule_id": "1"}
# The misconfiguration each command meets beside the missing NNQUEUE_* settings. With none set, `up` and `demo`
# run for real (the embedded default is their configuration): they get a data directory that is a file.
MISCONFIGURED = {("up",): ["--data-dir", "a-file"], ("demo",): ["--data-dir", "a-file"]}
# What the error must say, for the commands (or the groups) that cannot run on the defaults; the client commands
# find no API.
SAYS = {
    ("worker",): "NNQUEUE_BROKER_URL is not set",
    ("beat",): "NNQUEUE_BROKER_URL is not set",
    ("serve-api",): "NNQUEUE_BROKER_URL is not set",
    ("keys",): "run `nnqueue db upgrade`",  # every command of the group
    ("domains",): "run `nnqueue db upgrade`",  # an admin's commands on the database, as keys
    ("db", "downgrade"): "the migration failed",
    ("up",): "Not a directory",
    ("demo",): "Not a directory",
}
# The commands that run on the defaults alone (an empty embedded database, an empty script, nothing to purge).
RUN_ON_DEFAULTS = {("version",), ("gc",), ("db", "upgrade"), ("submit",)}


def command_line(path: tuple[str, ...], command: Any) -> list[str]:
    argv = [*path, *MISCONFIGURED.get(path, [])]
    for param in command.params:
        if param.required:
            value = ARGUMENTS.get(param.name or "", "abc")
            argv += [value] if param.param_type_name == "argument" else [param.opts[0], value]
    return argv


@pytest.mark.parametrize(
    ("path", "command"), [pytest.param(path, command, id=" ".join(path)) for path, command in every_command()]
)
def test_every_command_with_no_settings_exits_with_a_reason_and_no_traceback(
    path: tuple[str, ...],
    command: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """`python -m nnqueue <command>` (through `main`, in this process) in an empty folder with no NNQUEUE_* variable and
    no .env: a command that needs a setting (a broker, a migrated database, an API) says what to do and exits 1."""
    for name in [name for name in os.environ if name.startswith("NNQUEUE_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spec.yaml").write_text("model_key: m\ncaptures: [{module: model.layers.0}]\n")
    (tmp_path / "script.py").write_text("")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(sys, "argv", ["nnqueue", *command_line(path, command)])
    with pytest.raises(SystemExit) as exited:
        main()
    output = capfd.readouterr()
    shown = output.out + output.err
    assert "Traceback" not in shown and "│ " not in output.err, shown  # neither Python's nor rich's traceback
    if path in RUN_ON_DEFAULTS:
        assert exited.value.code in (0, None), shown
        return
    assert exited.value.code == 1, shown
    says = SAYS.get(path) or SAYS.get(path[:1])
    if says is None:  # a client command: no API at the default URL (or, if one runs there, no key for it)
        assert "is an API running there? `nnqueue up`" in shown or "AuthenticationError: 401" in shown, shown
    else:
        assert says in shown, shown
