"""On one CUDA GPU: supervised fine-tuning throughput of a ~0.5B HF model, packed against padded,
with and without the chunked loss, and FlexAttention's training against SDPA (issue 21's GPU check).

1. A Qwen2-0.5B-shaped model (24 layers, hidden 896, 14 heads, 2 KV heads, vocabulary 151,936;
   random weights from its config: ``model.hf`` with no weight files) trains on chat data
   (``src/paratrain/testing/sft_data.py``: conversations about standard-library modules, rendered by a ChatML
   template, loss on the assistant turns) in bf16 autocast, one process, AdamW, for ``--steps``
   steps in four runs: ``packing = documents | padded`` x ``loss.chunk_size = 0 | 1024``. Printed per
   run: the median ``tokens_per_s`` (real tokens, not padding) and ``mfu`` (against the data-sheet
   peak of the device, ``hardware/specs.py``) over the steps after the first two, and the
   allocator's peak (``max_memory_allocated``).
2. The built-in GPT on the same packed rows, float32, plain SGD, ``model.args.attention = "flex"``
   against ``"sdpa"`` for 5 steps: the losses and ``grad_norm`` must agree within 1e-4 (relative;
   FlexAttention's backward runs only on a GPU, so the CPU tests check its forward only).

    PYTHONPATH=src python benchmarks/gpu/gpu_sft.py [--steps 12] [--global-batch 16]

``--dry-run-cpu`` checks the script here with a tiny model (part 2 is skipped: no FlexAttention
backward on the CPU). Without CUDA and without that flag it says so and exits with code 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from paratrain.testing.hf_models import QWEN2_05B as QWEN

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Untied output layer (its figures were planned with one): 630M parameters.
QWEN2_05B = dict(QWEN, max_position_embeddings=4096, tie_word_embeddings=False)
TINY = dict(QWEN2_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
TINY["vocab_size"] = 4096


def build_data(root: str, *, conversations: int, model_args: dict) -> tuple[str, str]:
    from transformers import AutoConfig

    from paratrain.data.prepare import prepare
    from paratrain.testing.sft_data import save_chat_tokenizer, stdlib_conversations, write_jsonl

    args = dict(model_args)
    config = AutoConfig.for_model(args.pop("model_type"), **args)
    model_dir = os.path.join(root, "model")
    config.save_pretrained(model_dir)  # no weights: paratrain initialises from the config
    tok = save_chat_tokenizer(os.path.join(root, "tok"))
    chat = write_jsonl(os.path.join(root, "chat.jsonl"), stdlib_conversations(conversations))
    corpus = os.path.join(root, "corpus")
    prepare([chat], out_dir=corpus, tokenizer=tok, fmt="chat", val_fraction=0, progress=False)
    return model_dir, corpus


def run(name: str, over: list[str], *, cuda: bool) -> dict:
    import torch

    import paratrain
    from paratrain.testing.dist_utils import read_metrics

    cfg = paratrain.load_config(None, over)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    paratrain.train(cfg)
    rows = read_metrics(cfg.run.out_dir)[2:] or read_metrics(cfg.run.out_dir)
    return {
        "name": name,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
        "mfu": statistics.median(r["mfu"] for r in rows) if "mfu" in rows[0] else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "losses": [r["loss"] for r in read_metrics(cfg.run.out_dir)],
        "grad_norms": [r["grad_norm"] for r in read_metrics(cfg.run.out_dir)],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--conversations", type=int, default=4000)
    ap.add_argument("--dry-run-cpu", action="store_true", help="check this script on the CPU with a tiny model")
    args = ap.parse_args()
    import torch

    dry = args.dry_run_cpu
    if not torch.cuda.is_available() and not dry:
        print("gpu_sft.py: no CUDA device; nothing measured (use --dry-run-cpu to check the script)")
        return 0
    if dry:
        args.steps, args.global_batch, args.block_size, args.conversations = 4, 4, 256, 60
    device = "cpu" if dry else "cuda"
    common = [
        f"dist.device='{device}'",
        "run.progress=false",
        "metrics.plot=false",
        "data.name='tokens'",
        f"batch.global_batch_size={args.global_batch}",
        f"run.steps={args.steps}",
        "loss.ignore_index=-100",
    ]
    with tempfile.TemporaryDirectory() as root:
        model_dir, corpus = build_data(root, conversations=args.conversations, model_args=TINY if dry else QWEN2_05B)
        if not dry:
            from paratrain.observability.mfu import datasheet_peak_flops

            name = torch.cuda.get_device_name()
            peak = datasheet_peak_flops(name, "bf16")  # dense bf16 of the data sheet, None if unknown
            common.append(f"hardware.peak_flops={peak or 0}")
            print(f"device: {name}, data-sheet bf16 peak {peak or 'unknown'} FLOP/s")
        print(f"{'run':<26} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9}")
        for packing in ("documents", "padded"):
            for chunk in (0, 1024):
                name = f"hf {packing}, chunk {chunk}"
                over = [
                    *common,
                    f"model.hf='{model_dir}'",
                    f"data.args={{path = '{corpus}', block_size = {args.block_size}, packing = '{packing}'}}",
                    f"loss.chunk_size={chunk}",
                    f"precision.dtype='{'fp32' if dry else 'bf16'}'",
                    "batch.micro_batch_size=4" if not dry else "batch.micro_batch_size=2",
                    f"run.out_dir='{root}/{packing}_{chunk}'",
                ]
                try:
                    r = run(name, over, cuda=not dry)
                except torch.OutOfMemoryError:
                    print(f"{name:<26} out of memory")
                    continue
                mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
                peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
                print(f"{name:<26} {r['tokens_per_s']:>10.0f} {mfu:>7} {peak:>9}")
        if dry:
            print("flex vs sdpa: skipped on the CPU (no FlexAttention backward there)")
            return 0
        gpt = [
            *common,
            "model.name='gpt'",
            f"data.args={{path = '{corpus}', block_size = {args.block_size}}}",
            "optim.name='sgd'",
            "optim.lr=0.1",
            "optim.beta1=0",
            "optim.weight_decay=0",
            "optim.grad_clip=0",
            "optim.warmup_steps=0",
            "run.steps=5",
        ]
        results = {}
        for attention in ("sdpa", "flex"):
            arch = f"model.args={{n_layer = 4, n_head = 8, d_model = 512, block_size = {args.block_size}, vocab_size = 512, attention = '{attention}'}}"
            results[attention] = run(attention, [*gpt, arch, f"run.out_dir='{root}/gpt_{attention}'"], cuda=True)
        worst = max(
            abs(a - b) / abs(b)
            for key in ("losses", "grad_norms")
            for a, b in zip(results["flex"][key], results["sdpa"][key])
        )
        print(f"flex vs sdpa, GPT packed, fp32, 5 SGD steps: largest relative difference {worst:.2e} (limit 1e-4)")
        print(f"  tokens/s: sdpa {results['sdpa']['tokens_per_s']:.0f}, flex {results['flex']['tokens_per_s']:.0f}")
        return 0 if worst <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
