# Developer commands. PYTHON is the project's virtualenv (README, Quick start (b)); override it as
# `make test PYTHON=python` inside another environment.
PYTHON ?= .venv/bin/python

.PHONY: lint format typecheck test-fast test check

lint:  ## ruff: lint rules and formatting, changing nothing
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format:  ## ruff: fix what can be fixed, then format
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .

typecheck:  ## mypy on the package (configuration and pydantic plugin in pyproject.toml)
	$(PYTHON) -m mypy

test-fast:  ## the tests without worker processes or the demo (about a minute)
	$(PYTHON) -m pytest -m "not slow"

test:  ## every test (what CI runs)
	$(PYTHON) -m pytest

check: lint typecheck test
