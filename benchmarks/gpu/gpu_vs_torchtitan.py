"""On CUDA GPUs: paratrain's MFU beside torchtitan's on the same 1.24e9-parameter Llama (issue 58 items 2 and 6).

The model is torchtitan's llama3 "1B" flavor (width 2048, 16 layers, 32 query and 8 key/value
heads, SwiGLU 8192, vocabulary 128256, tied embedding, RoPE theta 5e5), which torchtitan ships
without a trainer config: the launcher registers one (its 8B trainer config with the 1B model,
benchmarks/peers/vs_torchtitan.py REGISTER_1B: the debug model's trainer config, reading the
local file, with the 1B model). paratrain trains a transformers Llama of that
shape (`model.hf`). Both: FSDP2 over every visible GPU, bf16 parameters with fp32 gradient
reduction, torch.compile, no activation checkpointing, AdamW, the same global batch of rows of
--seq tokens from the same local file and tokenizer (vs_torchtitan.py `prepare`). Runs alternate
(paratrain, torchtitan, torchtitan, paratrain, ...). Each run's tokens/s is the global batch over
the median step after the first --warmup steps; MFU is PaLM's FLOPs per token (the planner's
count, `ModelStats`) over the data-sheet bf16 peak of the device (`hardware/specs.py`).

    python benchmarks/gpu/gpu_vs_torchtitan.py --tt-python /path/to/venv/bin/python [--pairs 2]

torchtitan needs its own venv with a CUDA torch (`pip install torchtitan` beside it). On a GPU
torchtitan runs as shipped (no shim). `--dry-run` checks this script on a CPU: torchtitan's debug
model through the CPU shim, a few steps, world 1, fp32, no compile. Without CUDA and without
that flag it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks", "peers"))
import vs_torchtitan as vt  # noqa: E402  (the shared data, launcher and log parsing)


def save_model(path: str, *, dry: bool, seq: int) -> None:
    from transformers import LlamaConfig

    if dry:
        vt.save_model(path, seq)
        return
    LlamaConfig(  # torchtitan models/llama3/__init__.py _1b
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,  # compute_ffn_hidden_dim(2048, multiple_of=1024, ffn_dim_multiplier=1.5)
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=max(seq, 8192),
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ).save_pretrained(path)


def paratrain_run(model_dir, corpus, out, args, env) -> float:
    sets = [
        f"model.hf='{model_dir}'",
        "data.name='tokens'",
        f"data.args={{path='{corpus}', block_size={args.seq}}}",
        f"batch.global_batch_size={args.local_batch * args.nproc}",
        f"batch.micro_batch_size={args.local_batch}",
        "parallel.dp_replicate=1",
        f"parallel.dp_shard={args.nproc}",
        f"run.steps={args.steps}",
        "run.seed=0",
        "run.progress=false",
        "run.save_model=false",
        "metrics.plot=false",
        "optim.lr=3e-4",
        f"run.out_dir='{out}'",
    ]
    if not args.dry_run:
        sets += ["precision.dtype='bf16'", "precision.reduce_dtype='fp32'", "train.compile=true"]
    os.makedirs(out, exist_ok=True)
    config = os.path.join(out, "empty.toml")
    open(config, "w").close()
    cmd = [sys.executable, "-m", "paratrain", "train", config, "--nproc-per-node", str(args.nproc)]
    vt.run(cmd + [a for item in sets for a in ("--set", item)], env)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        stamps = [json.loads(line)["time"] for line in f]
    return statistics.median([b - a for a, b in zip(stamps, stamps[1:])][args.warmup - 1 :])


def torchtitan_run(text_dir, corpus, out, args, env) -> float:
    os.makedirs(out, exist_ok=True)
    launcher = vt.write_launcher(out, cpu=args.dry_run, register_1b=not args.dry_run)
    tt = ["--module", "llama3", "--config", "llama3_debugmodel" if args.dry_run else "llama3_1b"]
    tt += ["--training.steps", str(args.steps), "--training.seq_len", str(args.seq)]
    tt += ["--training.local_batch_size", str(args.local_batch)]
    tt += ["--training.global_batch_size", str(args.local_batch * args.nproc)]
    tt += ["--parallelism.data_parallel_replicate_degree", "1"]
    tt += ["--parallelism.data_parallel_shard_degree", str(args.nproc)]
    tt += ["--hf_assets_path", corpus, "--dataloader.dataset-path", text_dir]
    tt += ["--checkpoint.no-enable", "--validator.no-enable", "--debug.seed", "0", "--dump_folder", out]
    if args.dry_run:
        tt += ["--training.mixed-precision-param", "float32", "--parallelism.spmd_backend", "partial_dtensor"]
        tt += ["--optimizer.implementation", "for-loop"]
    else:
        tt += ["--compile.enable", "--training.mixed-precision-param", "bfloat16"]
    tt += ["activation-checkpoint:none"]
    cmd = [args.tt_python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
    text = vt.run(cmd + ["--local-ranks-filter", "0", launcher, *tt], env, cwd=out)
    stamps, _ = vt.parse_torchtitan(text, args.steps)
    return statistics.median([b - a for a, b in zip(stamps, stamps[1:])][args.warmup - 1 :])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tt-python", default="/tmp/tt-venv/bin/python", help="a Python with torchtitan")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out (compilation)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--local-batch", type=int, default=4, help="rows per GPU and step")
    ap.add_argument("--nproc", type=int, default=0, help="GPUs (0: all visible)")
    ap.add_argument("--dry-run", action="store_true", help="check this script on the CPU (tiny model)")
    args = ap.parse_args()

    import torch

    if args.dry_run:
        args.nproc, args.steps, args.warmup, args.seq, args.local_batch, args.pairs = 1, 4, 2, 64, 2, 1
        peak = float("nan")  # no MFU on a CPU
    elif not torch.cuda.is_available():
        print("gpu_vs_torchtitan.py needs CUDA GPUs; nothing measured. On CPU: benchmarks/peers/vs_torchtitan.py")
        return 0
    else:
        from paratrain.hardware.specs import datasheet_peak_flops

        args.nproc = args.nproc or torch.cuda.device_count()
        peak = datasheet_peak_flops(torch.cuda.get_device_name(), "bf16") or float("nan")
    from paratrain.config import load_config
    from paratrain.plan.cost import ModelStats
    from paratrain.plan.enumerate import meta_model
    from paratrain.testing.paired import summary_line

    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src")}
    if args.dry_run:
        env["OMP_NUM_THREADS"] = "1"
    rows = {"paratrain": [], "torchtitan": []}
    with tempfile.TemporaryDirectory() as tmp:
        text_dir, corpus = vt.prepare(tmp, 200_000 if args.dry_run else 20_000_000)
        model_dir = os.path.join(tmp, "model")
        save_model(model_dir, dry=args.dry_run, seq=args.seq)
        cfg = load_config(
            os.path.join(REPO, "configs", "debug.toml"),
            ["model.args={}", f"model.hf='{model_dir}'", f"data.args={{block_size={args.seq}, max_bytes=1000}}"],
        )
        flops = ModelStats.of(meta_model(cfg), cfg).flops_per_token
        tokens = args.local_batch * args.nproc * args.seq
        for p in range(args.pairs):
            for side in ["paratrain", "torchtitan"] if p % 2 == 0 else ["torchtitan", "paratrain"]:
                out = os.path.join(tmp, f"p{p}", side)
                if side == "paratrain":
                    step_s = paratrain_run(model_dir, corpus, out, args, env)
                else:
                    step_s = torchtitan_run(text_dir, corpus, out, args, env)
                rows[side].append(tokens / step_s)
                mfu = tokens / step_s * flops / (args.nproc * peak)
                print(f"pair {p} {side:<10} {tokens / step_s:10.0f} tokens/s  MFU {mfu:.1%}", flush=True)
    ratios = [a / b for a, b in zip(rows["paratrain"], rows["torchtitan"])]
    print(
        f"{args.nproc} x {'CPU (dry run)' if args.dry_run else torch.cuda.get_device_name()},"
        f" {flops:.3g} FLOPs per token; tokens/s paratrain / torchtitan (above 1: paratrain is faster):"
    )
    print("  " + (summary_line("ratio", ratios) if len(ratios) > 1 else f"ratio {ratios[0]:.3f} (1 pair)"))
    if args.dry_run:
        # The 1B trainer config the GPU run registers: built here, not trained.
        check = vt.REGISTER_1B + "\nspec = llama3_1b().model_spec\nprint(spec.flavor, spec.model.dim)"
        built = subprocess.run([args.tt_python, "-c", check], capture_output=True, text=True)
        if built.returncode or "1B 2048" not in built.stdout:
            raise SystemExit(f"the 1B trainer config did not build:\n{built.stderr[-2000:]}")
        print("dry run: both sides trained and were parsed, the 1B config builds; no figure here is a GPU's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
