# The whole set-up on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU wheel that lies on this machine's disk; an unpinned torch
# would pull a multi-GB CUDA build. On a GPU machine, install torch first and skip this.
TORCH_SPEC ?= torch==2.13.0

# The real-vLLM tests (tests/real_vllm) run in venvs of their own, one per end of the supported
# vLLM range (0.25.1 .. 0.34.0): vLLM needs transformers 5.x, the transformers oracle of the main
# suite pins 4.57. vLLM is installed without its declared dependencies (they pull a CUDA torch and
# ~9 GB of NVIDIA libraries): only the Python packages its model classes and configs import, at
# the bounds of that version's METADATA (docs/DESIGN.md, "Real vLLM in the tests").
# The newest supported vLLM runs all of tests/real_vllm.
VLLM_VENV := .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm==0.34.0
# The oldest supported vLLM runs the subset marked `vllm_range` (dense + MoE models, the plugin).
VLLM_OLD_VENV := .venv-vllm-0.25
VOPY := $(VLLM_OLD_VENV)/bin/python
VLLM_OLD_SPEC ?= vllm==0.25.1
# vLLM goes in without its declared dependencies, so every later install would print pip's
# 30-line "dependency resolver does not currently take into account ..." list of them;
# --no-warn-conflicts drops that list only (errors still print and fail the recipe)
PIP_Q := -m pip install -q --no-warn-conflicts
# what every vLLM of the range imports for its model classes and configs
VLLM_COMMON_DEPS := numpy pydantic regex cachetools psutil sentencepiece \
	requests tqdm blake3 py-cpuinfo tokenizers safetensors protobuf msgspec cloudpickle pyzmq \
	einops pyyaml filelock typing_extensions cbor2 pybase64 ijson setproctitle \
	partial-json-parser jsonschema prometheus_client aiohttp pillow watchfiles \
	python-json-logger openai uvloop "fastapi<0.137" "llguidance>=1.7,<1.8"
# per version, from its wheel's METADATA: transformers bounds, the harmony package, and the
# pinned no-deps extras (vLLM's quantization registry and Qwen3-Next import compressed-tensors;
# loguru is its one missing dependency; FlashInfer's MoE permutation helpers run on CPU tensors)
VLLM_DEPS := $(VLLM_COMMON_DEPS) "transformers>=5.16.1,<5.23" "oss-harmony>=0.0.11"
VLLM_NODEPS := xgrammar==0.2.8 apache-tvm-ffi==0.1.11 flashinfer-python==0.7.2.post1 nvidia-ml-py \
	compressed-tensors==0.17.0 loguru==0.7.3
VLLM_OLD_DEPS := $(VLLM_COMMON_DEPS) "transformers>=5.5.3,<5.23" "openai-harmony>=0.0.3"
VLLM_OLD_NODEPS := xgrammar==0.2.8 apache-tvm-ffi==0.1.9 compressed-tensors==0.17.0 loguru==0.7.3

# $(call vllm_venv,venv,vllm spec,deps,no-deps packages): a real-vLLM venv, CPU torch
define vllm_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(1)/bin/python $(PIP_Q) --no-deps "$(2)"
	$(1)/bin/python $(PIP_Q) $(3)
	$(1)/bin/python $(PIP_Q) --no-deps $(4)
	$(1)/bin/python $(PIP_Q) pytest hypothesis "megatron-core>=0.16.1"
	$(1)/bin/python $(PIP_Q) --no-deps -e .
	touch $(1)/.installed
endef

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

.PHONY: install install-vllm install-vllm-oldest install-verl test test-main test-vllm \
	test-vllm-oldest test-vllm-both demo bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	$(call vllm_venv,$(VLLM_VENV),$(VLLM_SPEC),$(VLLM_DEPS),$(VLLM_NODEPS))

$(VLLM_OLD_VENV)/.installed: pyproject.toml Makefile
	$(call vllm_venv,$(VLLM_OLD_VENV),$(VLLM_OLD_SPEC),$(VLLM_OLD_DEPS),$(VLLM_OLD_NODEPS))

install: $(VENV)/.installed

install-vllm: $(VLLM_VENV)/.installed

$(VERL_SITE)/.installed: Makefile
	$(PY) -m pip install -q --no-deps --upgrade --target $(VERL_SITE) $(VERL_PKGS)
	touch $@

install-verl: install $(VERL_SITE)/.installed

install-vllm-oldest: $(VLLM_OLD_VENV)/.installed

# the whole suite: the main tests beside the real-vLLM tests of both ends of the vLLM range, in
# two lanes. On 2 cores the main suite alone keeps about one core busy (its multi-process tests
# wait on timeouts, spawned interpreters and each other; docs/MEASUREMENTS.md), so the vLLM
# lane runs in the other. Each lane's output is printed when it ends (-O); TEST_LANES=1 runs
# the three suites one after the other, printing as they go.
TEST_LANES ?= 2
test: install install-verl install-vllm install-vllm-oldest
	$(MAKE) --no-print-directory -j$(TEST_LANES) $(if $(filter 1,$(TEST_LANES)),,-Otarget) \
		test-main test-vllm-both

# the vLLM lane of `make test`: the newest vLLM's suite, then the oldest's subset
test-vllm-both: install-vllm install-vllm-oldest
	$(TEST_VLLM)
	$(TEST_VLLM_OLDEST)

test-main: install install-verl
	$(PY) -m pytest -q

TEST_VLLM = $(VPY) -m pytest -q tests/real_vllm
TEST_VLLM_OLDEST = $(VOPY) -m pytest -q -m vllm_range tests/real_vllm

test-vllm: install-vllm
	$(TEST_VLLM)

test-vllm-oldest: install-vllm-oldest
	$(TEST_VLLM_OLDEST)

demo: install
	$(VENV)/bin/megatron-reshard demo

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_OLD_VENV) $(VERL_SITE) build *.egg-info .pytest_cache
