"""Checkpoint size of LoRA against full fine-tuning on the same model (docs/lora.md).

    python benchmarks/memory/lora_checkpoint_size.py [--hidden 256] [--layers 4] [--r 8]

Saves a tiny random Llama (``--hidden``, ``--layers``, vocab 1024) to a temporary directory, trains
it one AdamW step twice in one process, with a checkpoint at the end: once in full, once with
``[model.lora]`` (``--r``, q_proj and v_proj), and prints the bytes of each checkpoint folder (DCP
shards, .metadata, config, manifest) and their ratio. A LoRA checkpoint holds the adapters, their
AdamW moments and the run state; a full one every weight and its two moments.
"""

from __future__ import annotations

import argparse
import os
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--r", type=int, default=8)
    args = p.parse_args()

    import paratrain
    from paratrain.testing.hf_models import save_tiny

    with tempfile.TemporaryDirectory() as tmp:
        hf = save_tiny(
            "llama",
            f"{tmp}/llama",
            vocab_size=1024,
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
        )
        common = [
            f"model.hf='{hf}'",
            "data.factory='paratrain.testing.toy:toy_lm'",
            "data.args={n = 8, seq_len = 16, vocab = 1024}",
            "batch.global_batch_size=8",
            "run.steps=1",
            "checkpoint.at_end=true",
            "run.save_model=false",
            "run.progress=false",
            "metrics.plot=false",
        ]
        lora = [
            f"model.lora.r={args.r}",
            f"model.lora.alpha={2 * args.r}",
            "model.lora.target_modules=['q_proj', 'v_proj']",
        ]
        sizes = {}
        for name, extra in (("full", []), ("lora", lora)):
            out = f"{tmp}/{name}"
            paratrain.train(paratrain.load_config(None, [*common, *extra, f"run.out_dir='{out}'"]))
            sizes[name] = folder_bytes(f"{out}/checkpoints/step-1")
    print(f"llama hidden {args.hidden}, {args.layers} layers, vocab 1024; LoRA r={args.r} on q_proj, v_proj")
    print(f"full checkpoint: {sizes['full'] / 1e6:.3f} MB")
    print(f"LoRA checkpoint: {sizes['lora'] / 1e6:.3f} MB")
    print(f"ratio LoRA / full: {sizes['lora'] / sizes['full']:.4f}")


if __name__ == "__main__":
    main()
