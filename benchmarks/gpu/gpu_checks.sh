#!/usr/bin/env bash
# The GPU checks of the issues, as one prepared script for a machine with one CUDA GPU:
#   1. `paratrain env` (versions, GPU, topology, problems found);
#   2. a bf16 training run of the debug config on the GPU through the launcher (NCCL backend);
#   3. benchmarks/gpu/gpu.py: bench compute, then the GPT-2-small-shape GPT at bf16 + compile: MFU;
#   4. benchmarks/gpu/gpu_find_batch.py: the real-OOM micro-batch search next to the fake-tensor estimate;
#   5. benchmarks/gpu/gpu_plan.py: the plan's step time and peak memory against real steps of the 124M GPT
#      for every micro-batch x activation-checkpointing choice (real OOM where the plan says no fit).
#   6. benchmarks/gpu/gpu_cp.py: a 32k-token row at cp = 1 against one rank of a simulated cp = 2, 4, 8, tokens/s.
# Every part's output goes to $OUT (or ./gpu-out) as well as the terminal.
#   bash benchmarks/gpu/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root: this script lives in benchmarks/gpu/
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
step() { echo; echo "=== $1 ($(date +%T))"; }

step "env"
$PY -m paratrain env 2>&1 | tee "$OUT/env.txt"

step "debug config, bf16, NCCL, 1 GPU"
$PY -m paratrain train configs/debug.toml --set "run.out_dir='$OUT/debug'" --set "dist.device='cuda'" \
    --set "precision.dtype='bf16'" --set run.steps=20 --set run.progress=false 2>&1 | grep -v "^W[0-9]" | tail -8

step "gpu.py: bench compute + GPT MFU"
timeout 270 $PY benchmarks/gpu/gpu.py 2>&1 | tee "$OUT/gpu.txt" | grep -v "^W[0-9]" | tail -25

step "gpu_find_batch.py: real OOM search vs fake-tensor estimate"
timeout 200 $PY benchmarks/gpu/gpu_find_batch.py 2>&1 | tee "$OUT/gpu_find_batch.txt" | tail -40

step "gpu_plan.py: plan's predictions vs real steps, 124M GPT"
timeout 300 $PY benchmarks/gpu/gpu_plan.py 2>&1 | tee "$OUT/gpu_plan.txt" | grep -v "^W[0-9]" | tail -30

step "gpu_cp.py: a 32k-token row at cp = 1 vs one rank of a simulated cp (issue 23)"
timeout 240 $PY benchmarks/gpu/gpu_cp.py 2>&1 | tee "$OUT/gpu_cp.txt" | grep -v "^W[0-9]" | tail -15
step "done"
