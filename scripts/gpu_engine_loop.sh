#!/usr/bin/env bash
# Every case of scripts/gpu_engine_loop.py on one GPU, one process each (docs/GPU_ENGINE.md):
#
#     bash scripts/gpu_engine_loop.sh [OUT] [CASES]
#
# Needs vLLM 0.25.1 staged by ../shared/gpu_vllm (/tmp/vsite.env) and, in WHEELS (default
# /tmp/whl), megatron-core 0.19.2 and this package's wheel: installed into /tmp/mr_site, so
# vLLM's plugin loader finds the package's entry point as a user's install would provide it.
# CASES (default all): a comma list of dense_eager, dense_graphs, moe_eager, moe_graphs,
# moe_fp8, dense_large, moe_large, staged_moe, staged_moe_large (after moe_large: its
# in-place pause is the staged figures' baseline). Each case runs under its own time limit; its log and JSON
# report land in OUT; one summary line per case is printed.
set -u
OUT=${1:-${OUT:-/tmp/engine_loop}}
CASES=",${2:-dense_eager,dense_graphs,moe_eager,moe_graphs,moe_fp8,dense_large,moe_large},"
WHEELS=${WHEELS:-/tmp/whl}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# Seen on an H200 (2026-12-07): with DeepGEMM on, vLLM 0.25.1 picks a DeepGEMM FP8 linear
# kernel for fp8_per_block and JIT-compiles it at warm-up for minutes (moe_fp8 ran past its
# 200 s); off, it picks CutlassFp8BlockScaledMMKernel and the engine is up in ~35 s. Only
# the FP8 case's kernels change; BF16 cases do not use DeepGEMM.
export VLLM_USE_DEEP_GEMM=${VLLM_USE_DEEP_GEMM:-0}
# shellcheck disable=SC1091
source /tmp/vsite.env || { echo "no /tmp/vsite.env: run ../shared/gpu_vllm/stage.sh first"; exit 2; }
if [ ! -f /tmp/mr_site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mr_site \
    "$WHEELS"/*.whl && touch /tmp/mr_site/.done || { echo "wheel install failed"; exit 2; }
fi
export PYTHONPATH=$PWD:/tmp/mr_site:$PYTHONPATH
export VLLM_CACHE_ROOT=/tmp/vllm_cache
python3 -c "import importlib.metadata as m; print('entry points:', [e.value for e in m.entry_points(group='vllm.general_plugins')])"

run() {  # run NAME LIMIT_S ARGS...: one case, its log and report in OUT
  local name=$1 limit=$2 script=scripts/gpu_engine_loop.py
  shift 2
  [[ $CASES == *",$name,"* ]] || return 0
  [[ $name == staged_* ]] && script=scripts/gpu_engine_staged.py
  timeout "$limit" python3 "$script" "$@" --json "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  echo "== $name: rc=$? $(grep -c '^\[.*\] ok ' "$OUT/$name.log") ok, $(grep -c '^\[.*\] FAIL' "$OUT/$name.log") FAIL"
  grep -h "FAIL\|Error\|error:\|^| \|engine: \|LLM up" "$OUT/$name.log" | cut -c1-400 | head -16
}

run dense_eager 200 --model dense --graphs off
run dense_graphs 200 --model dense --graphs on --speed 5
run moe_eager 200 --model moe --graphs off
run moe_graphs 200 --model moe --graphs on --speed 5
run moe_fp8 200 --model moe --graphs off --quant fp8_per_block --refits 3
run dense_large 240 --model dense --graphs on --size large --refits 0 --speed 5
run moe_large 240 --model moe --graphs on --size large --refits 0 --speed 5
# staged refits (scripts/gpu_engine_staged.py; the in-place pause from the case above)
run staged_moe 200 --model moe --graphs on --staged 4
run staged_moe_large 240 --model moe --graphs on --size large --staged 5 --compare "$OUT/moe_large.json"
