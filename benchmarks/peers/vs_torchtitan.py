"""paratrain against torchtitan on the same Llama shape, data, global batch, optimiser and layouts (CPU, gloo).

torchtitan (0.3.0, `pip install torch==2.13.0 torchtitan triton` into a venv of its own, passed
as --tt-python) trains its `llama3_debugmodel` (6 layers, width 256, 16 heads, SwiGLU 768,
vocabulary 2048, RoPE theta 5e5, untied head); paratrain trains a transformers Llama of that
shape (`model.hf`). Both read the same local file: Python standard-library sources as JSON lines,
tokenised by one BPE of 2048 tokens that `paratrain prepare` trains (torchtitan loads the same
`tokenizer.json` through `--hf_assets_path`). Same global batch (rows of --seq tokens), AdamW
(lr 8e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1, clip 1.0, 2 warm-up steps), fp32, no
activation checkpointing, one thread per process. Layouts: world 1 (with and without
accumulation), world 2 DDP and FSDP2, each with and without accumulation.

torchtitan does not run on a CPU as shipped (docs/torchtitan.md): the shim SHIM, written
next to the runs, makes it pick the CPU and gloo, stubs its CUDA memory monitor, gives its
attention torch's SDPA (causal over the row, as paratrain's model computes it: torchtitan's
language models offer FlexAttention only, whose backward torch refuses on a CPU), skips a
timeout barrier gloo refuses and sends its summed gradients as SUM instead of PREMUL_SUM(1).
Nothing of its data, loss, optimiser or step is changed.

It prints, per layout, each run's tokens/s and the paired ratio paratrain / torchtitan
(tokens/s; above 1: paratrain is faster), the median and 95% interval over rounds (runs
alternate in order), and each side's per-step losses against its own one-process run without
accumulation: torchtitan's data loader gives each data-parallel rank its own contiguous share of
the dataset (`split_dataset_by_node`), so its global batch holds other samples at another layout
(torchtitan#3029); paratrain's sampler cuts one global batch per step into the ranks' slices.

    python benchmarks/peers/vs_torchtitan.py --tt-python /tmp/tt-venv/bin/python --rounds 3 --steps 8
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from datetime import datetime

from paratrain.testing.paired import summary_line

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WARMUP = 2  # steps left out of each run's median
# name: (world, dp_replicate, dp_shard, accumulation)
LAYOUTS = {
    "w1": (1, 1, 1, 1),
    "w1 acc2": (1, 1, 1, 2),
    "w2 ddp": (2, 2, 1, 1),
    "w2 ddp acc2": (2, 2, 1, 2),
    "w2 fsdp": (2, 1, 2, 1),
    "w2 fsdp acc2": (2, 1, 2, 2),
}

SHIM = '''\
"""torchtitan on a CPU with gloo (benchmarks/peers/vs_torchtitan.py writes this file)."""
import os
import runpy
import types

import torch
import torch._utils

# 1. torchtitan takes "cuda" when no accelerator is found (tools/utils.py get_device_info);
#    "cpu" makes it use gloo (torch's default backend for it).
torch._utils._get_available_device_type = lambda: "cpu"
# 2. Its memory monitor calls torch.cuda-only functions (components/metrics.py).
for name, fn in {
    "get_device_name": lambda *a: "cpu",
    "get_device_properties": lambda *a: types.SimpleNamespace(
        total_memory=os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    ),
    "memory_stats": lambda *a: {},
    "reset_peak_memory_stats": lambda *a: None,
    "empty_cache": lambda *a: None,
}.items():
    if not hasattr(torch.cpu, name):
        setattr(torch.cpu, name, fn)

import torchtitan.models.llama3 as tt_llama3  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torchtitan.distributed import fsdp as tt_fsdp  # noqa: E402
from torchtitan.distributed import utils as tt_dist_utils  # noqa: E402
from torchtitan.models.common import attention as tt_attention  # noqa: E402
from torchtitan.models.common import config_utils, decoder  # noqa: E402

# 3. Language models offer FlexAttention (torch refuses its backward on a CPU), flex_flash
#    (Hopper) and varlen (CUDA): SDPA instead, causal over the row, no per-document mask.
config_utils.get_attention_config = tt_llama3.get_attention_config = (
    lambda backend: tt_attention.ScaledDotProductAttention.Config()
)
decoder.Decoder.get_attention_masks = lambda self, positions: None
# 4. After step 1 it shortens the groups' timeouts behind barrier(device_ids=[current device]),
#    which gloo refuses for "cpu".
tt_dist_utils.set_pg_timeouts = lambda **kwargs: None
# 5. It sums gradients (divide factor 1; it divides by the global token count itself), which
#    FSDP2 sends as PREMUL_SUM(1.0), an op gloo lacks; force_sum sends SUM: the same numbers.
_disable_division = tt_fsdp.disable_fsdp_gradient_division


def _disable_division_gloo(model):
    _disable_division(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


tt_fsdp.disable_fsdp_gradient_division = _disable_division_gloo
'''

# torchtitan registers trainer configs for its debug model, 8B, 70B and 405B only; its 1B flavor
# (models/llama3/__init__.py _1b: width 2048, 16 layers, 32/8 heads, tied, 1.24e9 parameters)
# gets one here: the debug model's trainer config (local data set, a log line every step, no
# profiler) with the 1B model and its vocabulary in the loss (benchmarks/gpu/gpu_vs_torchtitan.py).
REGISTER_1B = """
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import config_registry as tt_registry, model_registry as tt_model_registry


