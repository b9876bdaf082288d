"""The README and the documentation site: the README's budget and commands, and the site's generated parts.

The README's test command is exactly what CI runs (``.ci/run``), the configuration reference covers every
setting (it is generated from nnqueue/settings.py by docs/hooks/settings_reference.py, and a setting without
its comment fails), the metrics page names every series nnqueue exports, and ``mkdocs build --strict`` passes
(a broken link, a missing page or a page left out of the navigation fails it).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from nnqueue.settings import S3Settings, Settings

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def docs_hook(name: str) -> ModuleType:
    """The mkdocs hook docs/hooks/<name>.py, loaded as mkdocs loads it."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def settings_reference() -> ModuleType:
    return docs_hook("settings_reference")


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", text, re.S)


def test_the_readme_fits_its_budget() -> None:
    assert len(README.splitlines()) <= 200


def test_the_readme_test_command_is_exactly_what_ci_runs() -> None:
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    demo, tests = bash_blocks(quick_start)
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert tests == ci
    assert demo.endswith("&& .venv/bin/nnqueue demo") and "mkdocs build --strict" in tests


def test_every_setting_is_in_the_configuration_reference() -> None:
    table = settings_reference().markdown_table()
    variables = set(re.findall(r"^\| `(NNQUEUE_[A-Z0-9_]+)`", table, re.M))
    expected = {f"NNQUEUE_{name.upper()}" for name in Settings.model_fields if name != "s3"}
    expected |= {f"NNQUEUE_S3__{name.upper()}" for name in S3Settings.model_fields}
    assert variables == expected
    assert "| `NNQUEUE_WORKER_STALE_AFTER_S` | float, > 0 | `30` | A worker silent for this long" in table
    assert "| `NNQUEUE_DATABASE_URL` | str or None | unset | " in table and "&lt;data_dir&gt;/nnqueue.db" in table


def test_a_setting_without_its_comment_fails_the_reference() -> None:
    reference = settings_reference()
    source = (ROOT / "nnqueue" / "settings.py").read_text()
    undocumented = re.sub(r"\n *# How often ``nnqueue beat`` looks for schedules that are due\.\n", "\n", source)
    assert undocumented != source
    with pytest.raises(reference.UndocumentedSetting, match="NNQUEUE_BEAT_INTERVAL_S"):
        reference.rows(undocumented)


def test_the_metrics_page_explains_every_series() -> None:
    page = (ROOT / "docs" / "operator" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(nnqueue_[a-z_]+?)(?:_total)?[{`]", page, re.M))
    documented |= set(re.findall(r", `(nnqueue_[a-z_]+?)(?:_total)?[{`]", page))
    defined = set()
    for path in (ROOT / "nnqueue").rglob("*.py"):
        defined |= set(
            re.findall(r"(?:Counter|Gauge|Histogram|GaugeMetricFamily)\(\s*\"(nnqueue_[a-z_]+)\"", path.read_text())
        )
        defined |= set(re.findall(r"^\s+\"(nnqueue_[a-z_]+)\": \(", path.read_text(), re.M))
    assert len(defined) >= 15
    assert defined - documented == set()


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-5000:]
    configuration = (tmp_path / "site" / "operator" / "configuration" / "index.html").read_text()
    assert "NNQUEUE_HARVEST_CHUNK_ATTEMPTS" in configuration and "settings-reference" not in configuration
    assert "The path of a trace job" in (tmp_path / "site" / "architecture" / "index.html").read_text()


def benchmark_figures() -> ModuleType:
    return docs_hook("benchmark_figures")


def test_the_figures_page_is_generated_from_the_results_files(tmp_path: Path) -> None:
    hook = benchmark_figures()
    page = (ROOT / "docs" / "benchmarks" / "figures.md").read_text()
    rendered = hook.on_page_markdown(page)
    assert hook.MARKER in page and hook.MARKER not in rendered
    row = "| `h200-bench-tp1-v7-contained-s3.json` | NVIDIA H200 | 2026-11-26 | ratios_vs_a / (h) one layer all-token | 0.718 |"
    assert row in rendered
    assert "b_vs_c_rel_err" not in rendered and "vs_pytorch_pass" not in rendered  # checks, not ratios
    # A new run's file is in the table as soon as it is there: nothing to copy by hand.
    (tmp_path / "new-run.json").write_text('{"device": "X", "date": "D", "ratios_vs_a": {"(b) jobs": 0.5}}')
    assert hook.table(tmp_path).splitlines()[-1] == "| `new-run.json` | X | D | ratios_vs_a / (b) jobs | 0.500 |"


def test_the_readmes_harvest_figures_are_the_s3_runs() -> None:
    """The README quotes the harvest of the run that writes to S3 (as a deployment does), not a local folder's."""
    rows = {what: value for name, _, _, what, value in benchmark_figures().figures() if "contained-s3" in name}
    every_token, last_token = (
        rows["ratios_vs_a / (h) one layer all-token"],
        rows["ratios_vs_a / (h) one layer last-token"],
    )
    assert f"one layer at every token at {every_token:.2f}x" in README.replace("\n", " ")
    assert f"its last token at {last_token:.2f}x" in README
