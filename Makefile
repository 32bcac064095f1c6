# `make demo` and `make test` each build .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch unless a CUDA driver is present; never a CUDA wheel on a CPU machine.
TORCH_PIN := torch==2.13.0

.PHONY: demo test test-fast bench bench-distributed clean

# DeepSpeed (ZeRO-2 through accelerate: FlowGRPO's multi-GPU configuration, tested on the CPU) is published as
# source only: built against the torch installed before it (an isolated build would fetch a torch of its own),
# without its CUDA operators.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,demo]"
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation "deepspeed==0.19.8"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m leancompile demo

# One worker process per core, each test file whole in one worker (its module fixtures built once); CI runs this.
# Ends with the 15 slowest tests.
test: $(VENV)/.installed
	$(PY) -m pytest -n auto --dist loadfile --durations=15

# The fast tier: each schedule's equivalence once, the passes' structure, the drop-in smoke, packaging and the
# command line (tests marked `fast`); test by test over the workers.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -n auto -m "fast and not timing" --durations=10

# glibc hands large freed blocks back to the OS and page-faults them in again on the next allocation; a GPU's
# caching allocator keeps them. These thresholds keep freed memory in the process, for both programs alike.
BENCH_MALLOC := MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 MALLOC_TOP_PAD_=1073741824

# Quick mode: each backbone and each schedule once; GRID=1 every pair; FULL=1 the grid, larger, with full fine-tuning.
bench: $(VENV)/.installed
	$(BENCH_MALLOC) $(PY) -m benchmarks $(if $(FULL),--full,$(if $(GRID),--grid,))
	$(BENCH_MALLOC) $(PY) -m pytest -n 0 -m timing tests/test_cost.py
	$(PY) -m benchmarks.build_time
	$(BENCH_MALLOC) $(PY) -m benchmarks.weight_check

bench-distributed: $(VENV)/.installed
	$(BENCH_MALLOC) $(PY) -m benchmarks.distributed

clean:
	rm -rf $(VENV) demo-out bench-out tiny-report-out