def llama3_1b():
    config = tt_registry.llama3_debugmodel()
    config.model_spec = tt_model_registry("1B")
    vocab = decoder_vocab_size(config.model_spec)
    config.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab))
    return config


tt_registry.llama3_1b = llama3_1b
"""
RUN = """
runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
"""
LAUNCHER_HEAD = """import runpy
"""


def run(cmd: list[str], env: dict, cwd: str | None = None) -> str:
    res = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd[:8])} ... failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return res.stdout + res.stderr


def prepare(tmp: str, max_bytes: int) -> tuple[str, str]:
    """The shared data: stdlib sources as JSON lines (torchtitan's text loader reads the folder),
    tokenised by `paratrain prepare` with a BPE of 2048 tokens (its tokenizer.json serves both)."""
    text_dir, corpus = os.path.join(tmp, "text"), os.path.join(tmp, "corpus")
    os.makedirs(text_dir)
    n = 0
    with open(os.path.join(text_dir, "data.jsonl"), "w") as f:
        for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
            with open(path, encoding="utf-8", errors="replace") as src:
                text = src.read()
            f.write(json.dumps({"text": text}) + "\n")
            n += len(text)
            if n >= max_bytes:
                break
    run(
        [sys.executable, "-m", "paratrain", "prepare", os.path.join(text_dir, "data.jsonl"), "--out", corpus]
        + ["--tokenizer", "bpe:2048", "--val-fraction", "0", "--workers", "1"],
        os.environ.copy(),
    )
    return text_dir, corpus


def save_model(path: str, seq: int) -> None:
    """torchtitan's llama3 debugmodel as a transformers config (models/llama3/__init__.py _debugmodel)."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,  # compute_ffn_hidden_dim(256, multiple_of=256)
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=max(seq, 256),
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ).save_pretrained(path)


