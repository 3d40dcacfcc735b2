#!/usr/bin/env bash
# Every GPU check and benchmark in one command, for a lent machine with little time:
#
#     bash scripts/gpu_check.sh [NPROC] [OUT] [STEPS]   # NPROC 2 or 4 (default 4), OUT a folder
#
# STEPS (default all): a comma list of engine, refit, fp8, transfer, bench_refit, pytest, cuda_unit,
# faults, to split
# the run where one command may not take ~12 minutes (e.g. `engine,refit,transfer`, then
# `bench_refit,pytest`).
#
# Runs, each under its own time limit so one hang cannot eat the rest: the engine worker
# (random layouts vs the reference over NCCL, cold/warm/agree=False calls), the refit
# launcher (dense and MoE, bit-exact), the transfer benchmark, the refit benchmark and,
# on 4 GPUs, the pytest refit layouts. Prints one line (or table) per step; full logs and
# the benchmark reports land in OUT. NVLink multicast stays off (shared hosts).
set -u
case "${1:-}" in
  -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
NPROC=${1:-4}
if [[ ! $NPROC =~ ^[0-9]+$ ]] || (( NPROC < 2 )); then
  echo "gpu_check.sh: NPROC: expected the number of GPUs (2 or 4), found '$NPROC' (--help)" >&2
  exit 2
fi
OUT=${2:-bench_out/gpu_check}
STEPS=",${3:-engine,refit,fp8,transfer,bench_refit,pytest,cuda_unit,faults},"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
half=$((NPROC / 2))

want() { [[ $STEPS == *",$1,"* ]]; }

step() {  # step NAME LIMIT_S COMMAND...: run, keep the log, print the status
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$?"
}

if want engine; then
  step engine_worker 150 torchrun --nproc-per-node "$NPROC" --master-port 29500 tests/gpu/engine_worker.py
  grep -h "ok: \|ENGINE GPU WORKER OK\|Error" "$OUT/engine_worker.log" | head -12
fi
if want refit; then
  for model in dense moe; do  # dense: train TP -> gen TP; moe: train EP -> gen TP
    tp=$half ep=1; [ "$model" = moe ] && tp=1 ep=$half
    step "refit_$model" 120 torchrun --nproc-per-node "$NPROC" --master-port 29610 \
      scripts/refit_torchrun.py --train-world "$half" --gen-world "$half" --train-tp "$tp" \
      --train-pp 1 --train-ep "$ep" --gen-tp "$half" --refits 3 --model "$model"
    grep -h "REFIT_SUMMARY" "$OUT/refit_$model.log" | cut -c1-160
  done
fi
if want fp8; then  # BF16 training -> block FP8 generation (sender-quantized), and FP8 training
  for model in dense moe; do
    tp=$half ep=1; [ "$model" = moe ] && tp=1 ep=$half
    step "fp8_$model" 150 torchrun --nproc-per-node "$NPROC" --master-port 29640 \
      scripts/refit_torchrun.py --train-world "$half" --gen-world "$half" --train-tp "$tp" \
      --train-pp 1 --train-ep "$ep" --gen-tp "$half" --refits 2 --model "$model" --gen-precision fp8
    grep -h "REFIT_SUMMARY" "$OUT/fp8_$model.log" | cut -c1-160
  done
  step fp8_blockwise_train 150 torchrun --nproc-per-node "$NPROC" --master-port 29650 \
    scripts/refit_torchrun.py --train-world "$half" --gen-world "$half" --train-tp "$half" \
    --train-pp 1 --train-ep 1 --gen-tp "$half" --refits 2 --model dense --gen-precision fp8 \
    --train-precision fp8_blockwise
  grep -h "REFIT_SUMMARY" "$OUT/fp8_blockwise_train.log" | cut -c1-160
fi
if want transfer; then
  step bench_transfer 240 torchrun --nproc-per-node "$NPROC" --master-port 29620 \
    scripts/bench_transfer.py --iters 10 --out "$OUT/transfer"
  grep "^|" "$OUT/bench_transfer.log"
fi
if want bench_refit; then
  step bench_refit 300 torchrun --nproc-per-node "$NPROC" --master-port 29630 \
    -m megatron_reshard.tools.bench.refit_main --case all --layers 4 --iters 5 --out "$OUT/refit"
  grep "^|" "$OUT/bench_refit.log"
fi
if want pytest && [ "$NPROC" -ge 4 ]; then
  step pytest_gpu 400 python -m pytest -q tests/gpu
  tail -1 "$OUT/pytest_gpu.log"
fi
if want cuda_unit; then  # the unit tests marked for a CUDA device (they skip on CPU)
  step cuda_unit 200 python -m pytest -q tests/test_engine_copies.py tests/test_quant.py
  tail -1 "$OUT/cuda_unit.log"
fi
if want faults; then  # two independent launchers over NCCL; kill / stop one side in refit 3
  for victim in train gen; do
    for fault in kill stop; do
      step "fault_${fault}_${victim}" 120 python scripts/fault_check.py --backend nccl \
        --fault "$fault" --victim "$victim" --timeout-s 20
      grep -h "survivor\|weights:" "$OUT/fault_${fault}_${victim}.log"
    done
  done
fi
