# Two set-up-to-result commands (see README): `make demo` and `make test`.
# Each creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

.PHONY: install install-test demo test
install: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .

install-test: install
	$(BIN)/pip install -q -e '.[test]'

demo: install
	$(BIN)/python -m shmap.demo

test: install-test
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup tests
