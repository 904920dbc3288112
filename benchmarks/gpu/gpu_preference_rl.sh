#!/usr/bin/env bash
# The GPU checks of issues 37 and 38, as one prepared script for a machine with one CUDA GPU:
#   1. DPO with LoRA (r 16, all linear layers, the reference the policy with its adapters off) of a
#      model of Qwen2.5-0.5B's shape (random weights) in bf16 autocast: paratrain against TRL's
#      DPOTrainer, step time and real tokens/s (benchmarks/peers/vs_trl_dpo.py --qwen-05b --lora --bf16);
#   2. GRPO of the same model in bf16: paratrain against TRL's GRPOTrainer (transformers' generate),
#      step time split into generation and the rest, generation tokens/s (benchmarks/peers/vs_trl_grpo.py).
# Both at one process on the GPU; runs alternate, the paired ratio's median and 95% CI are printed.
# Every part's output and JSON go to $OUT (or ./gpu-out).
#   bash benchmarks/gpu/gpu_preference_rl.sh            # on the GPU machine (needs trl, peft)
#   bash benchmarks/gpu/gpu_preference_rl.sh --dry-run  # the same code paths on the CPU, tiny model, 1 round
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root: this script lives in benchmarks/gpu/
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
step() { echo; echo "=== $1 ($(date +%T))"; }

if [[ ${1:-} == --dry-run ]]; then
    common=(--device cpu --procs 1 --bf16 --quick)
    dpo=(--batch 8 --micro 4)
    grpo=(--batch 16 --micro 8 --group 4 --new 8)
else
    common=(--device cuda --procs 1 --bf16 --qwen-05b --rounds 2)
    dpo=(--steps 8 --batch 32 --micro 8)
    grpo=(--steps 6 --batch 64 --micro 16 --group 8 --new 64)
    $PY -c 'import torch, transformers, trl, peft; print("torch", torch.__version__, torch.cuda.get_device_name(), "transformers", transformers.__version__, "trl", trl.__version__, "peft", peft.__version__)'
fi

step "DPO + LoRA, bf16: paratrain vs TRL DPOTrainer"
timeout 235 $PY benchmarks/peers/vs_trl_dpo.py "${common[@]}" "${dpo[@]}" --lora --result-file "$OUT/gpu_dpo.json" 2>&1 \
    | grep -v "^W[0-9]" | tee "$OUT/gpu_dpo.txt"

step "GRPO, bf16: paratrain vs TRL GRPOTrainer"
timeout 265 $PY benchmarks/peers/vs_trl_grpo.py "${common[@]}" "${grpo[@]}" --result-file "$OUT/gpu_grpo.json" 2>&1 \
    | grep -v "^W[0-9]" | tee "$OUT/gpu_grpo.txt"
step "done"
