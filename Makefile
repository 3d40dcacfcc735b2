# The whole set-up on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU wheel that lies on this machine's disk; an unpinned torch
# would pull a multi-GB CUDA build. On a GPU machine, install torch first and skip this.
TORCH_SPEC ?= torch==2.13.0

# The real-vLLM tests (tests/real_vllm) run in a venv of their own: vLLM 0.33 needs transformers
# 5.x, the transformers oracle of the main suite pins 4.57. vLLM is installed without its
# declared dependencies (they pull a CUDA torch and ~9 GB of NVIDIA libraries): only the
# Python packages its model classes and configs import (docs/DESIGN.md, "Real vLLM in the tests").
VLLM_VENV := .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm==0.33.0
# vLLM goes in without its declared dependencies, so every later install would print pip's
# 30-line "dependency resolver does not currently take into account ..." list of them;
# --no-warn-conflicts drops that list only (errors still print and fail the recipe)
VPIP := $(VPY) -m pip install -q --no-warn-conflicts
VLLM_DEPS := numpy "transformers>=5.16.1,<5.21" pydantic regex cachetools psutil sentencepiece \
	requests tqdm blake3 py-cpuinfo tokenizers safetensors protobuf msgspec cloudpickle pyzmq \
	einops pyyaml filelock typing_extensions cbor2 pybase64 ijson setproctitle \
	partial-json-parser jsonschema prometheus_client aiohttp pillow watchfiles \
	python-json-logger "oss-harmony>=0.0.11" openai uvloop "fastapi<0.137" "llguidance>=1.7,<1.8"

# verl 0.9.1 for the adapter tests (tests/test_adapters_verl.py), beside the main venv (the
# test appends it to sys.path): verl and only what its checkpoint-engine modules import,
# without its declared dependencies (transformers 5.x, CUDA wheels), each pinned
VERL_SITE := .verl-site
VERL_PKGS := verl==0.9.1 ray==2.60.0 protobuf==7.36.2 msgpack==1.2.4 jsonschema==4.26.0 \
	jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 \
	click==8.5.1 cloudpickle==3.1.3 codetiming==1.4.0 omegaconf==2.4.0 orjson==3.13.0 \
	pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 \
	tensordict==0.10.0 pyvers==0.2.3 uvicorn==0.55.0 fastapi==0.136.3 starlette==1.10.0 \
	annotated-doc==0.0.7 anyio==4.16.0

.PHONY: install install-vllm install-verl test test-main test-vllm demo bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	test -x $(VPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH_SPEC)"
	$(VPIP) --no-deps "$(VLLM_SPEC)"
	$(VPIP) $(VLLM_DEPS)
	$(VPIP) --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.11
	# FlashInfer's MoE permutation helpers run on CPU tensors: vLLM's TRTLLM conversion in tests
	$(VPIP) --no-deps flashinfer-python==0.7.2.post1 nvidia-ml-py
	# vLLM's quantization registry imports them (block-FP8 models build in the real-vLLM tests),
	# and so does vLLM 0.33's Gated-DeltaNet layer (Qwen3-Next); loguru is their one missing dep
	$(VPIP) --no-deps compressed-tensors==0.17.0 loguru==0.7.3
	$(VPIP) pytest hypothesis "megatron-core>=0.16.1"
	$(VPIP) --no-deps -e .
	touch $@

install: $(VENV)/.installed

install-vllm: $(VLLM_VENV)/.installed

$(VERL_SITE)/.installed: Makefile
	$(PY) -m pip install -q --no-deps --upgrade --target $(VERL_SITE) $(VERL_PKGS)
	touch $@

install-verl: install $(VERL_SITE)/.installed

# the whole suite: the main tests, then the real-vLLM tests in their venv
test: test-main test-vllm

test-main: install install-verl
	$(PY) -m pytest -q

test-vllm: install-vllm
	$(VPY) -m pytest -q tests/real_vllm

demo: install
	$(VENV)/bin/megatron-reshard demo

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VERL_SITE) build *.egg-info .pytest_cache
