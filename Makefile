# Quick start: `make run` (train the main job) and `make test` (the whole suite).
# TORCH_SPEC is overridable: GPU users pass their own build, e.g. make run TORCH_SPEC='torch==2.13.0'
# with their CUDA index configured in pip.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2
# Test processes (pytest-xdist), for both tiers: 2 on the 2-core reference machine cut the fast tier
# from 669 s to 465 s (most cases wait on spawned ranks and their imports) and the slow tier from
# 2492 s to 1820 s, every elastic, hang and timeout case passing with another case beside it;
# .ci/run from a clean clone took 38 min. TEST_JOBS=0 runs in pytest's own process.
TEST_JOBS ?= 2

.PHONY: run run-tokens test test-slow test-kernels test-all lint install install-test bench clean

# `make run` installs what the main job needs (torch and paratrain's own few dependencies);
# the test extras (transformers, MLflow, W&B, TensorBoard, pyarrow, Accelerate) come with `make test`.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e . "$(TORCH_SPEC)"
	touch $@

$(VENV)/.installed-%: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[$*]" "$(TORCH_SPEC)"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(VENV)/bin/paratrain train configs/main.toml --nproc-per-node $(NPROC)
	$(VENV)/bin/paratrain generate runs/main --prompt "def " --max-new-tokens 300

# The two-command recipe of docs/data.md: BPE-4096 tokens of the standard library, then train.
STDLIB = $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
run-tokens: $(VENV)/.installed-tokenizers
	$(VENV)/bin/paratrain prepare "$(STDLIB)/**/*.py" --exclude '*/site-packages/*' --exclude '*/test/*' \
		--exclude '*/tests/*' --out data/stdlib-bpe4096 --tokenizer bpe:4096 --workers $(NPROC)
	$(VENV)/bin/paratrain train configs/tokens.toml --nproc-per-node $(NPROC)
	$(VENV)/bin/paratrain generate runs/tokens --prompt "def " --max-new-tokens 100

# The fast default path: every tier (tests/unit, tests/distributed: multi-rank gloo, tests/e2e: CLI end to end) except
# the tests marked slow (long end-to-end runs: docs commands, elastic, HF layouts, the 8B plan).
test: install-test lint
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal -m "not slow" --durations=10 tests

# The slow end-to-end cases alone; CI runs `make test` and then this.
test-slow: install-test
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal -m slow --durations=40 tests

# The fast tier under other CPU kernels and thread counts (issue 53): a tolerance that holds only
# on this machine's kernels fails here instead of on a user's. ATEN_CPU_CAPABILITY picks ATen's
# vectorised kernels (default = none, avx2, avx512 where the CPU has it); OMP_NUM_THREADS the
# intra-op threads of the test process (each spawned rank sets its own to 1); each setting gets a
# fresh inductor cache, so no compiled kernel of one setting serves another. Not part of CI's
# run: it is the fast tier KERNELS x THREADS times over (about 10 minutes each here).
KERNELS ?= default avx2
THREADS ?= 1 2
test-kernels: install-test
	@set -e; for k in $(KERNELS); do for t in $(THREADS); do \
		echo "== ATEN_CPU_CAPABILITY=$$k OMP_NUM_THREADS=$$t"; \
		cache=$$(mktemp -d); \
		TORCHINDUCTOR_CACHE_DIR=$$cache ATEN_CPU_CAPABILITY=$$k OMP_NUM_THREADS=$$t \
			$(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal \
			-m "not slow" -p no:cacheprovider tests; \
		rm -rf $$cache; \
	done; done

test-all: install-test lint
	$(PY) -m pytest -q tests

lint: install-test
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

bench: install
	$(PY) benchmarks/overhead/dp_overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache
