"""What the comparisons with TRL and Accelerate share (benchmarks/peers/ and the DPO reference
benchmark): the optimiser settings both tools get (``optim_sets`` for paratrain,
``trl_optim_kwargs`` for TRL) and TRL's other config keywords, TRL's step-timing callback, the
processes' environment, the warm-up left out of a run's median step time, the launcher of a run,
the scripts' parser, and the DPO comparison's layout options, rounds and result file.
transformers, TRL and torch.distributed are imported inside the functions that use them."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from paratrain.testing.dist_utils import REPO
from paratrain.testing.paired import ratio_ci, summary_line

WARMUP = 2  # steps left out of each run's median (first-step allocations, DDP bucket rebuild)

BLOCK = 512  # packed row length of both tools (paratrain's block_size, TRL's max_length)

BETA = 0.1

LORA = dict(r=16, alpha=32)  # --lora: on every linear layer but the output layer, no dropout


def optim_sets(lr: float) -> list[str]:
    """paratrain's optimiser overrides in every comparison: AdamW with the betas, eps, clipping and
    constant learning rate the peer tool is given, no weight decay, no warm-up."""
    return [
        f"optim.lr={lr}",
        "optim.beta1=0.9",
        "optim.beta2=0.95",
        "optim.eps=1e-8",
        "optim.weight_decay=0",
        "optim.grad_clip=1.0",
        "optim.warmup_steps=0",
        "optim.schedule='constant'",
    ]


def trl_optim_kwargs(lr: float, *, adam: bool = True) -> dict:
    """TRL's twin of ``optim_sets``: the config keywords that give TRL's trainer the optimiser
    paratrain is given. ``adam=False`` leaves the betas and eps at TRL's defaults (vs_trl_grpo.py,
    whose paratrain side keeps its own defaults too)."""
    kw = dict(
        learning_rate=lr,
        lr_scheduler_type="constant",  # TRL's default is linear decay; paratrain's schedule is set constant
        warmup_steps=0,
        weight_decay=0.0,
    )
    if adam:
        kw.update(adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8)  # TRL's default beta2 is 0.999
    kw.update(
        max_grad_norm=1.0,
        optim="adamw_torch",  # torch.optim.AdamW, as paratrain (not the fused kernel)
        gradient_checkpointing=False,  # TRL's default is on; paratrain's is off
    )
    return kw


def trl_run_kwargs() -> dict:
    """The rest of every TRL config here: data in the main process, no reports, saves or progress
    bars, a loss logged every step, seed 0."""
    return dict(
        dataloader_num_workers=0,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )


def step_timer():
    """A ``TrainerCallback`` that stamps each optimiser step's begin and end (``time.perf_counter``)
    and keeps the micro-batch counts its trainer (set ``.trainer`` once built) gathered in
    ``trainer.micro`` during the step."""
    import time

    from transformers import TrainerCallback

    class Steps(TrainerCallback):
        def __init__(self):
            self.begin, self.end, self.steps, self.trainer = [], [], [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(time.perf_counter())
            self.steps.append(list(self.trainer.micro))
            self.trainer.micro.clear()

    return Steps()


def peer_env(*, inherit_pythonpath: bool = False, hub_kernels_off: bool = False) -> dict:
    """The environment of both tools' processes: the repository on the path, one thread per
    process, nothing fetched from the Hub; the Hub and tokenizer settings are set in this process too."""
    path = [REPO, os.path.join(REPO, "src")]
    if inherit_pythonpath:
        path += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",  # everything is local; TRL's trainer would otherwise send a telemetry ping
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    keep = ["HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "TOKENIZERS_PARALLELISM"]
    if hub_kernels_off:
        env["USE_HUB_KERNELS"] = "0"  # transformers >= 5.2x would fetch kernels from the Hub on CUDA
        keep.append("USE_HUB_KERNELS")
    os.environ.update({k: env[k] for k in keep})
    return env


def script_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring's first paragraph as the description, its
    ``    python ...`` example lines as the epilog."""
    return argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        epilog="\n".join(line.strip() for line in doc.splitlines() if line.startswith("    python ")),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def parse_peer_args(p: argparse.ArgumentParser, trl_worker):
    """A comparison script's arguments; None after running ``trl_worker`` under ``--worker``.
    ``--quick``: one round of ``WARMUP + 2`` steps."""
    args = p.parse_args()
    if args.worker:
        trl_worker(args)
        return None
    if args.quick:
        args.rounds, args.steps = 1, WARMUP + 2
    if args.steps <= WARMUP + 1:
        raise SystemExit(f"--steps must exceed {WARMUP + 1} (the first {WARMUP} are warm-up)")
    return args