def run_paratrain(layout: str, *, model_dir: str, corpus: str, out: str, args, env: dict) -> tuple[float, list]:
    world, rep, shard, acc = LAYOUTS[layout]
    micro = args.global_batch // (rep * shard * acc)
    sets = [
        f"model.hf='{model_dir}'",
        "data.name='tokens'",
        f"data.args={{path='{corpus}', block_size={args.seq}}}",
        f"batch.global_batch_size={args.global_batch}",
        f"batch.micro_batch_size={micro}",
        f"parallel.dp_replicate={rep}",
        f"parallel.dp_shard={shard}",
        f"run.steps={args.steps}",
        "run.seed=0",
        "run.progress=false",
        "run.save_model=false",
        "metrics.plot=false",
        "optim.lr=8e-4",
        "optim.warmup_steps=2",
        "optim.schedule='linear'",
        "optim.min_lr_ratio=0.0",
        f"run.out_dir='{out}'",
    ]
    os.makedirs(out, exist_ok=True)
    config = os.path.join(out, "empty.toml")  # every key comes from --set
    open(config, "w").close()
    cmd = [sys.executable, "-m", "paratrain", "train", config, "--nproc-per-node", str(world)]
    run(cmd + [arg for item in sets for arg in ("--set", item)], env)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    got = {(r["world_size"], r["global_batch_size"], r["accum_steps"]) for r in rows}
    if got != {(world, args.global_batch, acc)}:
        raise SystemExit(f"paratrain ran {got}, not {(world, args.global_batch, acc)}: the comparison is void")
    stamps = [r["time"] for r in rows]
    step_s = statistics.median([b - a for a, b in zip(stamps, stamps[1:])][WARMUP - 1 :])
    return args.global_batch * args.seq / step_s, [r["loss"] for r in rows]


