"""Start-up: time to the first optimiser step of paratrain's SFT against TRL's ``SFTTrainer``, the
same tiny Qwen2 on the same conversations, one process each on CPU.

Measured with ``--rounds 6`` (TRL 1.16.0, transformers 5.25, torch 2.13 CPU; 128 conversations
packed into 38 rows of 512 by both tools, Qwen2 hidden 64 x 2 layers, a first step of 4 rows; this
2-core machine beside a test run, load average 2.0 to 4.3), seconds from the command to the end of
the first optimiser step, medians: paratrain ``train`` 9.36 (``prepare`` 1.49 more), TRL 16.13, TRL
under ``torchrun`` 12.43. Paired ratio paratrain/TRL: ``train`` median 0.673 (geometric mean 0.649,
95% CI [0.508, 0.829]), ``prepare + train`` 0.776 ([0.585, 1.031]); against TRL under ``torchrun``
0.829 ([0.642, 1.017]). A job of one process trains in the launcher's own process
(launch/agent.py ``run_here``): torch, transformers and the trainer are imported once. Before,
with a launcher and a worker process: 1.200 ([0.967, 1.378], 8 rounds at load 6.1 to 9.2).
See docs/sft.md (Start-up against TRL).

Data and model (``src/paratrain/testing/sft_data.py``, as ``vs_trl.py``): ``--conversations`` chat rows about
standard-library modules, the byte-level ChatML tokenizer with ``{% generation %}`` marks, and one
random Qwen2 (``src/paratrain/testing/hf_models.py: ARCHS['qwen2']``, hidden ``--hidden``, 4x in the MLP,
``--layers`` layers, seed 0) saved once with ``save_pretrained`` (one safetensors file) and
loaded by both tools from that directory. Nothing is downloaded (``HF_HUB_OFFLINE=1``).

- paratrain, as a user runs it: ``python -m paratrain prepare chat.jsonl --format chat`` (timed
  on its own, into a fresh folder each round), then ``python -m paratrain train empty.toml
  --nproc-per-node 1 --set ...`` (``model.hf``, ``data.name = 'tokens'`` with ``block_size``
  512, packing ``documents``, global batch ``--batch`` rows, micro-batch ``--batch``, AdamW,
  float32). The first step's end is the ``time`` of the first row of ``metrics.jsonl``; the
  worker's ``events.jsonl`` (``worker_start``, ``train_called``, ``process_group_ready``,
  ``checkpoint_loaded``, ``first_step_done``) splits it.
- TRL 1.16: this script with ``--worker`` in a fresh ``python`` (one process, no torchrun):
  ``SFTTrainer`` + ``SFTConfig(assistant_only_loss=True, packing=True, packing_strategy='bfd',
  padding_free=True, max_length=512, per_device_train_batch_size=--batch, use_cpu=True,
  optim='adamw_torch', bf16=False)`` on the jsonl rows (its tokenization and packing run inside
  the trainer's constructor, so they count). A ``TrainerCallback.on_step_end`` writes the first
  step's ``time.time()``; the worker also stamps its imports, the model's and tokenizer's loads
  and the trainer's construction.

Each tool's figure is wall-clock from just before the parent launches the command (a fresh
interpreter) to the end of the first optimiser step; the total wall (to the process's exit, after
``--steps`` steps) is printed too. Both must train ``--batch`` packed rows in the first step
(paratrain: the metrics row's ``global_batch_size`` and ``world_size`` 1; TRL: the rows its
collator made for the micro-batches its ``compute_loss`` saw before the first ``on_step_end``, and ``world_size`` 1), or the run is void.
Rounds alternate the order (paratrain, TRL, TRL, paratrain, ...); the paired ratio paratrain/TRL
of each round is the observation, summarised by ``paired.summary_line``: the median ratio and the
95% CI of the geometric mean (below 1: paratrain starts faster). Two ratios: ``train`` (the
corpus already prepared: what every run after the first pays) and ``prepare + train`` (from the
same jsonl as TRL). The results go to ``startup_vs_trl.json`` next to this script.

    python benchmarks/peers/startup_vs_trl.py            # 5 paired rounds (--rounds 8 was measured)
    python benchmarks/peers/startup_vs_trl.py --quick    # 1 round, no JSON

Needs ``pip install trl`` (1.16 was measured) in the same environment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from paratrain.testing.paired import ratio_ci, summary_line
from paratrain.testing.peers import BLOCK, optim_sets, peer_env, run, script_parser, trl_optim_kwargs, trl_run_kwargs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup_vs_trl.json")


# ----------------------------------------------------------------------------- TRL worker


def trl_worker(args) -> None:
    """The TRL run, one process: stamps its milestones into ``args.result``."""
    stamps = {"worker_start": time.time()}
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    stamps["imported"] = time.time()
    torch.set_num_threads(1)
    with open(args.chat) as f:
        rows = [json.loads(line) for line in f]
    tok = AutoTokenizer.from_pretrained(args.tok)
    stamps["tokenizer_loaded"] = time.time()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, attn_implementation="sdpa", dtype=torch.float32)
    stamps["model_loaded"] = time.time()
    collated, trained = [], []  # rows per collated micro-batch (the loader runs one ahead), per loss

    class Counted(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            trained.append(collated.pop(0))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class First(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            stamps.setdefault("first_step_begin", time.time())

        def on_step_end(self, args, state, control, **kwargs):
            if "first_step_done" not in stamps:
                stamps["first_step_done"] = time.time()
                stamps["first_step_rows"] = sum(trained)

    config = SFTConfig(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        **trl_optim_kwargs(1e-3),
        use_cpu=True,
        bf16=False,  # TRL's default is bf16 mixed precision; paratrain runs float32 here
        assistant_only_loss=True,
        packing=True,
        packing_strategy="bfd",
        padding_free=True,
        max_length=BLOCK,
        **trl_run_kwargs(),
    )
    trainer = Counted(
        model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[First()]
    )
    inner = trainer.data_collator

    def collate(examples):
        collated.append(len(examples))
        return inner(examples)

    trainer.data_collator = collate
    stamps["trainer_built"] = time.time()
    if trainer.args.world_size != 1 or trainer.args.gradient_accumulation_steps != 1:
        raise SystemExit(f"TRL runs at world {trainer.args.world_size}: void")
    trainer.train()
    stamps["rows"] = len(trainer.train_dataset)
    with open(args.result, "w") as f:
        json.dump(stamps, f)


# ----------------------------------------------------------------------------- the two tools


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    t0 = time.time()
    run(cmd, env)
    return t0, time.time()


def run_prepare(paths: dict, out: str, env: dict) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "paratrain", "prepare", paths["chat"], "--format", "chat"]
    t0, t1 = timed(cmd + ["--tokenizer", paths["tok"], "--out", out, "--val-fraction", "0"], env)
    return t1 - t0, out


def run_paratrain(paths: dict, corpus: str, out: str, args, env: dict) -> dict:
    sets = [
        f"model.hf='{paths['model']}'",
        "data.name='tokens'",
        f"data.args={{path = '{corpus}', block_size = {BLOCK}}}",
        f"batch.global_batch_size={args.batch}",
        f"batch.micro_batch_size={args.batch}",
        f"run.steps={args.steps}",
        "run.progress=false",
        "run.save_model=false",
        "metrics.plot=false",
        *optim_sets(1e-3),
        f"run.out_dir='{out}'",
    ]
    config = os.path.join(os.path.dirname(out), "empty.toml")  # every key comes from --set
    open(config, "w").close()
    cmd = [sys.executable, "-m", "paratrain", "train", config, "--nproc-per-node", "1"]
    t0, t1 = timed(cmd + [arg for item in sets for arg in ("--set", item)], env)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    first = rows[0]
    claimed = (first["step"], first["world_size"], first["global_batch_size"], len(rows))
    if claimed != (1, 1, args.batch, args.steps):
        raise SystemExit(f"paratrain's first row {first}, {len(rows)} rows: not step 1 at world 1 of {args.batch}")
    with open(os.path.join(out, "events.jsonl")) as f:
        events = {e["event"]: e["time"] for e in map(json.loads, f)}
    return {
        "launched": t0,
        "first_step_s": first["time"] - t0,
        "total_s": t1 - t0,
        "first_step_rows": first["global_batch_size"],
        "first_step_time_s": first["step_time_s"],
        "events": {k: v - t0 for k, v in events.items()},
    }


def run_trl(paths: dict, out: str, args, env: dict, *, torchrun: bool = False) -> dict:
    """TRL's worker in a fresh ``python`` (``torchrun``: under ``torchrun --standalone --nproc-per-node 1``,
    a launcher process like paratrain's, the worker then in a process group of one)."""
    os.makedirs(out, exist_ok=True)
    result = os.path.join(out, "trl.json")
    argv = [__file__, "--worker", "--model-dir", paths["model"], "--tok", paths["tok"], "--chat", paths["chat"]]
    argv += ["--out", out, "--result", result, "--steps", str(args.steps), "--batch", str(args.batch)]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"] if torchrun else []
    t0, t1 = timed([sys.executable, *launcher, *argv], env)
    with open(result) as f:
        stamps = json.load(f)
    if stamps["first_step_rows"] != args.batch:
        raise SystemExit(f"TRL's first step trained {stamps['first_step_rows']} rows, not {args.batch}: void")
    return {
        "launched": t0,
        "first_step_s": stamps["first_step_done"] - t0,
        "total_s": t1 - t0,
        "first_step_rows": stamps["first_step_rows"],
        "first_step_time_s": stamps["first_step_done"] - stamps["first_step_begin"],
        "packed_rows": stamps["rows"],
        "events": {k: v - t0 for k, v in stamps.items() if k not in ("first_step_rows", "rows")},
    }


