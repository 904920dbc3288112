"""paratrain's GRPO against TRL's ``GRPOTrainer``: the same tiny Qwen2 policy, prompts, group
size and reward, the same global batch, world 2 on CPU (gloo, torchrun).

Data: the conversational prompts ``a+b=`` of ``src/paratrain/testing/rl_data.py: addition_rows``, the ChatML
tokenizer of ``src/paratrain/testing/sft_data.py`` and a random Qwen2 (``src/paratrain/testing/hf_models.py``, hidden
``--hidden`` x ``--layers``). Both tools: ``G = --group`` completions per prompt of at most
``--new`` tokens, temperature 1, no top-k or top-p, the reward ``src/paratrain/testing/rl_data.py: byte_mix``
(TRL's signature, so the same function serves both), advantages scaled by the group's std,
``loss_type = 'grpo'``, no KL (beta 0), one optimiser step per generation (TRL's default
``steps_per_generation`` = the accumulation), global batch ``--batch`` completions = 2 processes
x ``--micro`` x accumulation, AdamW (torch's, lr 1e-5, constant, no warmup, no decay), gradient
clipping at 1.0, float32, SDPA attention:

- paratrain: ``paratrain train --nproc-per-node 2`` with ``loss.name = 'grpo'``,
  ``data.name = 'prompts'`` and ``parallel.dp_replicate = 2``; its sampler keeps transformers'
  KV cache (``rl.kv_cache``, docs/grpo.md).
- TRL 1.16: ``GRPOTrainer`` under ``torchrun --nproc-per-node 2`` (``use_cpu=True``,
  ``ddp_backend='gloo'``, ``bf16=False``, ``use_vllm=False``: transformers' own ``generate``,
  with its KV cache).

The TRL worker checks the world (2, gloo), its batch settings, and counts the completions of
every micro-batch it computes a loss on; paratrain's metrics rows must show world 2, the global
batch, the micro-batch and the accumulation. Any other count voids the run.

Timing: a run's step time is the median difference of consecutive optimiser steps' ends after
the first ``WARMUP`` (paratrain's metrics ``time``; TRL's ``on_step_end``): the whole iteration,
generation included. The generation part is paratrain's logged ``generation_s`` (sampling,
rewards, the recomputation) and TRL's ``_generate_and_score_completions`` (sampling, rewards);
the generation throughput is the completion tokens of a step over that time. Runs alternate
(paratrain, TRL, TRL, paratrain, ...); the paired ratio paratrain/TRL of each round is the
observation, summarised by ``paired.summary_line``: the median ratio and the 95% CI of the
geometric mean (below 1: paratrain is faster). The results go to ``vs_trl_grpo.json``.

    python benchmarks/peers/vs_trl_grpo.py             # 6 rounds of 8 steps
    python benchmarks/peers/vs_trl_grpo.py --quick     # 1 round of 4 steps, no JSON
    python benchmarks/peers/vs_trl_grpo.py --device cuda --procs 1 --bf16 --qwen-05b   # the GPU check

``--device``, ``--procs``, ``--bf16`` and ``--qwen-05b`` are vs_trl_dpo.py's layout options.
paratrain generates a rank's rows of a step in one batch (``rl.generation_batch_size = 0``), as
TRL does.

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

from paratrain.testing.paired import summary_line
from paratrain.testing.peers import (
    WARMUP,
    add_layout_args,
    check_trl_world,
    describe_layout,
    gather,
    paratrain_layout,
    peer_env,
    run,
    save_policy,
    shape_of,
    steady,
    step_timer,
    trl_layout,
    trl_optim_kwargs,
    trl_run_kwargs,
    worker_layout,
    write_trl_result,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vs_trl_grpo.json")


def trl_worker(args) -> None:
    """One rank of the TRL run (started by torchrun)."""
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from paratrain.testing.rl_data import byte_mix

    torch.set_num_threads(1)
    with open(args.prompts_file) as f:
        rows = [json.loads(line) for line in f]

    class Counted(GRPOTrainer):
        """GRPOTrainer that times its generation phase and counts each micro-batch's completions."""

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.gen_s.append(time.perf_counter() - t0)
            self.gen_tokens.append(int(out["completion_mask"].sum()))
            return out

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.micro.append(int(inputs["completion_ids"].shape[0]))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    config = GRPOConfig(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.accum,
        num_generations=args.group,
        max_completion_length=args.new,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="grpo",
        scale_rewards="group",
        **trl_optim_kwargs(1e-5, adam=False),  # betas and eps at both tools' defaults
        ddp_find_unused_parameters=False,
        **trl_layout(args),
        use_vllm=False,
        shuffle_dataset=False,
        **trl_run_kwargs(),
    )
    timer = step_timer()
    trainer = Counted(
        model=AutoModelForCausalLM.from_pretrained(args.policy, attn_implementation="sdpa", dtype=torch.float32),
        reward_funcs=[byte_mix],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(args.tok),
        callbacks=[timer],
    )
    trainer.micro, trainer.gen_s, trainer.gen_tokens = [], [], []
    timer.trainer = trainer
    world = check_trl_world(trainer, args)
    trainer.train()
    everyone = gather((timer.steps, trainer.gen_s, trainer.gen_tokens))
    for i, per_rank in enumerate(zip(*(e[0] for e in everyone))):
        if any(rank != [args.micro] * args.accum for rank in per_rank):
            raise SystemExit(f"TRL step {i + 1}: micro-batches {per_rank}, not {args.accum} x {args.micro}: void")
    if len(timer.steps) != args.steps:
        raise SystemExit(f"TRL ran {len(timer.steps)} steps, not {args.steps}: void")
    if not dist.is_initialized() or dist.get_rank() == 0:
        gen = [max(per_rank) for per_rank in zip(*(e[1] for e in everyone))]  # the slowest rank's
        tokens = [sum(per_rank) for per_rank in zip(*(e[2] for e in everyone))]
        with open(args.result, "w") as f:
            json.dump(
                {
                    "step_s": steady(timer.end),
                    "generation_s": statistics.median(gen[WARMUP:]),
                    "completion_tokens": statistics.median(tokens[WARMUP:]),
                    "completions_per_step": sum(sum(mb) for e in everyone for mb in e[0]) // args.steps,
                    "world": world,
                },
                f,
            )


