# The two commands: `make run` serves the app on 127.0.0.1:8000; `make test` runs every test.
# Both create .venv on first use with the right extra for this machine (cpu or gpu).
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
CHAT_PORT ?= 8001
PYTEST_ARGS ?=
# extra `serve-app run` flags, e.g. RUN_ARGS=--serve-proxy (Serve's proxy instead of HAProxy)
RUN_ARGS ?=

.PHONY: venv venv-chat system-deps run chat test unit lint typecheck dashboard clean

venv:
	@VENV=$(VENV) bash scripts/install_venv.sh

system-deps:
	@bash scripts/install_system.sh

run: venv
	$(PY) -m serve_app run serve_config.yaml --port $(PORT) $(RUN_ARGS)

venv-chat:
	@bash scripts/install_chat.sh

# the chat page on 127.0.0.1:$(CHAT_PORT), talking to `make run`'s app on $(PORT)
chat: venv venv-chat
	$(PY) -m serve_app chat --app-url http://127.0.0.1:$(PORT) --port $(CHAT_PORT)

test: venv venv-chat system-deps lint typecheck
	$(PY) -m serve_app.observability check
	$(PY) -m pytest $(PYTEST_ARGS)

unit: venv
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check serve_app tests
	$(VENV)/bin/ruff format --check serve_app tests

typecheck: venv
	$(VENV)/bin/mypy

dashboard: venv
	$(PY) -m serve_app.observability write

clean:
	rm -rf $(VENV) .venv-chat .pytest_cache .mypy_cache .ruff_cache