# ----------------------------------------------------------------------------- data


def build(tmp: str, args) -> dict:
    """The chat tokenizer, the conversations and the tiny Qwen2 (one weights file)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    from paratrain.testing.hf_models import ARCHS
    from paratrain.testing.sft_data import VOCAB, save_chat_tokenizer, stdlib_conversations, write_jsonl

    logging.disable_progress_bar()
    paths = {"tok": save_chat_tokenizer(os.path.join(tmp, "tok")), "model": os.path.join(tmp, "qwen2")}
    shape = {**ARCHS["qwen2"], "vocab_size": VOCAB, "max_position_embeddings": BLOCK}
    shape |= {"hidden_size": args.hidden, "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(shape.pop("model_type"), **shape)).save_pretrained(
        paths["model"]
    )
    paths["chat"] = write_jsonl(os.path.join(tmp, "chat.jsonl"), stdlib_conversations(args.conversations))
    return paths


# What paratrain's launcher does before it trains, and what the worker adds, each timed in a fresh
# interpreter (time.perf_counter around each import or call, in this order). A job of one process
# pays each once: the worker runs in the launcher's process (launch/agent.py run_here).
PHASES = """
import json, sys, time
t = [time.perf_counter()]
def mark():
    t.append(time.perf_counter())
import torch; mark()
import torch.distributed.run; mark()
import paratrain.cli, paratrain.launch.agent; mark()
import paratrain.preflight; mark()
import transformers, transformers.models.auto.configuration_auto; mark()
from paratrain.config import load_config
from paratrain.preflight import check_run
cfg = load_config(sys.argv[1], sys.argv[2:])
check_run(cfg, 1); mark()
import paratrain.launch.worker; mark()
import transformers.models.qwen2.modeling_qwen2; mark()
print(json.dumps([b - a for a, b in zip(t, t[1:])]))
"""
PHASE_NAMES = (
    "import torch",
    "import torch.distributed.run (torchrun's launcher: a job of several processes)",
    "import paratrain's launcher (cli, agent, rendezvous backend: no parallelism's modules)",
    "import paratrain.preflight (its checks, the models' and data's modules: no DCP, FSDP2, DTensor, dynamo)",
    "import transformers (its lazy module table)",
    "check_run (preflight: the model's config.json by AutoConfig, the corpus)",
    "import the worker (trainer, checkpointer: DCP, DTensor, FSDP2, dynamo, pipelining, after the preflight)",
    "import transformers' Qwen2 modeling",
)


def phases(paths: dict, corpus: str, env: dict, repeats: int = 3) -> list[float]:
    """Median seconds of each of PHASE_NAMES over ``repeats`` fresh interpreters."""
    import subprocess

    sets = [
        f"model.hf='{paths['model']}'",
        "data.name='tokens'",
        f"data.args={{path = '{corpus}', block_size = {BLOCK}}}",
    ]
    config = os.path.join(os.path.dirname(corpus), "empty.toml")
    open(config, "w").close()
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", PHASES, config, *sets], env=env, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"the phase timing failed:\n{out.stderr[-2000:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return [statistics.median(col) for col in zip(*runs)]


def breakdown(name: str, runs: list[dict]) -> None:
    """Median seconds from launch to each milestone, and between consecutive ones."""
    keys = sorted(runs[0]["events"], key=lambda k: statistics.median(r["events"][k] for r in runs))
    print(f"{name}: median seconds from launch (and since the previous milestone)")
    prev = 0.0
    for k in keys:
        t = statistics.median(r["events"][k] for r in runs)
        print(f"  {k:<22} {t:6.2f}  (+{t - prev:.2f})")
        prev = t


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--rounds", type=int, default=5, help="paired rounds (each tool once per round)")
    p.add_argument("--steps", type=int, default=3, help="optimiser steps per run (the first is timed)")
    p.add_argument("--batch", type=int, default=4, help="global batch = micro-batch, packed rows of 512")
    p.add_argument("--conversations", type=int, default=128, help="chat rows (src/paratrain/testing/sft_data.py)")
    p.add_argument("--hidden", type=int, default=64, help="the Qwen2's hidden size (4x in the MLP)")
    p.add_argument("--layers", type=int, default=2, help="the Qwen2's decoder layers")
    p.add_argument("--quick", action="store_true", help="1 round, no JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--model-dir", "--tok", "--chat", "--out", "--result"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return trl_worker(args)
    if args.quick:
        args.rounds = 1
    env = peer_env()
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(tmp, args)
        setup = (
            f"{args.conversations} conversations, Qwen2 hidden {args.hidden} x {args.layers} layers, first step of"
            f" {args.batch} packed rows of {BLOCK} (micro-batch {args.batch}, no accumulation), 1 process each,"
            f" {args.steps} steps per run"
        )
        print(setup, flush=True)
        ours, prep, theirs, theirs_torchrun, loads = [], [], [], [], []
        for r in range(args.rounds):
            order = ("paratrain", "trl", "trl_torchrun")
            for tool in order if r % 2 == 0 else order[::-1]:
                if tool == "paratrain":
                    prep_s, corpus = run_prepare(paths, os.path.join(tmp, f"corpus{r}"), env)
                    prep.append(prep_s)
                    ours.append(run_paratrain(paths, corpus, os.path.join(tmp, f"paratrain{r}"), args, env))
                elif tool == "trl":
                    theirs.append(run_trl(paths, os.path.join(tmp, f"trl{r}"), args, env))
                else:
                    got = run_trl(paths, os.path.join(tmp, f"trl_torchrun{r}"), args, env, torchrun=True)
                    theirs_torchrun.append(got)
            loads.append(os.getloadavg()[0])
            if r == 0:
                split = phases(paths, corpus, env, repeats=1 if args.quick else 3)
            a, b, c = ours[-1], theirs[-1], theirs_torchrun[-1]
            print(
                f"round {r}: to the first step paratrain {a['first_step_s']:.2f} s (prepare {prep[-1]:.2f} s),"
                f" TRL {b['first_step_s']:.2f} s (under torchrun {c['first_step_s']:.2f} s); total paratrain"
                f" {a['total_s']:.2f} s, TRL {b['total_s']:.2f} s ({c['total_s']:.2f} s); load {loads[-1]:.1f}",
                flush=True,
            )
    first_ours = [a["first_step_s"] for a in ours]
    first_both = [a["first_step_s"] + s for a, s in zip(ours, prep)]
    first_theirs = [b["first_step_s"] for b in theirs]
    first_torchrun = [c["first_step_s"] for c in theirs_torchrun]
    med = statistics.median
    print(
        f"median to the first step: paratrain train {med(first_ours):.2f} s, prepare {med(prep):.2f} s,"
        f" prepare + train {med(first_both):.2f} s; TRL {med(first_theirs):.2f} s, under torchrun"
        f" {med(first_torchrun):.2f} s"
    )
    print(
        f"median total wall: paratrain train {med(a['total_s'] for a in ours):.2f} s,"
        f" TRL {med(b['total_s'] for b in theirs):.2f} s; first step itself: paratrain"
        f" {med(a['first_step_time_s'] for a in ours):.3f} s, TRL {med(b['first_step_time_s'] for b in theirs):.3f} s"
    )
    ratios = {
        "train": [a / b for a, b in zip(first_ours, first_theirs)],
        "prepare + train": [a / b for a, b in zip(first_both, first_theirs)],
        "train / TRL under torchrun": [a / c for a, c in zip(first_ours, first_torchrun)],
    }
    for name, rs in ratios.items():
        print(summary_line(f"time to the first step, paratrain {name}" + ("" if "/" in name else " / TRL"), rs))
    breakdown("paratrain train", ours)
    breakdown("TRL", theirs)
    breakdown("TRL under torchrun", theirs_torchrun)
    print("paratrain's start, each piece in a fresh interpreter (median of 3; one process pays each once):")
    for label, sec in zip(PHASE_NAMES, split):
        print(f"  {sec:5.2f} s  {label}")
    if args.quick:
        print("--quick: results not written")
        return
    import torch
    import transformers
    import trl

    result = {
        "command": " ".join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), REPO), *sys.argv[1:]]),
        "setup": setup,
        "args": {k: v for k, v in vars(args).items() if v is not None and k not in ("worker", "quick")},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "load_average": loads,
        "paratrain_prepare_s": prep,
        "paratrain": ours,
        "trl": theirs,
        "trl_torchrun": theirs_torchrun,
        "paratrain_phases_s": dict(zip(PHASE_NAMES, split)),
    }
    for name, rs in ratios.items():
        g, lo, hi = ratio_ci(rs)
        result["ratio " + name] = {"ratios": rs, "median": med(rs), "geometric_mean": g, "ci95": [lo, hi]}
    with open(RESULT, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {os.path.relpath(RESULT, REPO)}")


if __name__ == "__main__":
    main()