def run_paratrain(paths: dict, out: str, args, env) -> dict:
    sets = [
        f"model.hf='{paths['policy']}'",
        "data.name='prompts'",
        f"data.args={{path = '{paths['prompts']}', tokenizer = '{paths['tok']}', max_prompt_length = 64}}",
        "data.shuffle=false",
        "loss.name='grpo'",
        f"rl.group_size={args.group}",
        f"rl.max_new_tokens={args.new}",
        "rl.rewards=['paratrain.testing.rl_data:byte_mix']",
        *paratrain_layout(args),
        f"batch.global_batch_size={args.batch}",
        f"batch.micro_batch_size={args.micro}",
        f"run.steps={args.steps}",
        "run.progress=false",
        "run.save_model=false",
        "metrics.plot=false",
        "optim.lr=1e-5",
        "optim.weight_decay=0",
        "optim.grad_clip=1.0",
        "optim.warmup_steps=0",
        "optim.schedule='constant'",
        f"run.out_dir='{out}'",
    ]
    config = os.path.join(os.path.dirname(out), "empty.toml")
    open(config, "w").close()
    cmd = [sys.executable, "-m", "paratrain", "train", config, "--nproc-per-node", str(args.procs)]
    run(cmd + [arg for item in sets for arg in ("--set", item)], env)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    accum = args.batch // (args.procs * args.micro)
    want = (args.procs, args.batch, args.micro, accum, args.batch)
    bad = [
        r
        for r in rows
        if (r["world_size"], r["global_batch_size"], r["micro_batch_size"], r["accum_steps"], r["items"]) != want
    ]
    if len(rows) != args.steps or bad:
        raise SystemExit(f"paratrain logged {len(rows)} steps, not {args.steps}, or another world/batch: {bad[:1]}")
    return {
        "step_s": steady([r["time"] for r in rows]),
        "generation_s": statistics.median(r["generation_s"] for r in rows[WARMUP:]),
        "completion_tokens": statistics.median(r["completion_length"] * args.batch for r in rows[WARMUP:]),
        "completions_per_step": rows[0]["items"],
    }


def run_trl(paths: dict, out: str, args, env) -> dict:
    os.makedirs(out, exist_ok=True)
    result = os.path.join(out, "trl.json")
    argv = [
        __file__,
        "--worker",
        "--policy",
        paths["policy"],
        "--tok",
        paths["tok"],
        "--prompts-file",
        paths["prompts"],
    ]
    argv += ["--out", out, "--result", result, "--steps", str(args.steps), "--micro", str(args.micro)]
    argv += ["--accum", str(args.batch // (args.procs * args.micro)), "--group", str(args.group)]
    argv += ["--new", str(args.new), *worker_layout(args)]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.procs)]
    run(launch + argv, env)
    with open(result) as f:
        got = json.load(f)
    if got["world"] != args.procs or got["completions_per_step"] != args.batch:
        raise SystemExit(f"TRL ran at world {got['world']} with {got['completions_per_step']} completions a step: void")
    return got


