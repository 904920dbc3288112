"""Optimiser-state and gradient bytes per rank, LoRA against full fine-tuning on the same model
(docs/lora.md#measured): a tiny transformers Llama (``model.hf``, src/paratrain/testing/hf_models.py) and the
built-in GPT, at world 1 and world 2 (DDP and FSDP2 ``dp_shard = 2``).

Counted from the real tensors after one AdamW step, as benchmarks/memory/memory.py does for full
training: on each rank the local part (``DTensor.to_local()``; plain tensors whole) of every
gradient (before ``zero_grad``) and of every AdamW moment (``exp_avg``, ``exp_avg_sq``; the
scalar ``step`` counters, 4 bytes per trained tensor, are listed apart). The model is built by
paratrain's own ``build`` (PEFT's adapters injected by ``[model.lora]``) and laid out by its
``parallelize``; the optimiser is its ``build_optimizer`` (trained parameters only).

Formula, AdamW in fp32: 8 bytes of state (two moments) + 4 of gradient = 12 bytes per *trained*
parameter held by the rank: DDP holds all of them, FSDP2 its shard (1/N of each). A frozen base
weight has neither. So the ratio LoRA / full of (gradient + state) bytes is the ratio of trained
parameters: (adapter parameters) / (all parameters). The check (exit 1 otherwise): every
measured figure equals its formula exactly (byte counts, no timing).

    PYTHONPATH=src python benchmarks/memory/lora_memory.py [--r 8] [--targets q_proj v_proj]
"""

from __future__ import annotations

import argparse
import os
import sys

from paratrain.testing.lora_memory import GPT_ARGS, LLAMA_ARGS, check, measure_all

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--targets", nargs="+", default=["q_proj", "v_proj"])
    args = ap.parse_args()
    rows = measure_all(args.worlds, args.r, args.targets)
    print(
        f"LoRA r={args.r} on {', '.join(args.targets)} against full fine-tuning; fp32 AdamW; bytes on rank 0"
        f" (every rank checked). llama: transformers Llama {LLAMA_ARGS}; gpt: {GPT_ARGS}"
    )
    print("formula: 4 B gradient + 8 B AdamW moments per trained parameter the rank holds (FSDP2: 1/N of them)")
    head = (
        "model",
        "world",
        "layout",
        "trained full",
        "trained LoRA",
        "grad B full",
        "state B full",
        "grad B LoRA",
        "state B LoRA",
        "ratio (grad+state)",
        "formula ratio",
        "step counters B full / LoRA",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        f, lo = row["full"][0], row["lora"][0]
        ratio = (lo["grads"] + lo["state"]) / (f["grads"] + f["state"])
        print(
            f"| {row['model']} | {row['world']} | {row['layout']} | {f['trained']:,} | {lo['trained']:,}"
            f" | {f['grads']:,} | {f['state']:,} | {lo['grads']:,} | {lo['state']:,} | {ratio:.5f}"
            f" | {lo['trained'] / f['trained']:.5f} | {f['step_counters']} / {lo['step_counters']} |"
        )
    bad = check(rows)
    for line in bad:
        print("FAIL", line)
    print("check: measured == formula on every rank:", "FAIL" if bad else "ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
