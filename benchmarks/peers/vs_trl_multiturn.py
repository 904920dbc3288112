"""paratrain's multi-turn GRPO (``rl.tools``) against TRL's ``GRPOTrainer(tools=...)`` on the
calculator recipe of docs/multi-turn.md, world 2 on CPU (gloo, torchrun): the step-time ratio,
and whether each tool's per-step loss moves with the micro-batch.

The task: the recipe's tiny Llama after SFT (``--policy``, or this script runs the recipe's SFT,
320 steps), the prompts ``a*b`` of ``configs/rl/calculator.jsonl`` in file order, the tool
``configs/rl/calculator.py:multiply`` and its two rewards (TRL's signature: the same functions
serve both). Both tools: ``G = --group`` episodes per prompt, at most two assistant turns (the
call, then the answer: paratrain's ``rl.max_turns = 2``, TRL's ``max_tool_calling_iterations =
1``), at most ``--new`` tokens per turn and per episode after the prompt (paratrain's
``rl.max_new_tokens`` and ``rl.max_episode_tokens``, TRL's ``max_completion_length``, which
bounds both), temperature 1, no top-k or top-p, ``loss_type = 'dapo'`` (TRL's default: token sum
over the global batch's model tokens), no KL, one optimiser step per generation, the global batch
``--batch`` episodes = 2 processes x ``--micro`` x accumulation, plain SGD (no momentum, decay or
clipping; TRL's clip is set to 1e9 so that it logs ``grad_norm``), lr ``--lr``, float32.

TRL 1.16 parses tool calls with a response template chosen by the chat template's text; the
recipe's template is not one it knows, so its tokenizer gets TRL's own Qwen3 template
(``trl.chat_template_utils.qwen3_template``: the Hermes ``<tool_call>{json}</tool_call>`` that
the recipe's model writes and paratrain parses). TRL also refuses a template that does not render
an assistant's ``tool_calls`` field, which the recipe's does not (its calls are in the text): the
worker's copy of the template renders that field in the same Hermes form. TRL trains on the
sampled tokens, never on that rendering, and appends each tool result as the tokens the template
adds after a dummy tool-call turn, which for this template are paratrain's observation tokens.

Each run is checked or void: the world (2), the micro-batches and accumulation, the episodes per
step, and the tool calls made (paratrain's ``rollouts.jsonl``, TRL's ``_tool_call_loop`` count).
Timing is vs_trl_grpo.py's: the median step after the warm-up (generation included), runs
alternating, the paired ratio paratrain/TRL summarised by its median and 95% CI.

The layouts: after the rounds, each tool runs once more at each of ``--layouts`` (default 2
processes x micro 16 x accumulation 1, and 1 process x micro 16 x accumulation 2: the same global
batch, seed and data), and its per-step losses and ``grad_norm`` are compared with round 0's. The
episodes are compared too (each step's episodes' token ids, sorted), to tell "the episodes
changed" from "the loss's normalisation changed". A run in which a tool made no tool call is
void. The results go to ``vs_trl_multiturn.json``.

    python benchmarks/peers/vs_trl_multiturn.py                  # 4 rounds of 6 steps, then the layouts
    python benchmarks/peers/vs_trl_multiturn.py --policy runs/calculator_sft/hf
    python benchmarks/peers/vs_trl_multiturn.py --quick          # 1 round of 4 steps, no JSON

Needs ``pip install trl`` (1.16 was measured) in the same environment.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

from paratrain.testing.paired import summary_line
from paratrain.testing.peers import WARMUP, check_trl_world, gather, peer_env, run, steady, step_timer, write_trl_result

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vs_trl_multiturn.json")
CALC = os.path.join(REPO, "configs", "rl", "calculator.py")


def digest(episodes: list) -> str:
    """A step's episodes as one hash, whatever rank or order produced them."""
    return hashlib.sha1(json.dumps(sorted(episodes)).encode()).hexdigest()[:12]


