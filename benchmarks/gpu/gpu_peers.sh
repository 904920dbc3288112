#!/usr/bin/env bash
# Issue 58 item 6: every peer comparison that needs a GPU, in one device run under 10 minutes:
#   1. paratrain's MFU beside torchtitan's on the same 1.24e9-parameter Llama (FSDP2, bf16, compile;
#      benchmarks/gpu/gpu_vs_torchtitan.py, 2 alternating pairs of 20 steps): 280 s at most;
#   2. DPO with LoRA and GRPO of a Qwen2.5-0.5B-shaped model against TRL's trainers
#      (benchmarks/gpu/gpu_preference_rl.sh): 235 s + 265 s at most.
# The timeouts add up to 9 min 40 s; each part's output goes to $OUT (or ./gpu-out).
#   bash benchmarks/gpu/gpu_peers.sh [--tt-python PATH]   # on the GPU machine (torchtitan, trl, peft)
#   bash benchmarks/gpu/gpu_peers.sh --dry-run            # the same code paths on the CPU, tiny models
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export OUT PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
DRY=() TT=(--tt-python "$PY")
while [[ $# -gt 0 ]]; do
    case $1 in
        --dry-run) DRY=(--dry-run); shift ;;
        --tt-python) TT=(--tt-python "$2"); shift 2 ;;
        *) echo "gpu_peers.sh: unknown argument $1; use --dry-run or --tt-python PATH" >&2; exit 2 ;;
    esac
done
step() { echo; echo "=== $1 ($(date +%T))"; }

step "paratrain beside torchtitan: MFU, 1.24e9-parameter Llama, FSDP2 + bf16 + compile"
pairs=(--pairs 2 --steps 20)
[[ ${#DRY[@]} -gt 0 ]] && pairs=(--pairs 1 --steps 4 --warmup 1)
timeout 280 $PY benchmarks/gpu/gpu_vs_torchtitan.py "${TT[@]}" "${pairs[@]}" "${DRY[@]}" 2>&1 \
    | grep -v "^W[0-9]" | tee "$OUT/gpu_vs_torchtitan.txt" | tail -20

step "DPO + LoRA and GRPO against TRL's trainers"
bash benchmarks/gpu/gpu_preference_rl.sh "${DRY[@]}"
step "done"