def longest_pair(tok, rows: list[dict]) -> int:
    """Tokens of the longest preference pair: its prompt + chosen and prompt + rejected sides
    through ``tok``'s chat template, together."""
    longest = 0
    for r in rows:
        sides = [
            tok.apply_chat_template(r["prompt"] + r[k], tokenize=True, return_dict=True) for k in ("chosen", "rejected")
        ]
        longest = max(longest, sum(len(s["input_ids"]) for s in sides))
    return longest


def steady(stamps: list[float]) -> float:
    """Median of the step times (differences of consecutive step-end stamps) after the first WARMUP steps."""
    diffs = [b - a for a, b in zip(stamps, stamps[1:])]  # diffs[i] is step i + 2 (1-based)
    return statistics.median(diffs[WARMUP - 1 :])


def run(cmd: list[str], env: dict) -> None:
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed ({res.returncode}):\n{res.stderr[-3000:]}")


def add_layout_args(p: argparse.ArgumentParser, *, micro: int, batch: int) -> None:
    """The options that set where and how both tools run (this script's and vs_trl_grpo.py's)."""
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both tools run (default cpu)")
    p.add_argument("--procs", type=int, default=2, help="processes (data-parallel ranks) of each tool (default 2)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast over fp32 weights in both tools (else fp32)")
    p.add_argument("--qwen-05b", action="store_true", help="Qwen2.5-0.5B's shape, random weights (the GPU check)")
    p.add_argument("--batch", type=int, default=batch, help=f"global batch (default {batch})")
    p.add_argument("--micro", type=int, default=micro, help=f"per micro-batch per process (default {micro})")


def trl_layout(args) -> dict:
    """TRL's settings for the layout: the device, the process group's backend, the precision."""
    cpu = args.device == "cpu"
    return {"use_cpu": cpu, "ddp_backend": "gloo" if cpu else "nccl", "bf16": args.bf16}


def paratrain_layout(args) -> list[str]:
    """paratrain's --set lines for the same layout (bf16: autocast over fp32 master weights, as TRL's bf16)."""
    return [
        f"parallel.dp_replicate={args.procs}",
        f"dist.device='{args.device}'",
        f"precision.dtype='{'bf16' if args.bf16 else 'fp32'}'",
    ]


def worker_layout(args) -> list[str]:
    """The layout options handed on to the TRL worker."""
    return ["--device", args.device, "--procs", str(args.procs), *(["--bf16"] if args.bf16 else [])]


def describe_layout(args) -> str:
    what = f"{args.procs} process{'es' if args.procs > 1 else ''} on {args.device}"
    return what + (", bf16 autocast" if args.bf16 else ", float32")