def trl_worker(args) -> None:
    """One rank of the TRL run (started by torchrun)."""
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("calculator", CALC)
    calc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calc)
    with open(args.prompts_file) as f:
        rows = [json.loads(line) for line in f]

    class Counted(GRPOTrainer):
        """GRPOTrainer that counts each micro-batch's episodes, the tool calls and each step's episodes."""

        def _tool_call_loop(self, *a, **kw):
            out = super()._tool_call_loop(*a, **kw)
            self.tool_calls.append(out[4])  # tool_call_count
            return out

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            ids, mask = out["completion_ids"].tolist(), out["completion_mask"].tolist()
            self.episodes.append([[t for t, m in zip(i, k) if m] for i, k in zip(ids, mask)])
            return out

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.micro.append(int(inputs["completion_ids"].shape[0]))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class Logged(TrainerCallback):
        def __init__(self):
            self.rows = []

        def on_log(self, args_, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.rows.append({k: logs.get(k) for k in ("loss", "grad_norm", "reward")})

    tok = AutoTokenizer.from_pretrained(args.policy)
    tok.response_template = qwen3_template  # the Hermes format the model writes (module docstring)
    # TRL refuses a template that does not render an assistant's tool_calls field; render it as the
    # model writes it (the rows TRL trains on are the sampled tokens, never this rendering)
    call = "{%- for call in message['tool_calls'] or [] %}{{ '<tool_call>' + (call['function'] | tojson) + '</tool_call>' }}{%- endfor %}"
    end = "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    if end not in tok.chat_template:
        raise SystemExit(f"{args.policy}'s chat template is not the recipe's (configs/rl/tool_model)")
    tok.chat_template = tok.chat_template.replace(
        end, "{{ message['content'] }}" + call + "{{ '<|im_end|>' }}{% endgeneration %}"
    )
    config = GRPOConfig(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.accum,
        num_generations=args.group,
        max_completion_length=args.new,
        max_tool_calling_iterations=1,  # two assistant turns, as paratrain's rl.max_turns = 2
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        optim="sgd",
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1e9,  # no clipping, but the norm is logged
        gradient_checkpointing=False,
        use_cpu=True,
        ddp_backend="gloo",
        bf16=False,
        ddp_find_unused_parameters=False,
        use_vllm=False,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    timer, logged = step_timer(), Logged()
    trainer = Counted(
        model=AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.float32),
        reward_funcs=[calc.answer_correct, calc.called_the_tool],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        tools=[calc.multiply],
        callbacks=[timer, logged],
    )
    trainer.micro, trainer.tool_calls, trainer.episodes = [], [], []
    timer.trainer = trainer
    args.bf16, args.device = False, "cpu"  # what check_trl_world compares with
    world = check_trl_world(trainer, args)
    trainer.train()
    everyone = gather((timer.steps, trainer.tool_calls, trainer.episodes))
    for i, per_rank in enumerate(zip(*(e[0] for e in everyone))):
        if any(rank != [args.micro] * args.accum for rank in per_rank):
            raise SystemExit(f"TRL step {i + 1}: micro-batches {per_rank}, not {args.accum} x {args.micro}: void")
    if len(timer.steps) != args.steps or len(trainer.episodes) != args.steps:
        raise SystemExit(f"TRL ran {len(timer.steps)} steps ({len(trainer.episodes)} generations): void")
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump(
                {
                    "step_s": steady(timer.end),
                    "episodes_per_step": sum(sum(mb) for e in everyone for mb in e[0]) // args.steps,
                    "tool_calls": [sum(per_rank) for per_rank in zip(*(e[1] for e in everyone))],
                    "episodes": [digest(sum(per_rank, [])) for per_rank in zip(*(e[2] for e in everyone))],
                    "loss": [r["loss"] for r in logged.rows],
                    "grad_norm": [r["grad_norm"] for r in logged.rows],
                    "reward": [r["reward"] for r in logged.rows],
                    "world": world,
                },
                f,
            )


def run_paratrain(paths: dict, out: str, args, layout: tuple[int, int], env) -> dict:
    procs, micro = layout
    sets = [
        f"model.hf='{paths['policy']}'",
        "data.name='prompts'",
        f"data.args={{path = '{paths['prompts']}', max_prompt_length = 32}}",
        "data.shuffle=false",
        "loss.name='grpo'",
        "rl.loss_type='dapo'",
        f"rl.group_size={args.group}",
        f"rl.max_new_tokens={args.new}",
        f"rl.max_episode_tokens={args.new}",
        "rl.max_turns=2",
        f"rl.tools=['{CALC}:multiply']",
        f"rl.rewards=['{CALC}:answer_correct', '{CALC}:called_the_tool']",
        f"parallel.dp_replicate={procs}",
        f"batch.global_batch_size={args.batch}",
        f"batch.micro_batch_size={micro}",
        f"run.steps={args.steps}",
        "run.progress=false",
        "run.save_model=false",
        "metrics.plot=false",
        "optim.name='sgd'",
        "optim.beta1=0",
        f"optim.lr={args.lr}",
        "optim.weight_decay=0",
        "optim.grad_clip=0",
        "optim.warmup_steps=0",
        "optim.schedule='constant'",
        f"run.out_dir='{out}'",
    ]
    config = os.path.join(os.path.dirname(out), "empty.toml")
    open(config, "w").close()
    cmd = [sys.executable, "-m", "paratrain", "train", config, "--nproc-per-node", str(procs)]
    run(cmd + [arg for item in sets for arg in ("--set", item)], env)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(out, "rollouts.jsonl")) as f:
        episodes = [json.loads(line) for line in f]
    accum = args.batch // (procs * micro)
    want = (procs, args.batch, micro, accum)  # items counts model tokens under dapo
    bad = [
        r for r in rows if (r["world_size"], r["global_batch_size"], r["micro_batch_size"], r["accum_steps"]) != want
    ]
    if len(rows) != args.steps or bad or len(episodes) != args.steps * args.batch:
        raise SystemExit(f"paratrain logged {len(rows)} steps, {len(episodes)} episodes, or another batch: {bad[:1]}")
    by_step = [[e for e in episodes if e["step"] == s + 1] for s in range(args.steps)]
    calls = [sum(m["role"] == "tool" for e in step for m in e["messages"]) for step in by_step]
    if not all(calls):
        raise SystemExit(f"paratrain made no tool call at some step ({calls}): not a multi-turn run, void")
    return {
        "step_s": steady([r["time"] for r in rows]),
        "episodes_per_step": len(by_step[0]),
        "tool_calls": calls,
        "episodes": [digest([e["tokens"] for e in step]) for step in by_step],
        "loss": [r["loss"] for r in rows],
        "grad_norm": [r["grad_norm"] for r in rows],
        "reward": [r["reward"] for r in rows],
    }