def build(tmp: str, args) -> dict:
    from paratrain.testing.rl_data import addition_rows
    from paratrain.testing.sft_data import VOCAB, save_chat_tokenizer, write_jsonl

    prompts = args.steps * args.batch // args.group
    return {
        "tok": save_chat_tokenizer(os.path.join(tmp, "tok")),
        "policy": save_policy(os.path.join(tmp, "policy"), args, seed=0, vocab=VOCAB, max_positions=512),
        "prompts": write_jsonl(os.path.join(tmp, "prompts.jsonl"), addition_rows(prompts, conversational=True)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="paired rounds (paratrain and TRL once each)")
    p.add_argument("--steps", type=int, default=8, help=f"optimiser steps per run; the first {WARMUP} are warm-up")
    add_layout_args(p, micro=8, batch=32)  # --batch in completions, --micro completions per micro-batch per process
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--new", type=int, default=16, help="most new tokens per completion")
    p.add_argument("--hidden", type=int, default=128, help="the Qwen2's hidden size (4x in the MLP)")
    p.add_argument("--layers", type=int, default=2, help="the Qwen2's decoder layers")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round of 4 steps, no JSON")
    p.add_argument("--result-file", default=RESULT, help="where the JSON goes (default next to this script)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--policy", "--tok", "--prompts-file", "--out", "--result"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--accum", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return trl_worker(args)
    if args.quick:
        args.rounds, args.steps = 1, WARMUP + 2
    if args.batch % (args.procs * args.micro) or (args.procs * args.micro) % args.group:
        raise SystemExit("--batch must be a multiple of --procs x --micro, itself a multiple of --group")
    env = peer_env(inherit_pythonpath=True, hub_kernels_off=True)
    accum = args.batch // (args.procs * args.micro)
    setup = (
        f"{shape_of(args)}, G {args.group}, at most {args.new} new tokens;"
        f" global batch {args.batch} completions = {args.procs} x micro {args.micro} x accumulation {accum};"
        f" {describe_layout(args)}"
    )
    print(setup, flush=True)
    got: dict[str, list] = {
        k: [] for k in ("ratio", "ours", "theirs", "gen_ours", "gen_theirs", "tok_ours", "tok_theirs", "load")
    }
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(tmp, args)
        for r in range(args.rounds):
            res = {}
            for tool in ("paratrain", "trl") if r % 2 == 0 else ("trl", "paratrain"):
                out = os.path.join(tmp, f"{tool}{r}")
                res[tool] = (run_paratrain if tool == "paratrain" else run_trl)(paths, out, args, env)
            a, b = res["paratrain"], res["trl"]
            got["ratio"].append(a["step_s"] / b["step_s"])
            got["ours"].append(a["step_s"])
            got["theirs"].append(b["step_s"])
            got["gen_ours"].append(a["generation_s"])
            got["gen_theirs"].append(b["generation_s"])
            got["tok_ours"].append(a["completion_tokens"] / a["generation_s"])
            got["tok_theirs"].append(b["completion_tokens"] / b["generation_s"])
            got["load"].append(os.getloadavg()[0])
            print(
                f"round {r}: step paratrain {a['step_s'] * 1e3:.0f} ms (generation {a['generation_s'] * 1e3:.0f}),"
                f" TRL {b['step_s'] * 1e3:.0f} ms (generation {b['generation_s'] * 1e3:.0f}); ratio {got['ratio'][-1]:.3f};"
                f" generation tokens/s paratrain {got['tok_ours'][-1]:.0f}, TRL {got['tok_theirs'][-1]:.0f}; load {got['load'][-1]:.1f}",
                flush=True,
            )
    med = {k: statistics.median(v) for k, v in got.items()}
    train_ours, train_theirs = med["ours"] - med["gen_ours"], med["theirs"] - med["gen_theirs"]
    print(f"median step: paratrain {med['ours'] * 1e3:.0f} ms, TRL {med['theirs'] * 1e3:.0f} ms")
    print(
        f"median generation: paratrain {med['gen_ours'] * 1e3:.0f} ms, TRL {med['gen_theirs'] * 1e3:.0f} ms;"
        f" the rest of the step: paratrain {train_ours * 1e3:.0f} ms, TRL {train_theirs * 1e3:.0f} ms"
    )
    print(
        f"median generation throughput: paratrain {med['tok_ours']:.0f}, TRL (transformers' generate) {med['tok_theirs']:.0f} completion tokens/s"
    )
    print(summary_line("step ratio paratrain/TRL", got["ratio"]))
    gen_ratios = [x / y for x, y in zip(got["gen_ours"], got["gen_theirs"])]
    print(summary_line("generation ratio paratrain/TRL", gen_ratios))
    if args.quick:
        return
    write_trl_result(args.result_file, setup=setup, got=got, medians=med, generation_ratios=gen_ratios)


if __name__ == "__main__":
    main()
