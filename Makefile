# The whole set-up on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU wheel that lies on this machine's disk; an unpinned torch
# would pull a multi-GB CUDA build. On a GPU machine, install torch first and skip this.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test demo bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

demo: install
	$(VENV)/bin/megatron-reshard demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
