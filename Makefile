# One venv, installed once per change of pyproject.toml. torch==2.13.0 first: a bare `torch` pulls a
# multi-GB CUDA build, while 2.13.0 (CPU) lies on this machine's disk.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install system check test test-repeats test-gpu golden lint typecheck fmt demo bench bench-smoke clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q -c constraints.txt torch==2.13.0
	# DeepSpeed ships an sdist whose setup.py imports torch: build it against the torch above.
	$(PIP) install -q -c constraints.txt --no-build-isolation deepspeed
	$(PIP) install -q -c constraints.txt -e '.[all,dev]'
	touch $(STAMP)

# The oldest SkyPilot the [sky] extra allows, in a venv of its own: the tests parse every rendered task with it too.
SKY_OLDEST := $(shell sed -n 's/^sky = \["skypilot>=\([0-9.]*\)"\]/\1/p' pyproject.toml)
SKY_OLDEST_STAMP := .venv-sky-oldest/.installed
$(SKY_OLDEST_STAMP): pyproject.toml
	test -n "$(SKY_OLDEST)"
	test -x .venv-sky-oldest/bin/python || python3 -m venv .venv-sky-oldest
	# greenlet: its sqlalchemy's asyncio needs it, and that SkyPilot does not ask for it
	.venv-sky-oldest/bin/python -m pip install -q "skypilot==$(SKY_OLDEST)" greenlet
	touch $(SKY_OLDEST_STAMP)

install: $(STAMP) $(SKY_OLDEST_STAMP)

# The system packages the suite needs (SLURM, munge, MariaDB, sshd, shellcheck, ...): apt, as root,
# skipped in a second when they are all there already.
system:
	bash scripts/install-system.sh

# ruff's linter, and its formatter in check mode: code that `make fmt` would change fails lint.
lint: install
	$(VENV)/bin/ruff check launcher tests bench scripts
	$(VENV)/bin/ruff format --check launcher tests bench scripts

# mypy over launcher/ (pyproject.toml's [tool.mypy]: unannotated code checked too, torch's types followed).
typecheck: install
	$(VENV)/bin/mypy

# Format the Python sources in place (ruff format, then ruff's import-order fix).
fmt: install
	$(VENV)/bin/ruff format launcher tests bench scripts
	$(VENV)/bin/ruff check --select I --fix launcher tests bench scripts

# The developer loop, no apt and no SLURM: lint, typecheck, then the fast tier (`pytest -m fast`: every test that
# is not slow or gpu, outside tests/slurm and tests/gpu, less the few expensive ones tests/conftest.py's
# FULL_SUITE_ONLY names), two test files at a time (CHECK_WORKERS=0: in one process). Under 3 minutes on 2 cores.
# tests/slurm and tests/gpu are not even collected: nothing in them is in the tier. shellcheck must be on PATH
# (`make system`).
CHECK_WORKERS ?= 2
check: lint typecheck
	$(PY) -m pytest -q -m fast --ignore=tests/slurm --ignore=tests/gpu -n $(CHECK_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# Regenerate the golden files (tests/golden) from what render writes now, then show what changed: review the
# diff before committing it.
golden: install
	DTLAUNCH_UPDATE_GOLDEN=1 $(PY) -m pytest -q tests/test_templates.py -k golden_files $(PYTEST_ARGS)
	git diff --stat tests/golden

# The whole suite, less the repeat tier (below). `make test PYTEST_WORKERS=2` runs two test files at a time (each
# file whole on one worker, the SLURM tests together: tests/conftest.py), but timing-sensitive SLURM tests then
# failed now and then, so CI runs one. pytest's exit code 5 (no tests collected) is not a pass: it means nothing
# ran. The 40 slowest tests are listed at the end, to keep the suite short. Then every benchmark end to end in
# quick mode (bench-smoke: the SLURM chaos run's 5-minute version among them). pytest keeps the last -m it is
# given: a -m in PYTEST_ARGS replaces "not repeat" (`make test-repeats PYTEST_ARGS=...` for the repeats).
PYTEST_WORKERS ?= 0
test: install system lint
	$(PY) -m pytest -q -ra --durations=40 -n $(PYTEST_WORKERS) --dist loadgroup -m "not repeat" $(PYTEST_ARGS)
	$(PY) -m pytest -q -ra bench/test_smoke.py

# The repeat tier: the tests that tests/conftest.py's REPEATS maps each to a test in `make test` proving the same
# behaviour through the same code. CI runs it after `make test`, so nothing goes unrun there.
test-repeats: install system
	$(PY) -m pytest -q -ra -m repeat $(PYTEST_ARGS)

# The GPU suite (tests/gpu): run it on a machine with CUDA GPUs, and record what ran in docs/gpu.md. Without CUDA
# every test is skipped with the reason (so is every 8-GPU test on a smaller machine).
test-gpu: install
	$(PY) -m pytest -q -ra -m gpu tests/gpu $(PYTEST_ARGS)

# A first run with only what it needs: torch's CPU build and dtlaunch's [train] extra (no DeepSpeed build, no
# SkyPilot, submitit or transformers), into the same venv with a stamp of its own ($(VENV)/.installed-demo), so a
# later `make install` adds the rest. Numbered, timed steps; then plan, render, train and resume: scripts/demo.sh.
# TORCH_INDEX: where torch comes from, where the default index serves its CUDA build
# (make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu).
TORCH_INDEX ?=
demo:
	VENV='$(VENV)' TORCH_INDEX='$(TORCH_INDEX)' bash scripts/demo.sh

bench: install
	$(PY) bench/run.py

# The benchmarks end to end in quick mode (bench/run.py SMOKE): it checks that each produces its figures, not how fast.
bench-smoke: install
	$(PY) -m pytest -q -ra bench/test_smoke.py

clean:
	rm -rf $(VENV) rendered runs .pytest_cache .ruff_cache .mypy_cache
