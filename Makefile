# Two commands on a fresh machine: `make demo` and `make test` (both create .venv and install what is needed).
#
# torch: TORCH_SPEC is installed into .venv with pip (TORCH_PIP_ARGS added, e.g. an --index-url) unless a torch
# is already importable there, or in the Python that creates .venv (then .venv sees it through
# --system-site-packages). Which build pip installs depends on its index: on Linux x86_64 the default index gives
# the CUDA build (several GB); PyTorch's CPU wheel index, or a local wheel cache, gives the CPU build. make says
# which one it got. A GPU user either runs `make` from a Python that has their CUDA build of torch, or installs
# it into .venv first (`python3 -m venv .venv && .venv/bin/pip install torch`), and make keeps it.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
# eval: lm-eval and the statistics stack; `make test` runs the lm-eval integration tests too; train: peft
EXTRAS ?= dev,eval,train
STAMP := $(VENV)/.psr-hf-installed
PYTEST_ARGS ?=
# test workers (pytest-xdist): one per core, at most 4; each runs its tiny models with one torch thread (conftest.py)
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))

.PHONY: demo test test-quick docs install bench-policy moonlight-routing qwen36-routing clean

demo: $(STAMP)
	$(VENV)/bin/psr-hf demo

test: $(STAMP)
	@echo "make test: the CPU test suite (tests marked cuda skip without a GPU) on $(PYTEST_WORKERS) workers; on the 2-core"
	@echo "CI machine 7 minutes when quiet with its caches warm (14 minutes in one process: PYTEST_WORKERS=0)."
	@echo "A dot per test; the 20 slowest tests are listed at the end."
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal --durations=20 $(PYTEST_ARGS)

# the inner loop: every test but the ~190 listed in tests/slow_tests.txt (over 0.5 s each on the CI machine)
test-quick: $(STAMP)
	@echo "make test-quick: the test suite without the tests marked slow (tests/slow_tests.txt), about 1.5 minutes on"
	@echo "the 2-core CI machine; make test runs all"
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal -m "not slow" $(PYTEST_ARGS)

install: $(STAMP)

# the documentation pages and the API reference generated from the docstrings, into site/ (warnings are errors)
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

bench-policy: $(STAMP)
	$(VENV)/bin/psr-hf bench-policy

$(PY):
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
		echo "make: $(PYTHON) already has torch; creating $(VENV) with --system-site-packages to use it"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
	fi

$(STAMP): $(PY) pyproject.toml setup.py Makefile
	@if $(PY) -c "import torch" >/dev/null 2>&1; then \
		echo "make: using the installed torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	else \
		echo "make: installing $(TORCH_SPEC) into $(VENV) (the build pip's index gives: see docs/install.md)"; \
		$(PY) -m pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"; \
	fi
	@echo "make: installing psr_hf and its dependencies ($(EXTRAS)) into $(VENV), quietly (see docs/install.md for how long)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	@$(PY) -c "import torch; print('make: torch', torch.__version__, '(CUDA ' + torch.version.cuda + ' build)' if torch.version.cuda else '(the CPU build)')"
	@echo "make: compiling the policy kernels into the numba cache (psr-hf warm-up)"
	$(VENV)/bin/psr-hf warm-up
	@touch $(STAMP)

# the small trained Moonlight-routing model is built, not shipped: trains it on a GPU (about 8 minutes on an H200)
# into ~/.cache/psr_hf/models/moonlight-routing (or $$PSR_HF_MODELS), where `--model moonlight-routing` finds it
moonlight-routing: $(STAMP)
	PYTHON=$(PY) bash examples/train_tiny_moe/build_routing_model.sh moonlight-routing

# the same for the small trained Qwen3.6-routing model (~/.cache/psr_hf/models/qwen36-routing)
qwen36-routing: $(STAMP)
	PYTHON=$(PY) bash examples/train_tiny_moe/build_routing_model.sh qwen36-routing

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache
