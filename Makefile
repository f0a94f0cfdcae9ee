# The two commands: `make run` serves the app on 127.0.0.1:8000; `make test` runs every test.
# Both create .venv on first use with the right extra for this machine (cpu or gpu).
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: venv run test unit lint typecheck dashboard clean

venv:
	@VENV=$(VENV) bash scripts/install_venv.sh

run: venv
	$(PY) -m serve_app run serve_config.yaml --port $(PORT)

test: venv lint typecheck
	$(PY) -m pytest $(PYTEST_ARGS)

unit: venv
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check serve_app tests
	$(VENV)/bin/ruff format --check serve_app tests

typecheck: venv
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
