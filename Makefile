# autotune: `make run` runs the main job, `make test` the tests; both install what they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# GPU nodes take a CUDA build of torch from the range pyproject.toml admits; CPU machines take
# the CPU build 2.13.0 (never a multi-GB CUDA download). Override with TORCH_SPEC=...
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.11,<2.15' || echo 'torch==2.13.0')
# Where a CPU machine gets that CPU build: a wheel pip already finds without an index (a
# find-links folder of pip's own configuration) is taken as it is; otherwise PyTorch's CPU
# index, because PyPI's torch for Linux is the CUDA build. TORCH_INDEX=URL forces an index.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
# Every other package at the version CI tested (torch's range aside): refresh on purpose with
# `make constraints`, then run the tests.
CONSTRAINTS := constraints.txt
PYTEST_ARGS ?=
# Wheels for an offline Python 3.12 x86_64 GPU node that already has torch and transformers.
WHEEL_PYTHON ?= 3.12
WHEEL_PLATFORMS := --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
WHEEL_PACKAGES ?= optuna sqlalchemy alembic greenlet typer rich hjson pydantic nvidia-ml-py psutil \
	psycopg psycopg-binary
# Taken without their dependencies: theirs are torch and what the node's image holds, and a
# resolver would fetch a CUDA torch build for them.
WHEEL_NODEPS ?= torchao peft

.PHONY: install envs run test test-fast coverage lint bench wheelhouse clean constraints

install: $(VENV)/.installed

# The packages, then DeepSpeed's CPU op (.installed): the frameworks' environments need only
# the packages, so `make -j2 install envs` builds the op and the environments side by side.
$(VENV)/.packages: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet setuptools wheel
	@# torch itself from an index when asked (or when a CPU machine has no local CPU wheel);
	@# then torch's own dependencies, as every other package, from the default index.
	@index="$(TORCH_INDEX)"; \
	if [ -z "$$index" ] && ! command -v nvidia-smi >/dev/null 2>&1 \
		&& ! $(BIN)/pip download --quiet --no-deps --no-index --dest "$$(mktemp -d)" \
			"$(TORCH_SPEC)" >/dev/null 2>&1; then \
		index="$(TORCH_CPU_INDEX)"; \
	fi; \
	if [ -n "$$index" ]; then \
		echo "$(TORCH_SPEC) from $$index"; \
		$(BIN)/pip install --quiet --no-deps --index-url "$$index" "$(TORCH_SPEC)" || exit 1; \
	fi; \
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) "$(TORCH_SPEC)"
	@# DeepSpeed's setup.py imports torch: build it against the torch just installed.
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) --no-build-isolation "deepspeed>=0.16"
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e ".[dev]"
	touch $@

$(VENV)/.installed: $(VENV)/.packages
	@# DeepSpeed JIT-builds the CPU probes' shared-memory op on first use (about a minute): build
	@# it now, so no probe pays for it. A failed build only warns (the tuner builds it later).
	$(BIN)/python -m autotune.probe.ops build deepspeed_shm_comm \
		|| echo "warning: DeepSpeed's CPU op was not built; autotune run builds it before its first DeepSpeed probe"
	touch $@

# The frameworks' own environments, in which the export tests have verl, OpenRLHF and
# torchtitan read what autotune writes for them (tests/envs/frameworks.sh): built here, all
# three at once, so no test waits on a download; each is kept by its pins and rebuilt only
# when they change.
FRAMEWORKS := verl openrlhf torchtitan
envs: $(VENV)/.packages
	@pids=""; for framework in $(FRAMEWORKS); do \
		bash tests/envs/frameworks.sh $$framework >/dev/null & pids="$$pids $$!"; \
	done; status=0; for pid in $$pids; do wait $$pid || status=1; done; exit $$status

# The main job: autotune run. With a GPU: tune qwen2.5-1.5b on this node's GPUs for 15 minutes.
# Without one: the same search with real probes on the CPU, 2 ranks under an emulated 4 MiB device.
run: install
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: tuning qwen2.5-1.5b on this node's GPUs (budget 15m)"; \
		$(BIN)/autotune run --model qwen2.5-1.5b --seq-len 2048 --budget 15m; \
	else \
		echo "no GPU: tuning the tiny model with real CPU probes, 2 ranks, emulated 4MiB device"; \
		$(BIN)/autotune run --model tiny --device cpu --gpus 2 --device-memory 4MiB \
			--seq-len 128 --global-batch 32 --budget 3m; \
	fi

