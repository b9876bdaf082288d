"""The configuration reference, generated from the settings model at build time so that it cannot drift.

A mkdocs hook (``hooks:`` in mkdocs.yml): ``on_page_markdown`` replaces the marker line
``<!-- settings-reference -->`` in docs/operator/configuration.md with one table row per setting of
``nnqueue.settings.Settings`` (and its nested ``S3Settings``). The model gives each row's environment
variable, type, default and bounds; the row's meaning is the comment written directly above the field in
nnqueue/settings.py (read with ``ast``), the one place a setting is explained. A field without such a comment
fails the build (and tests/test_docs.py), so a new setting cannot go undocumented.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from nnqueue.settings import S3Settings, Settings

MARKER = "<!-- settings-reference -->"
SOURCE = Path(__file__).resolve().parents[2] / "nnqueue" / "settings.py"
PREFIX = "NNQUEUE_"
NESTED = {"s3": S3Settings}


class UndocumentedSetting(ValueError):
    """A settings field has no comment directly above it in nnqueue/settings.py."""


def field_comments(source: str, class_name: str) -> dict[str, tuple[str, str]]:
    """Each annotated field of ``class_name``: (its annotation as written, the comment lines right above it)."""
    lines = source.splitlines()
    [cls] = [node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == class_name]
    found: dict[str, tuple[str, str]] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        comment: list[str] = []
        number = node.lineno - 2  # the line above, 0-based
        while number >= 0 and lines[number].strip().startswith("#"):
            comment.insert(0, lines[number].strip().lstrip("#").strip())
            number -= 1
        found[node.target.id] = (ast.unparse(node.annotation), " ".join(comment))
    return found


def default_text(model: type[BaseModel], name: str) -> str:
    field = model.model_fields[name]
    default: Any = field.default
    if default is PydanticUndefined or default is None:
        return "unset"
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, list):
        return "empty" if not default else ",".join(map(str, default))
    if isinstance(default, float) and default.is_integer():
        default = int(default)
    return f"`{default}`"


def bounds_text(model: type[BaseModel], name: str) -> str:
    symbols = {Gt: ("gt", ">"), Ge: ("ge", "≥"), Lt: ("lt", "<"), Le: ("le", "≤")}
    parts = []
    for item in model.model_fields[name].metadata:
        for kind, (attribute, symbol) in symbols.items():
            if isinstance(item, kind):
                parts.append(f"{symbol} {getattr(item, attribute)}")
    return ", ".join(parts)


def rows(source: str | None = None) -> list[tuple[str, str, str, str, str]]:
    """(variable, type, default, bounds, meaning) for every setting; raises UndocumentedSetting."""
    text = source if source is not None else SOURCE.read_text()
    table: list[tuple[str, str, str, str, str]] = []
    missing: list[str] = []
    top = field_comments(text, "Settings")
    for name in Settings.model_fields:
        if name in NESTED:
            nested = NESTED[name]
            inner = field_comments(text, nested.__name__)
            for sub in nested.model_fields:
                annotation, comment = inner.get(sub, ("", ""))
                variable = f"{PREFIX}{name.upper()}__{sub.upper()}"
                if not comment:
                    missing.append(variable)
                table.append((variable, annotation, default_text(nested, sub), bounds_text(nested, sub), comment))
            continue
        annotation, comment = top.get(name, ("", ""))
        variable = f"{PREFIX}{name.upper()}"
        if not comment:
            missing.append(variable)
        table.append((variable, annotation, default_text(Settings, name), bounds_text(Settings, name), comment))
    if missing:
        raise UndocumentedSetting(
            "settings without a comment directly above their field in nnqueue/settings.py: " + ", ".join(missing)
        )
    return table


def markdown_table() -> str:
    def cell(text: str) -> str:
        # reST's double backticks become Markdown's; outside code spans, <placeholders> are not HTML tags.
        parts = re.sub(r"``(.+?)``", r"`\1`", text).split("`")
        parts[::2] = [part.replace("<", "&lt;").replace(">", "&gt;") for part in parts[::2]]
        return "`".join(parts).replace("|", "\\|")

    out = ["| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
    for variable, annotation, default, bounds, meaning in rows():
        kind = cell(annotation.replace(" | ", " or ")) + (f", {bounds}" if bounds else "")  # bounds: "> 0"
        out.append(f"| `{variable}` | {kind} | {cell(default)} | {cell(meaning)} |")
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs hook: fill in the configuration reference."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, markdown_table())
