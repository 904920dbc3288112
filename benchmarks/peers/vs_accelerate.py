"""paratrain against Hugging Face Accelerate on the same HF Llama, data, batch and optimiser (world 2, DDP).

Both train a small random ``transformers`` Llama (saved to a temp directory first) for the same
number of AdamW steps on the same token sequences, global batch ``--batch`` with micro-batches of
``--micro`` on 2 CPU processes under torchrun: paratrain with ``[model] hf = DIR`` and
``parallel.dp_replicate = 2``, Accelerate with its own ``Accelerator`` (DDP) and
``accelerator.accumulate``. Each run reports the median optimiser-step time of its steps after
the warm-up ones; runs alternate (paratrain, accelerate, accelerate, paratrain, ...) so drifts in
the machine's load hit both, and the paired ratio of each round is printed with its median:
``ratio paratrain/accelerate: X`` (below 1: paratrain is faster).

On CPU, Accelerate joins the process group only with ACCELERATE_USE_CPU=true: the worker checks
``accelerator.num_processes == 2`` and fails otherwise (a world-1 comparison would be void).

``--lora`` (docs/lora.md#measured): LoRA fine-tuning, four runs a round in rotating order:
paratrain with full fine-tuning, paratrain with ``[model.lora]``, Accelerate with full
fine-tuning and PEFT's ``get_peft_model`` under Accelerate, with the same LoRA config (``--lora-r``, alpha 2r, dropout 0, q_proj and v_proj), the
same global batch and AdamW over the trained parameters only. It prints the paired ratios
LoRA / full of each tool, paratrain LoRA / Accelerate + PEFT and, to tell a LoRA cost from the
loop's own, paratrain full / Accelerate full. Every run is checked to
have run at world 2 with the global batch ``--batch`` (paratrain: its metrics rows; Accelerate:
``num_processes`` x micro-batch x accumulation). Each round's line carries the load average.

    python benchmarks/peers/vs_accelerate.py --rounds 6 --steps 10
    python benchmarks/peers/vs_accelerate.py --lora --rounds 6 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from paratrain.testing.paired import paired_ratios, summary_line

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LORA_TARGETS = ["q_proj", "v_proj"]
WARMUP = 2  # steps left out of each run's median (first-step allocations, DDP bucket rebuild)


def dataset(n: int = 256, seq_len: int = 64, vocab: int = 512, seed: int = 0):
    """The token sequences both tools train on: (input, next-token target) pairs."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (n, seq_len + 1), generator=g)
    return torch.utils.data.TensorDataset(seq[:, :-1].clone(), seq[:, 1:].clone())


def save_model(path: str, args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).save_pretrained(path)


