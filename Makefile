# Two commands a newcomer needs: `make demo` and `make test`. Both create .venv and
# install everything on first use (the local CPU torch wheel when no torch is present).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast soak lint typecheck bench clean setup serve-check

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_venv.sh loader_server/data/_native.c loader_server/wire/_ring.c
	PY=$(PY) bash scripts/setup_venv.sh $(VENV)
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m scripts.demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# Test files run side by side, one per core (pytest-xdist; a file's tests stay together so
# its module fixtures are built once); `make test JOBS=0` runs them in one process. Side by
# side, every process (workers, the daemons and trainers they start) uses one OpenMP thread:
# teams of one per core would oversubscribe the machine and spin.
JOBS ?= auto
XDIST = $(if $(filter 0,$(JOBS)),-p no:xdist,-n $(JOBS) --dist loadfile)
THREADS = $(if $(filter 0,$(JOBS)),,OMP_NUM_THREADS=1)
# The trainer processes the tests start are forked from one interpreter per test process
# that has torch and transformers imported already (tests/warm, docs/TESTING.md: "Warm
# starts"); `make test WARM=0` starts each one cold, as a user's process starts.
WARM ?= 1
WARMTH = $(if $(filter 0,$(WARM)),DFLASH_TEST_WARM=0,)

# Unit and integration layers (tests/unit, tests/integration); the soak layer is `make soak`.
# The type check runs beside the tests at the lowest priority (it takes the cores the test
# processes leave idle, waiting on their subprocesses), prints its one line when done and
# fails the target as a failed test does.
test: lint
	@nice -n 19 $(BIN)/mypy & mypy=$$!; \
	$(THREADS) $(WARMTH) $(BIN)/python -m pytest $(XDIST) --durations=25 $(PYTEST_ARGS); rc=$$?; \
	wait $$mypy || { echo "make test: mypy failed"; rc=1; }; exit $$rc

# The unit layer alone: pure code, no daemon or torchrun subprocesses (well under 30 s).
test-fast: $(STAMP)
	$(THREADS) $(BIN)/python -m pytest tests/unit $(XDIST) $(PYTEST_ARGS)

# Long fault-injection, fuzzing and load runs (minutes each).
soak: $(STAMP)
	$(BIN)/python -m pytest -m slow tests/soak $(PYTEST_ARGS)

# vLLM in the loop before serving (docs/SERVING.md): its CPU build in a virtualenv of its
# own, made once and cached outside the clone ($${DFLASH_CACHE:-~/.cache/dflash-loader}).
serve-check: $(STAMP)
	PY=$(PY) PROJECT_PYTHON=$(BIN)/python bash scripts/checks/serve_check.sh

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_dataset.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
