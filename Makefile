# One entry point. `make run` serves the default model with speculative decoding and prints a
# sample; `make test` runs the tests. Both build .venv from nothing on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install run test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/specrl fetch-model smollm2-135m
	$(BIN)/specrl generate

test: $(STAMP)
	$(BIN)/specrl fetch-model tiny-random
	$(BIN)/specrl fetch-model smollm2-135m
	$(BIN)/python -m pytest -m "not gpu" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/specrl bench engine

clean:
	rm -rf $(VENV) build *.egg-info