def accelerate_worker(args) -> None:
    """One rank of the Accelerate run (started by torchrun)."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    accum = args.batch // (args.micro * 2)
    accelerator = Accelerator(gradient_accumulation_steps=accum, cpu=True)
    if accelerator.num_processes != 2:
        raise SystemExit(f"accelerate joined a world of {accelerator.num_processes}, not 2: the comparison is void")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, attn_implementation="sdpa")
    if args.lora:  # PEFT's own adapters, the same config as paratrain's [model.lora]
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules=LORA_TARGETS)
        )
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=args.micro, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    times, t0, micro, done = [], time.perf_counter(), 0, 0
    while done < args.steps:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=x, labels=y, shift_labels=y).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # Accelerate's idiom: clip the synced gradient, once per step
                    accelerator.clip_grad_norm_(trained, 1.0)
                opt.step()
                opt.zero_grad()
            micro += 1
            if micro % accum == 0:
                now = time.perf_counter()
                times.append(now - t0)
                t0, done = now, done + 1
                if done == args.steps:
                    break
    if accelerator.is_main_process:
        with open(args.result, "w") as f:
            json.dump(
                {
                    "step_s": statistics.median(times[WARMUP:]),
                    "world": accelerator.num_processes,
                    "global_batch": args.micro * accum * accelerator.num_processes,
                    "trained": sum(p.numel() for p in trained),
                },
                f,
            )


def run(cmd: list[str], env: dict) -> None:
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed ({res.returncode}):\n{res.stderr[-3000:]}")


def torchrun(argv: list[str], env: dict) -> None:
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *argv], env)


def run_paratrain(model_dir: str, out: str, args, env: dict, lora: bool = False) -> float:
    sets = [
        f"model.hf='{model_dir}'",
        "data.factory='benchmarks.peers.vs_accelerate:dataset'",
        f"batch.global_batch_size={args.batch}",
        f"batch.micro_batch_size={args.micro}",
        "parallel.dp_replicate=2",
        f"run.steps={args.steps}",
        "run.progress=false",
        "run.save_model=false",
        "metrics.plot=false",
        "optim.lr=1e-3",
        "optim.warmup_steps=0",
        "optim.schedule='constant'",
        f"run.out_dir='{out}'",
    ]
    if lora:
        sets += [
            f"model.lora.r={args.lora_r}",
            f"model.lora.alpha={2 * args.lora_r}",
            f"model.lora.target_modules={LORA_TARGETS}",
        ]
    config = os.path.join(os.path.dirname(out), "empty.toml")  # every key comes from --set
    open(config, "w").close()
    cmd = [sys.executable, "-m", "paratrain", "train", config, "--nproc-per-node", "2"]
    cmd += [arg for item in sets for arg in ("--set", item)]
    run(cmd, env)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    layout = {(r["world_size"], r["global_batch_size"]) for r in rows}
    if layout != {(2, args.batch)}:
        raise SystemExit(
            f"paratrain ran at (world, global batch) {layout}, not (2, {args.batch}): the comparison is void"
        )
    stamps = [r["time"] for r in rows]
    # The whole loop iteration (rows' wall-clock differences), as the Accelerate loop is timed,
    # not the row's step_time_s, which ends before logging and checkpoint checks.
    return statistics.median([b - a for a, b in zip(stamps, stamps[1:])][WARMUP:])


def run_accelerate(model_dir: str, out: str, args, env: dict, lora: bool = False) -> float:
    result = os.path.join(out, "accelerate.json")
    os.makedirs(out, exist_ok=True)
    argv = [__file__, "--worker", "--model-dir", model_dir, "--result", result]
    argv += ["--steps", str(args.steps), "--batch", str(args.batch), "--micro", str(args.micro)]
    argv += ["--lora", "--lora-r", str(args.lora_r)] if lora else []
    torchrun(argv, {**env, "ACCELERATE_USE_CPU": "true"})
    with open(result) as f:
        got = json.load(f)
    if (got["world"], got["global_batch"]) != (2, args.batch):
        raise SystemExit(f"accelerate ran at {got}, not world 2 with global batch {args.batch}: the comparison is void")
    return got["step_s"]


def lora_rounds(model_dir: str, tmp: str, args, env: dict) -> None:
    """paratrain full, paratrain LoRA and Accelerate + PEFT LoRA, in rotating order each round."""
    tools = {
        "paratrain-full": lambda out: run_paratrain(model_dir, out, args, env, lora=False),
        "paratrain-lora": lambda out: run_paratrain(model_dir, out, args, env, lora=True),
        "accelerate-full": lambda out: run_accelerate(model_dir, out, args, env, lora=False),
        "accelerate-peft": lambda out: run_accelerate(model_dir, out, args, env, lora=True),
    }
    names = list(tools)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        load = os.getloadavg()[0]
        for tool in order:
            times[tool].append(tools[tool](os.path.join(tmp, f"{tool}{r}")))
        print(
            f"round {r} (load average {load:.2f} -> {os.getloadavg()[0]:.2f}): "
            + ", ".join(f"{n} {times[n][-1] * 1e3:.1f} ms/step" for n in names),
            flush=True,
        )
    print("median step: " + ", ".join(f"{n} {statistics.median(times[n]) * 1e3:.1f} ms" for n in names))
    pairs = [("paratrain-lora", "paratrain-full"), ("accelerate-peft", "accelerate-full")]
    pairs += [("paratrain-lora", "accelerate-peft"), ("paratrain-full", "accelerate-full")]
    for a, b in pairs:
        ratios = paired_ratios(times[a], times[b])
        print(f"paired ratios {a}/{b}: {', '.join(f'{x:.3f}' for x in ratios)}")
        print(summary_line(f"ratio {a}/{b}", ratios))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lora", action="store_true", help="LoRA: paratrain full / LoRA against PEFT + Accelerate")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (alpha = 2r) with --lora")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return accelerate_worker(args)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")]), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "llama")
        save_model(model_dir, args)
        if args.lora:
            return lora_rounds(model_dir, tmp, args, env)
        ratios, ours, theirs = [], [], []
        for r in range(args.rounds):
            order = ("paratrain", "accelerate") if r % 2 == 0 else ("accelerate", "paratrain")
            got = {}
            for tool in order:
                out = os.path.join(tmp, f"{tool}{r}")
                fn = run_paratrain if tool == "paratrain" else run_accelerate
                got[tool] = fn(model_dir, out, args, env)
            ours.append(got["paratrain"])
            theirs.append(got["accelerate"])
            ratios.append(got["paratrain"] / got["accelerate"])
            print(
                f"round {r}: paratrain {got['paratrain'] * 1e3:.1f} ms/step, accelerate {got['accelerate'] * 1e3:.1f}"
                f" ms/step, ratio {ratios[-1]:.3f}",
                flush=True,
            )
    print(
        f"median step: paratrain {statistics.median(ours) * 1e3:.1f} ms, accelerate {statistics.median(theirs) * 1e3:.1f} ms"
    )
    print(f"paired ratios: {', '.join(f'{x:.3f}' for x in ratios)} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    print(summary_line("ratio paratrain/accelerate", ratios))


if __name__ == "__main__":
    main()
