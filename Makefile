# `make demo` and `make test` each build .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch unless a CUDA driver is present; never a CUDA wheel on a CPU machine.
TORCH_PIN := torch==2.13.0

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m leancompile demo

test: $(VENV)/.installed
	$(PY) -m pytest

bench: $(VENV)/.installed
	$(PY) -m benchmarks $(if $(FULL),--full,)

clean:
	rm -rf $(VENV) demo-out bench-out