# The suite on both cores: what does not race the clock in parallel, then the rest alone
# (tests/conftest.py: SERIAL); the 30 slowest tests of each part are printed.
# numpy's OpenBLAS on one thread: with two test workers each spinning two BLAS threads on two
# cores, the search's small Gaussian-process solves ran 15x slower (bench: two of
# tests/search/test_properties.py's seeded test at once, 136 s against 9 s).
# The tests' temporary folders in memory where /dev/shm is a file system that runs what is
# written there: every trial database commit of the suite is an fsync, a simulated llama-7b
# study took 14.8 s on this machine's disk and 9.8 s there.
TEST_TMP ?= $(shell f=$$(mktemp -p /dev/shm 2>/dev/null) && printf '\043!/bin/sh\n' > $$f \
	&& chmod +x $$f && $$f 2>/dev/null && echo /dev/shm; rm -f $$f)
TEST_ENV := OPENBLAS_NUM_THREADS=1 $(if $(TEST_TMP),TMPDIR=$(TEST_TMP))
PARALLEL_PART := -m pytest -q -n 2 --dist worksteal -m "not serial" $(PYTEST_ARGS)
SERIAL_PART := -m pytest -q -m serial $(PYTEST_ARGS)

# The project's modules compiled once: with PYTHONDONTWRITEBYTECODE set, every interpreter the
# suite starts (a CLI call, a fresh rank) would compile them again.
test: install envs
	$(BIN)/python -m compileall -q autotune >/dev/null
	$(TEST_ENV) $(BIN)/python $(PARALLEL_PART) --durations=30
	$(TEST_ENV) $(BIN)/python $(SERIAL_PART) --durations=30

test-fast: install envs
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

# Line coverage of autotune/ over both parts of the suite, every process it starts included
# ([tool.coverage.run] in pyproject.toml); about 1.9x make test's time. A failing test does not
# stop the count; the tests' verdicts are make test's.
COVERAGE_DATA := $(CURDIR)/build/coverage/.coverage
COVERAGE_RUN := $(BIN)/python -m coverage run --data-file=$(COVERAGE_DATA)
coverage: install envs
	rm -rf build/coverage && mkdir -p build/coverage
	-$(TEST_ENV) $(COVERAGE_RUN) $(PARALLEL_PART)
	-$(TEST_ENV) $(COVERAGE_RUN) $(SERIAL_PART)
	$(BIN)/python -m coverage combine --quiet --data-file=$(COVERAGE_DATA)
	$(BIN)/python -m coverage report --data-file=$(COVERAGE_DATA) > build/coverage/report.txt
	@tail -1 build/coverage/report.txt

lint: install
	$(BIN)/ruff check autotune tests bench
	$(BIN)/ruff format --check autotune tests bench
	$(BIN)/mypy autotune

bench: install
	$(BIN)/python bench/probe_overhead.py
	$(BIN)/python bench/model_states.py
	$(BIN)/python bench/estimator_accuracy.py
	$(BIN)/python bench/search_efficiency.py
	$(BIN)/python bench/grid_vs_estimator.py
	$(BIN)/python bench/cli_startup.py

wheelhouse: install
	rm -rf wheelhouse && mkdir -p wheelhouse
	$(BIN)/pip download --quiet --dest wheelhouse --only-binary=:all: \
		--python-version $(WHEEL_PYTHON) --implementation cp $(WHEEL_PLATFORMS) $(WHEEL_PACKAGES)
	$(BIN)/pip download --quiet --dest wheelhouse --only-binary=:all: --no-deps \
		--python-version $(WHEEL_PYTHON) --implementation cp $(WHEEL_PLATFORMS) $(WHEEL_NODEPS)
	$(BIN)/pip wheel --quiet --no-deps --no-build-isolation --wheel-dir wheelhouse "deepspeed>=0.16"
	$(BIN)/pip wheel --quiet --no-deps --wheel-dir wheelhouse .
	@echo "wheelhouse/ ready: on the node run"
	@echo "  pip install --no-index --find-links wheelhouse autotune deepspeed $(WHEEL_PACKAGES)"

# Pin what a fresh install resolves today, in a venv of its own (run the tests on the new
# file before committing it).
constraints:
	rm -rf .venv-constraints
	$(PYTHON) -m venv .venv-constraints
	.venv-constraints/bin/pip install --quiet setuptools wheel "$(TORCH_SPEC)"
	.venv-constraints/bin/pip install --quiet --no-build-isolation "deepspeed>=0.16"
	.venv-constraints/bin/pip install --quiet ".[dev]"
	@{ echo "# What make install and CI install (torch's range aside): make constraints refreshes it."; \
	   .venv-constraints/bin/pip freeze --exclude-editable \
	     | grep -v -E '^(autotune|torch|triton|nvidia-(cu|cuda|cublas|cudnn|cufft|curand|cusolver|cusparse|nccl|nvjitlink|nvtx))\b' \
	     | LC_ALL=C sort -f; } > $(CONSTRAINTS)
	rm -rf .venv-constraints
	@echo "$(CONSTRAINTS): $$(grep -c '==' $(CONSTRAINTS)) packages pinned"

clean:
	rm -rf $(VENV) wheelhouse build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