def run_trl(paths: dict, out: str, args, layout: tuple[int, int], env) -> dict:
    procs, micro = layout
    os.makedirs(out, exist_ok=True)
    result = os.path.join(out, "trl.json")
    argv = [__file__, "--worker", "--policy", paths["policy"], "--prompts-file", paths["prompts"]]
    argv += ["--out", out, "--result", result, "--steps", str(args.steps), "--micro", str(micro)]
    argv += ["--accum", str(args.batch // (procs * micro)), "--group", str(args.group), "--new", str(args.new)]
    argv += ["--lr", str(args.lr), "--procs", str(procs)]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]
    run(launch + argv, {**env, "TRL_EXPERIMENTAL_SILENCE": "1"})
    with open(result) as f:
        got = json.load(f)
    if not all(got["tool_calls"]):
        raise SystemExit(f"TRL made no tool call at some step ({got['tool_calls']}): not a multi-turn run, void")
    if got["world"] != procs or got["episodes_per_step"] != args.batch:
        raise SystemExit(f"TRL ran at world {got['world']} with {got['episodes_per_step']} episodes a step: void")
    return got


def build(tmp: str, args, env) -> dict:
    """The policy (the recipe's SFT unless --policy) and the first prompts of the recipe's data."""
    prompts = os.path.join(tmp, "prompts.jsonl")
    with open(os.path.join(REPO, "configs", "rl", "calculator.jsonl")) as f, open(prompts, "w") as out:
        out.writelines(f.readlines()[: args.steps * args.batch // args.group])
    if args.policy:
        return {"policy": os.path.abspath(args.policy), "prompts": prompts}
    data, sft = os.path.join(tmp, "data"), os.path.join(tmp, "sft")
    tool_model = os.path.join(REPO, "configs", "rl", "tool_model")
    cli = [sys.executable, "-m", "paratrain"]
    run(cli + ["prepare", os.path.join(REPO, "configs", "rl", "calculator_sft.jsonl"), "--format", "chat"]
        + ["--tokenizer", tool_model, "--out", data, "--val-fraction", "0.05"], env)  # fmt: skip
    sets = [f"model.hf='{tool_model}'", f"data.args.path='{data}'", f"run.out_dir='{sft}'", "run.steps=320"]
    sets += ["eval.interval=0", "run.progress=false", "metrics.plot=false"]
    run(cli + ["train", os.path.join(REPO, "configs", "sft.toml")] + [a for s in sets for a in ("--set", s)], env)
    return {"policy": os.path.join(sft, "hf"), "prompts": prompts}


def same(a: list, b: list) -> float:
    """The largest relative difference of two per-step series (the losses can be near 0: not for them)."""
    return max(abs(x - y) / max(abs(x), abs(y), 1e-30) for x, y in zip(a, b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="paired rounds (paratrain and TRL once each)")
    p.add_argument("--steps", type=int, default=6, help=f"optimiser steps per run; the first {WARMUP} are warm-up")
    p.add_argument("--procs", type=int, default=2, help="processes (data-parallel ranks) of each tool")
    p.add_argument("--batch", type=int, default=32, help="global batch in episodes")
    p.add_argument("--micro", type=int, default=8, help="episodes per micro-batch per process in the rounds")
    p.add_argument(
        "--layouts",
        default="2x16,1x16",
        help="the split check's other layouts, PROCSxMICRO, comma-separated ('': none)",
    )
    p.add_argument("--group", type=int, default=8, help="episodes per prompt")
    p.add_argument("--new", type=int, default=128, help="most tokens per turn and per episode (a call is 77)")
    p.add_argument("--lr", type=float, default=0.05, help="plain SGD's learning rate")
    p.add_argument("--policy", help="the SFT'd recipe model (e.g. runs/calculator_sft/hf); default: run the SFT")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round of 4 steps, no split check, no JSON")
    p.add_argument("--result-file", default=RESULT, help="where the JSON goes (default next to this script)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--prompts-file", "--out", "--result"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--accum", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return trl_worker(args)
    if args.quick:
        args.rounds, args.steps, args.layouts = 1, WARMUP + 2, ""
    others = [tuple(int(x) for x in lay.split("x")) for lay in args.layouts.split(",") if lay]
    for n, m in [(args.procs, args.micro), *others]:
        if args.batch % (n * m) or (n * m) % args.group:
            raise SystemExit("--batch must be a multiple of --procs x --micro, itself a multiple of --group")
    env = peer_env(inherit_pythonpath=True, hub_kernels_off=True)
    setup = (
        f"G {args.group}, 2 turns, at most {args.new} tokens; global batch {args.batch} episodes = {args.procs} x"
        f" micro {args.micro} x accumulation {args.batch // (args.procs * args.micro)}; plain SGD lr {args.lr}; CPU fp32"
    )
    print(setup, flush=True)
    got: dict[str, list] = {k: [] for k in ("ratio", "ours", "theirs", "calls_ours", "calls_theirs", "load")}
    split = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        paths = build(tmp, args, env)
        print(f"policy {paths['policy']} ({time.perf_counter() - t0:.0f} s)", flush=True)
        for r in range(args.rounds):
            res = {}
            for tool in ("paratrain", "trl") if r % 2 == 0 else ("trl", "paratrain"):
                fn = run_paratrain if tool == "paratrain" else run_trl
                res[tool] = fn(paths, os.path.join(tmp, f"{tool}{r}"), args, (args.procs, args.micro), env)
            a, b = res["paratrain"], res["trl"]
            if r == 0:
                split = {"paratrain": [a], "trl": [b]}
            got["ratio"].append(a["step_s"] / b["step_s"])
            got["ours"].append(a["step_s"])
            got["theirs"].append(b["step_s"])
            got["calls_ours"].append(sum(a["tool_calls"]))
            got["calls_theirs"].append(sum(b["tool_calls"]))
            got["load"].append(os.getloadavg()[0])
            print(
                f"round {r}: step paratrain {a['step_s'] * 1e3:.0f} ms, TRL {b['step_s'] * 1e3:.0f} ms;"
                f" ratio {got['ratio'][-1]:.3f}; tool calls per step paratrain {a['tool_calls']}, TRL {b['tool_calls']};"
                f" load {got['load'][-1]:.1f}",
                flush=True,
            )
        for n, m in others:
            for tool, fn in (("paratrain", run_paratrain), ("trl", run_trl)):
                split[tool].append(fn(paths, os.path.join(tmp, f"{tool}_{n}x{m}"), args, (n, m), env))
    print(
        f"median step: paratrain {statistics.median(got['ours']) * 1e3:.0f} ms, TRL {statistics.median(got['theirs']) * 1e3:.0f} ms"
    )
    print(summary_line("step ratio paratrain/TRL", got["ratio"]))
    moved = {}
    name = "{} procs x micro {} x accum {}".format
    for tool, (a, *rest) in split.items():
        for (n, m), b in zip(others, rest):
            changed = [s + 1 for s, (x, y) in enumerate(zip(a["episodes"], b["episodes"])) if x != y]
            other = name(n, m, args.batch // (n * m))
            moved.setdefault(tool, {})[other] = {
                "loss": b["loss"],
                "loss_max_abs_diff": max(abs(x - y) for x, y in zip(a["loss"], b["loss"])),
                "grad_norm_max_rel_diff": same(a["grad_norm"], b["grad_norm"]),
                "steps_with_other_episodes": changed,
                "reward": b["reward"],
            }
            print(
                f"{tool}, {name(args.procs, args.micro, args.batch // (args.procs * args.micro))} against {other}:"
                f" loss differs by {moved[tool][other]['loss_max_abs_diff']:.2e} at most (absolute), grad_norm by"
                f" {moved[tool][other]['grad_norm_max_rel_diff']:.2e} (relative); steps whose episodes differ:"
                f" {changed or 'none'}"
            )
            print(f"  losses {[f'{x:.6g}' for x in a['loss']]}\n     vs {[f'{x:.6g}' for x in b['loss']]}")
        moved.setdefault(tool, {})["rounds_layout"] = {
            "loss": a["loss"],
            "grad_norm": a["grad_norm"],
            "reward": a["reward"],
        }
    if args.quick:
        return
    write_trl_result(args.result_file, setup=setup, got=got, layouts=moved)


if __name__ == "__main__":
    main()