def check_trl_world(trainer, args) -> int:
    """TRL's world, backend and batch settings must be the ones asked for; else the run is void."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    backend = dist.get_backend() if dist.is_initialized() else trl_layout(args)["ddp_backend"]
    a = trainer.args
    if world != args.procs or a.world_size != args.procs or backend != trl_layout(args)["ddp_backend"]:
        raise SystemExit(f"TRL joined a world of {world} ({a.world_size}) on {backend}, not {args.procs}: void")
    if a.per_device_train_batch_size != args.micro or a.gradient_accumulation_steps != args.accum:
        raise SystemExit(
            f"TRL runs micro {a.per_device_train_batch_size} x accum {a.gradient_accumulation_steps}: void"
        )
    if a.bf16 != args.bf16:
        raise SystemExit(f"TRL's bf16 = {a.bf16}, not {args.bf16}: void")
    return world


def gather(obj) -> list:
    """``obj`` of every rank (a world of one when TRL's launcher made no process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def save_policy(path: str, args, *, seed: int, vocab: int, max_positions: int) -> str:
    """The policy both tools load: a random Qwen2 of --hidden x --layers, or of Qwen2.5-0.5B's
    shape (--qwen-05b; stored in bf16, loaded as float32)."""
    if not args.qwen_05b:
        from paratrain.testing.hf_models import save_tiny

        h = args.hidden
        shape = dict(vocab_size=vocab, hidden_size=h, intermediate_size=4 * h, num_hidden_layers=args.layers)
        return save_tiny("qwen2", path, max_position_embeddings=max_positions, seed=seed, **shape)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from paratrain.testing.hf_models import QWEN2_05B

    shape = {k: v for k, v in QWEN2_05B.items() if k != "model_type"}
    torch.manual_seed(seed)
    with torch.device(args.device):  # initialised on the GPU: seconds, not a minute of CPU
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", max_position_embeddings=2048, **shape))
    model.to(torch.bfloat16).save_pretrained(path)
    del model
    return path


def shape_of(args) -> str:
    return "Qwen2.5-0.5B's shape (random)" if args.qwen_05b else f"Qwen2 hidden {args.hidden} x {args.layers} layers"


def pair_positions(corpus: str, block: int, micro: int, draws: int = 200) -> float:
    """paratrain's positions per pair: a row ends at its micro-batch's longest pair rounded up to
    8 (``data.args.pad_to``'s default), so this is the mean width of its own collate over ``draws``
    micro-batches of ``micro`` pairs drawn at random (seed 0), as the shuffled sampler draws them."""
    import random

    from paratrain.data.tokens import build_tokens

    pairs = build_tokens(path=corpus, block_size=block, pad_to=8)
    pick = random.Random(0)
    widths = [
        pairs.collate([pairs[i] for i in pick.sample(range(len(pairs)), micro)])[0].shape[-1] for _ in range(draws)
    ]
    return sum(widths) / len(widths)


def train_paratrain(out: str, sets: list[str], env: dict, *, procs: int, steps: int, lr: float) -> list[dict]:
    """``paratrain train --nproc-per-node procs`` of ``steps`` AdamW steps (``optim_sets(lr)``)
    into ``out``, every other key from ``sets`` (an empty config beside ``out``): its metrics rows."""
    sets = [*sets, f"run.steps={steps}", "run.progress=false", "run.save_model=false", "metrics.plot=false"]
    sets += [*optim_sets(lr), f"run.out_dir='{out}'"]
    config = os.path.join(os.path.dirname(out), "empty.toml")  # every key comes from --set
    open(config, "w").close()
    cmd = [sys.executable, "-m", "paratrain", "train", config, "--nproc-per-node", str(procs)]
    run(cmd + [arg for item in sets for arg in ("--set", item)], env)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_paratrain_rows(rows: list[dict], *, steps: int, procs: int, batch: int, micro: int, items: bool = False):
    """paratrain's metrics rows must show ``steps`` steps of the asked world, global batch,
    micro-batch and accumulation (and ``batch`` items a step where ``items``); else the run is void."""
    want = (procs, batch, micro, batch // (procs * micro))
    keys = ("world_size", "global_batch_size", "micro_batch_size", "accum_steps")
    bad = [r for r in rows if tuple(r[k] for k in keys) != want or (items and r["items"] != batch)]
    if len(rows) != steps or bad:
        raise SystemExit(f"paratrain logged {len(rows)} steps, not {steps}, or other world/batch: {bad[:1]}")


def launch_trl(script: str, argv: list[str], env: dict, *, procs: int, result: str) -> dict:
    """``script --worker argv`` under torchrun on ``procs`` processes: the JSON its rank 0 wrote to ``result``."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]
    run([*launch, script, "--worker", *argv, "--result", result], env)
    with open(result) as f:
        return json.load(f)


def check_trl_gloo(trainer, *, procs: int, micro: int, accum: int) -> int:
    """In a TRL worker on CPU: TRL's world (``procs`` on gloo), micro-batch and accumulation must
    be the ones asked for; else the run is void. The world size."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    a = trainer.args
    if world != procs or dist.get_backend() != "gloo" or a.world_size != procs:
        raise SystemExit(f"TRL joined a world of {world} ({a.world_size}), not {procs} on gloo: void")
    if a.per_device_train_batch_size != micro or a.gradient_accumulation_steps != accum:
        raise SystemExit(
            f"TRL runs micro {a.per_device_train_batch_size} x accum {a.gradient_accumulation_steps}: void"
        )
    return world


def check_trl_steps(trainer, timer, *, steps: int, micro: int, accum: int, world: int) -> tuple[list, list]:
    """After ``trainer.train()``: every rank ran ``steps`` logged steps of ``accum`` micro-batches
    of ``micro`` rows (``timer.steps``, counted at compute_loss); else the run is void. Every
    rank's counts and the logged steps."""
    everyone = gather(timer.steps)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if len(logs) != steps or any(len(s) != steps for s in everyone):
        raise SystemExit(f"TRL ran {len(logs)} logged steps, {[len(s) for s in everyone]} per rank, not {steps}")
    for i, per_rank in enumerate(zip(*everyone)):
        if any(rank != [micro] * accum for rank in per_rank) or sum(map(sum, per_rank)) != micro * accum * world:
            raise SystemExit(f"TRL step {i + 1}: micro-batches per rank {per_rank}, not {accum} x {micro}")
    return everyone, logs


def paired_rounds(args, paths: dict, tmp: str, env: dict, *, run_paratrain, run_trl, corpus: str, rows: str):
    """Each round's number and ``{tool: result}``: paratrain (on ``paths[corpus]``) and TRL (on
    ``paths[rows]``) alternating, the order swapped every round, ``args.rounds`` rounds."""
    for r in range(args.rounds):
        order = ("paratrain", "trl") if r % 2 == 0 else ("trl", "paratrain")
        got = {}
        for tool in order:
            out = os.path.join(tmp, f"{tool}{r}")
            if tool == "paratrain":
                got[tool] = run_paratrain(paths, paths[corpus], out, args.batch, args.micro, args.steps, args, env)
            else:
                got[tool] = run_trl(paths, paths[rows], out, args.batch, args.micro, args.steps, args, env)
        yield r, got


def rounds_and_check(args, paths: dict, tmp: str, env: dict, *, run_paratrain, run_trl, correctness) -> dict:
    """The paired rounds (paratrain and TRL alternating, the order swapped every round), their
    summary, and the first-step loss check: what main() of this script and vs_trl_reward.py share."""
    ratios, ours, theirs, inner, loads = [], [], [], [], []
    timing = {"corpus": "corpus_pairs_timing", "rows": "pairs_timing"}
    for r, got in paired_rounds(args, paths, tmp, env, run_paratrain=run_paratrain, run_trl=run_trl, **timing):
        a, b = got["paratrain"]["step_s"], got["trl"]["step_s"]
        ours.append(a)
        theirs.append(b)
        inner.append(got["trl"]["inner_s"])
        ratios.append(a / b)
        loads.append(os.getloadavg()[0])
        print(
            f"round {r}: paratrain {a * 1e3:.1f} ms/step, TRL {b * 1e3:.1f} ms/step"
            f" (begin->end {inner[-1] * 1e3:.1f}), ratio {ratios[-1]:.3f}, load {loads[-1]:.1f}",
            flush=True,
        )
    mine, other = statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3
    print(f"median step: paratrain {mine:.1f} ms, TRL {other:.1f} ms")
    print(f"paired ratios: {', '.join(f'{x:.3f}' for x in ratios)} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    print(summary_line("ratio paratrain/TRL", ratios))
    work = {t: {k: got[t][k] for k in ("positions_per_pair", "tokens_per_pair")} for t in ("paratrain", "trl")}
    print(
        "positions the forward passes compute per pair (real tokens, prompt twice):"
        f" paratrain {work['paratrain']['positions_per_pair']:.0f} ({work['paratrain']['tokens_per_pair']:.0f}),"
        f" TRL {work['trl']['positions_per_pair']:.0f} ({work['trl']['tokens_per_pair']:.0f})"
    )
    # Real (unpadded) tokens trained on per second: one count for both tools (TRL's attention
    # mask over the same pairs; paratrain's `tokens` column counts otherwise), over the median step.
    for t, step_s in (("paratrain", mine), ("trl", other)):
        work[t]["tokens_per_s"] = args.batch * work["trl"]["tokens_per_pair"] / (step_s / 1e3)
    print(
        f"real tokens/s (median step): paratrain {work['paratrain']['tokens_per_s']:.0f},"
        f" TRL {work['trl']['tokens_per_s']:.0f}"
    )
    check = None if args.skip_check else correctness(paths, tmp, args, env)
    return {
        "ratios": ratios,
        "ours": ours,
        "theirs": theirs,
        "inner": inner,
        "loads": loads,
        "work": work,
        "check": check,
    }


def write_result(result_path: str, args, paths: dict, setup: str, got: dict) -> None:
    """The rounds' results (``rounds_and_check``) as JSON next to the script."""
    ratios, ours, theirs, inner, loads, work, check = (
        got[k] for k in ("ratios", "ours", "theirs", "inner", "loads", "work", "check")
    )
    gmean, lo, hi = ratio_ci(ratios)
    import torch
    import transformers
    import trl

    result = {
        "command": " ".join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), REPO), *sys.argv[1:]]),
        "setup": setup,
        "args": {k: v for k, v in vars(args).items() if v is not None and k not in ("worker", "quick")},
        "block_size": paths["block"],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "paratrain_step_s": ours,
        "trl_step_s": theirs,
        "trl_begin_to_end_s": inner,
        "load_average": loads,
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
        "ratio_geometric_mean": gmean,
        "ratio_ci95": [lo, hi],
        "positions_per_pair": work,
        "check": check,
    }
    with open(result_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {os.path.relpath(result_path, REPO)}")


def write_trl_result(path: str, *, setup: dict, got: dict, **extra) -> None:
    """A TRL comparison's result file: the command, setup, versions, the runs and the paired
    ratio's geometric mean and 95% CI (benchmarks/peers/vs_trl_*.py)."""
    import torch  # the peers' packages: imported when a result is written, not by the launcher
    import transformers
    import trl

    gmean, lo, hi = ratio_ci(got["ratio"])
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__}
    command = " ".join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), REPO), *sys.argv[1:]])
    with open(path, "w") as f:
        json.dump(
            {
                "command": command,
                "setup": setup,
                "versions": versions,
                **got,
                **extra,
                "ratio_geometric_mean": gmean,
                "ratio_ci95": [lo, hi],
            },
            f,
            indent=1,
        )
    print(f"wrote {os.path.relpath(path, REPO)}")