STEP_LINE = re.compile(r"^\[titan\] (\S+ \S+) .*?step:\s*(\d+)\s+loss:\s*([0-9.]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def write_launcher(out: str, *, cpu: bool = True, register_1b: bool = False) -> str:
    """The file torchrun starts on each rank: the CPU shim (or nothing on a GPU), then torchtitan."""
    path = os.path.join(out, "tt_launch.py")
    with open(path, "w") as f:
        f.write((SHIM if cpu else LAUNCHER_HEAD) + (REGISTER_1B if register_1b else "") + RUN)
    return path


def parse_torchtitan(text: str, steps: int) -> tuple[list[float], list[float]]:
    """Each logged step's time stamp and loss (log_freq 1), checked complete."""
    found = {}
    for line in ANSI.sub("", text).splitlines():
        m = STEP_LINE.search(line)
        if m:
            stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found[int(m.group(2))] = (stamp, float(m.group(3)))
    if sorted(found) != list(range(1, steps + 1)):
        raise SystemExit(f"torchtitan logged steps {sorted(found)}, not 1..{steps}:\n{text[-2000:]}")
    return [found[s][0] for s in sorted(found)], [found[s][1] for s in sorted(found)]


def run_torchtitan(layout: str, *, text_dir: str, corpus: str, out: str, args, env: dict) -> tuple[float, list]:
    world, rep, shard, acc = LAYOUTS[layout]
    local = args.global_batch // (rep * shard)  # torchtitan's local batch: a rank's share of a step
    os.makedirs(out, exist_ok=True)
    shim = write_launcher(out)
    tt_args = [
        "--module",
        "llama3",
        "--config",
        "llama3_debugmodel",
        "--training.steps",
        str(args.steps),
        "--training.seq_len",
        str(args.seq),
        "--training.local_batch_size",
        str(local // acc),  # a micro-batch; torchtitan accumulates global / (local x dp) of them
        "--training.global_batch_size",
        str(args.global_batch),
        "--training.mixed-precision-param",
        "float32",  # its FSDP default is bf16 parameters; paratrain's runs are fp32
        "--parallelism.data_parallel_replicate_degree",
        str(rep),
        "--parallelism.data_parallel_shard_degree",
        str(shard),
        # the default spmd_types backend's FSDP wants every parameter a DTensor on the full mesh
        # (ValueError at world 2 with FSDP on torch 2.13)
        "--parallelism.spmd_backend",
        "partial_dtensor",
        "--optimizer.implementation",
        "for-loop",  # 'fused' is CUDA only
        "--lr_scheduler.warmup_steps",
        "2",
        "--hf_assets_path",
        corpus,
        "--dataloader.dataset-path",
        text_dir,
        "--checkpoint.no-enable",
        "--validator.no-enable",
        "--debug.seed",
        "0",
        "--dump_folder",
        out,
        "activation-checkpoint:none",
    ]
    cmd = [args.tt_python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    text = run(cmd + ["--local-ranks-filter", "0", shim, *tt_args], env, cwd=out)
    stamps, losses = parse_torchtitan(text, args.steps)
    want = f"global batch size {args.global_batch}, gradient accumulation steps {acc},"
    if want not in text:
        raise SystemExit(f"torchtitan did not report '{want}': the comparison is void")
    step_s = statistics.median([b - a for a, b in zip(stamps, stamps[1:])][WARMUP - 1 :])
    return args.global_batch * args.seq / step_s, losses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tt-python", default="/tmp/tt-venv/bin/python", help="a Python with torchtitan installed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of: {', '.join(LAYOUTS)}")
    ap.add_argument("--max-bytes", type=int, default=2_000_000, help="of stdlib text in the shared file")
    ap.add_argument("--json", default="", help="write every run's tokens/s and losses here")
    args = ap.parse_args()
    layouts = [s.strip() for s in args.layouts.split(",")]
    bad = [name for name in layouts if name not in LAYOUTS]
    if bad:
        print(f"--layouts: unknown {bad}; use some of {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    if args.steps <= WARMUP or args.global_batch % 4:
        print(f"--steps must exceed {WARMUP} and --global-batch be a multiple of 4", file=sys.stderr)
        return 2
    probe = subprocess.run([args.tt_python, "-c", "import torchtitan, triton"], capture_output=True)
    if probe.returncode:
        print(
            f"--tt-python {args.tt_python}: cannot import torchtitan and triton; make one with"
            " python3 -m venv /tmp/tt-venv && /tmp/tt-venv/bin/pip install torch==2.13.0 torchtitan triton",
            file=sys.stderr,
        )
        return 2

    # One thread per process on both sides (torchrun sets it only for more than one process).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(REPO, "src")}
    results = {name: {"paratrain": [], "torchtitan": []} for name in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        text_dir, corpus = prepare(tmp, args.max_bytes)
        model_dir = os.path.join(tmp, "model")
        save_model(model_dir, args.seq)
        for r in range(args.rounds):
            load = os.getloadavg()[0]
            for i, name in enumerate(layouts):
                order = ["paratrain", "torchtitan"] if (r + i) % 2 == 0 else ["torchtitan", "paratrain"]
                for side in order:
                    out = os.path.join(tmp, f"r{r}", name.replace(" ", "_"), side)
                    if side == "paratrain":
                        tps, losses = run_paratrain(
                            name, model_dir=model_dir, corpus=corpus, out=out, args=args, env=env
                        )
                    else:
                        tps, losses = run_torchtitan(
                            name, text_dir=text_dir, corpus=corpus, out=out, args=args, env=env
                        )
                    results[name][side].append({"tokens_per_s": tps, "losses": losses})
                pt, tt = results[name]["paratrain"][-1], results[name]["torchtitan"][-1]
                print(
                    f"round {r} {name:<13} paratrain {pt['tokens_per_s']:8.0f} tok/s, torchtitan"
                    f" {tt['tokens_per_s']:8.0f} tok/s, ratio {pt['tokens_per_s'] / tt['tokens_per_s']:.3f}"
                    f" (load average {load:.2f} -> {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
    print("\ntokens/s ratio paratrain / torchtitan (above 1: paratrain is faster):")
    for name in layouts:
        ratios = [p["tokens_per_s"] / t["tokens_per_s"] for p, t in zip(*results[name].values())]
        print("  " + summary_line(f"{name:<13}", ratios) if len(ratios) > 1 else f"  {name}: {ratios[0]:.3f}")
    print("\nper-step losses (round 0), and the largest relative difference from the side's own 'w1' run:")
    for side in ("paratrain", "torchtitan"):
        ref = results[layouts[0]][side][0]["losses"]
        print(f"  {side} ({layouts[0]} is the reference)")
        for name in layouts:
            losses = results[name][side][0]["losses"]
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
            print(f"    {name:<13} {' '.join(f'{x:.5f}' for x in losses)}  max rel diff {worst:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
