# Developer commands. PYTHON is the project's virtualenv (README, Quick start (b)); override it as
# `make test PYTHON=python` inside another environment.
PYTHON ?= .venv/bin/python
# The images' tag: nnqueue's version (pyproject.toml). docker-compose.yml and deploy/kubernetes name this tag, never
# :latest; after a version bump, `make pin-images` writes the new one there (tests/deploy check they agree).
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
IMAGE_TAG ?= $(VERSION)

.PHONY: lint format typecheck test-fast test check images pin-images

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

images:  ## build the service, GPU worker and CPU worker images as docker-compose.yml names them, tagged $(IMAGE_TAG)
	NNQUEUE_IMAGE_TAG=$(IMAGE_TAG) COMPOSE_PROFILES=gpu,cpu docker compose --env-file .env.example build migrate worker worker-cpu

pin-images:  ## write $(IMAGE_TAG) as the images' tag into docker-compose.yml and the Kubernetes manifests
	sed -i -E 's/(NNQUEUE_IMAGE_TAG:-)[^}]+/\1$(IMAGE_TAG)/' docker-compose.yml
	sed -i -E 's/(newTag: )"[^"]*"/\1"$(IMAGE_TAG)"/' deploy/kubernetes/overlays/*/kustomization.yaml
	sed -i -E 's/(image: nnqueue(-worker)?):[^ ]+$$/\1:$(IMAGE_TAG)/' deploy/kubernetes/base/*.yaml
