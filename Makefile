# glimpse developer entry points. `make test` works on a fresh machine: it builds .venv on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch comes from the local wheel mirror at exactly these versions; they are repeated in the second
# install so pip's resolver can never swap in another torch while it pulls glimpse's other dependencies.
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
# Lives inside the venv, so deleting .venv also forgets the install; newer than pyproject.toml = up to date.
STAMP := $(VENV)/.glimpse-install.stamp
ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install test lint serve clean distclean

help:
	@echo "make test       lint, type-check and run the tests (creates .venv on first use)"
	@echo "make serve      serve the demo model (or ARGS='--model /path/to/checkpoint') on 127.0.0.1:8000"
	@echo "make lint       ruff + mypy only"
	@echo "make install    create/update .venv"
	@echo "make clean      remove caches and build output; make distclean also removes .venv"

install: $(STAMP)

# Debian's python3 may lack ensurepip (python3-venv not installed): then make the venv without pip and
# let the system pip install pip into it.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV) && $(PYTHON) -m venv --without-pip $(VENV) \
		&& $(PYTHON) -m pip --python $(BIN)/python install pip; }

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install $(TORCH_PINS)
	$(BIN)/python -m pip install -e '.[dev]' $(TORCH_PINS)
	touch $@

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# --durations: every CI log lists the slowest tests, so the suite can be kept under its ~30-minute budget.
test: lint
	$(BIN)/pytest -q --durations=30

serve: $(STAMP)
	$(BIN)/glimpse serve $(ARGS)

clean:
	rm -rf build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
