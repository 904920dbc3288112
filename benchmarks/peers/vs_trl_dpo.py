"""paratrain's DPO against TRL's ``DPOTrainer``: the same tiny Qwen2 policy and a differing reference
model, the same preference pairs, the same global batch, world 2 on CPU (gloo, torchrun).

Data: the conversational pairs of ``src/paratrain/testing/sft_data.py: preference_pairs`` (TRL's explicit-prompt
form; a user asks what a standard-library module is for, chosen: its docstring), the ChatML
tokenizer with ``{% generation %}`` spans (``src/paratrain/testing/sft_data.py``), a random Qwen2 policy (seed 0)
and a random Qwen2 reference of the same shape (seed 1, so the loss is not log 2)
(``src/paratrain/testing/hf_models.py``). Both tools: DPO ``sigmoid``, beta 0.1, the reference a separate frozen
model, global batch ``--batch`` pairs (``--micro`` pairs per micro-batch per process,
accumulation filling the rest over 2 processes), AdamW (torch's own, lr ``--lr``, betas (0.9,
0.95), eps 1e-8, no weight decay, no warmup, constant schedule, gradient norm clipped to 1.0),
float32, SDPA attention, no activation checkpointing, no truncation:

- paratrain: ``paratrain prepare --format preference`` then ``paratrain train --nproc-per-node 2``
  with ``model.hf``, ``loss.name = 'preference'``, ``preference.reference = DIR``,
  ``data.name = 'tokens'`` and ``parallel.dp_replicate = 2``. A pair is one packed row
  ``[prompt + chosen | prompt + rejected | padding]`` of ``block_size`` tokens, each side attending
  to itself only; ``block_size`` is the longest pair rounded up to 64.
- TRL 1.16: ``DPOTrainer(model, ref_model, DPOConfig(...))`` under ``torchrun --nproc-per-node 2``
  (``use_cpu=True``, ``ddp_backend='gloo'``, ``bf16=False`` and ``gradient_checkpointing=False``
  against TRL's defaults, ``max_length`` = ``block_size`` per side, so nothing is cut, and
  ``ddp_find_unused_parameters=False``: every parameter has a gradient, so the graph walk
  Trainer's default adds is left out). ``DataCollatorForPreference`` puts a micro-batch's chosen
  and rejected sequences in one batch of ``2 x micro`` rows right-padded to its longest side.

The worker checks ``torch.distributed.get_world_size() == 2`` on gloo, TRL's own
``world_size``, ``per_device_train_batch_size`` and ``gradient_accumulation_steps``, and that every
optimiser step saw ``--accum`` micro-batches of ``--micro`` pairs on each rank, ``--batch`` pairs in
all (counted at ``compute_loss``); paratrain's metrics rows must show world 2, the global batch,
the micro-batch and the accumulation. Any other count voids the run.

Timing: each run's step time is the wall-clock difference of consecutive optimiser steps' ends
(paratrain's metrics rows' ``time``; TRL's ``on_step_end``): the whole loop iteration (data, the
reference's and the policy's forward, backward, all-reduce, optimiser, logging), median over the
steps after the first ``WARMUP``. The pairs are repeated so that one epoch holds every step. Runs
alternate (paratrain, TRL, TRL, paratrain, ...) so drifts in the machine's load hit both; the
paired ratio paratrain/TRL of each round is the observation, summarised by
``paired.summary_line``: the median ratio and the 95% CI of the geometric mean (below 1:
paratrain is faster). The results go to ``vs_trl_dpo.json`` next to this script.

Correctness: each tool runs ONE step whose global batch is every pair (``--pairs``), and its
logged loss is compared with plain ``transformers`` on each pair alone (the prompt and one reply
rendered by the chat template, the reply's log-probability summed over transformers' assistant
mask, the DPO formula written out: ``tests/distributed/test_preference.py: anchor``), and with the same
reference counting TRL's way: TRL's completion is everything the template renders after the
generation prompt (``DPOTrainer._prepare_dataset``), i.e. the assistant span *and* the ``"\\n"``
after ``<|im_end|>``, one token per side more than the assistant mask. paratrain should match the
first, TRL the second.

Measured (TRL 1.16.0, transformers 5.25, torch 2.13 CPU; defaults: 64 pairs, longest 325 tokens,
paratrain block_size 384 with each micro-batch cut to its longest pair rounded up to 8, Qwen2
hidden 128 x 2 layers, global batch 16 = 2 x 4 x 2, 10 rounds of 10 steps; this 2-core machine,
load 2.1 to 4.7): paratrain 247 ms/step, TRL 457 ms/step (medians); ratio paratrain/TRL median
0.614, geometric mean 0.632, 95% CI [0.579, 0.690]. paratrain's forward passes compute 232
positions per pair on average (``pair_positions``), TRL's 286 (each reply padded to the
micro-batch's longest) for ~195 real tokens; real tokens per second 12612 against 6803. With rows
of ``block_size`` (before ``data.args.pad_to``) the two were level: ratio 1.035, [0.936, 1.232].
Loss check over all 64 pairs: assistant-mask reference 0.7983301, with TRL's extra token
0.7973843; paratrain 0.7983298 (-3.3e-7 from the first), TRL 0.7973841 (-2.2e-7 from the second,
-1.2e-3 from the first).

    python benchmarks/peers/vs_trl_dpo.py                # 10 rounds of 10 steps, then the loss check
    python benchmarks/peers/vs_trl_dpo.py --quick        # 1 round of 4 steps and the check, no JSON
    python benchmarks/peers/vs_trl_dpo.py --device cuda --procs 1 --bf16 --qwen-05b --lora   # the GPU check

Both tools run the layout ``--device``, ``--procs`` and ``--bf16`` set (bf16 autocast over float32
weights in both); ``--qwen-05b`` builds a model of Qwen2.5-0.5B's shape (random weights) and
``--lora`` puts LoRA r 16 on every linear layer of the policy, the reference then the policy with
its adapters off in both tools (``benchmarks/gpu/gpu_preference_rl.sh`` runs these on a GPU). The
loss check runs only in float32 with a separate reference.

Needs ``pip install trl`` (1.16 was measured) in the same environment.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile

from paratrain.testing.peers import (
    BETA,
    LORA,
    WARMUP,
    add_layout_args,
    check_paratrain_rows,
    check_trl_world,
    describe_layout,
    gather,
    longest_pair,
    pair_positions,
    paratrain_layout,
    peer_env,
    rounds_and_check,
    run,
    save_policy,
    script_parser,
    shape_of,
    steady,
    step_timer,
    train_paratrain,
    trl_layout,
    trl_optim_kwargs,
    trl_run_kwargs,
    worker_layout,
    write_result,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vs_trl_dpo.json")


# ----------------------------------------------------------------------------- the layout both tools run


# ----------------------------------------------------------------------------- TRL worker


def trl_worker(args) -> None:
    """One rank of the TRL run (started by torchrun)."""
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(1)
    with open(args.pairs_file) as f:
        rows = [json.loads(line) for line in f]
    micro, accum, steps = args.micro, args.accum, args.steps

    class Counted(DPOTrainer):
        """DPOTrainer that records the pairs of each micro-batch it computes a loss on."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.micro.append(int(inputs["input_ids"].shape[0]) // 2)  # [chosen..., rejected...]
            self.positions.append(int(inputs["input_ids"].numel()))  # padded to the micro-batch's longest side
            self.real.append(int(inputs["attention_mask"].sum()))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def load(path: str):
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)

    config = DPOConfig(
        output_dir=args.out,
        max_steps=steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        **trl_optim_kwargs(args.lr),
        ddp_find_unused_parameters=False,  # every parameter has a gradient
        **trl_layout(args),  # TRL's default is bf16 mixed precision; float32 unless --bf16
        beta=BETA,
        loss_type=["sigmoid"],
        max_length=args.block,  # per side; every side is shorter, so nothing is cut
        dataloader_drop_last=True,
        **trl_run_kwargs(),
    )
    timer = step_timer()
    lora = None
    if args.lora:  # the reference is then the policy with its adapters off (TRL's ref_model=None)
        from peft import LoraConfig

        lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules="all-linear")
    trainer = Counted(
        model=load(args.policy),
        ref_model=None if args.lora else load(args.ref),
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(args.tok),
        callbacks=[timer],
        peft_config=lora,
    )
    trainer.micro, trainer.positions, trainer.real = [], [], []
    timer.trainer = trainer
    world = check_trl_world(trainer, args)
    if args.lora and not hasattr(trainer.model, "peft_config"):
        raise SystemExit("TRL's model has no LoRA adapters: void")
    trainer.train()
    everyone = gather(timer.steps)
    positions = gather((sum(trainer.positions), sum(trainer.real), sum(map(sum, timer.steps))))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if len(losses) != steps or any(len(s) != steps for s in everyone):
        raise SystemExit(f"TRL ran {len(losses)} logged steps, {[len(s) for s in everyone]} per rank, not {steps}")
    for i, per_rank in enumerate(zip(*everyone)):
        if any(rank != [micro] * accum for rank in per_rank) or sum(map(sum, per_rank)) != micro * accum * world:
            raise SystemExit(f"TRL step {i + 1}: micro-batches of pairs per rank {per_rank}, not {accum} x {micro}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        result = {
            "step_s": steady(timer.end) if steps > WARMUP + 1 else None,
            "inner_s": statistics.median([e - b for b, e in zip(timer.begin, timer.end)][WARMUP:] or [math.nan]),
            "losses": losses,
            "pairs_per_step": [sum(map(sum, s)) for s in zip(*everyone)],
            # tokens the forward passes compute, and the real ones, per pair (TRL: 2 x the micro-batch's longest side)
            "positions_per_pair": sum(p for p, _, _ in positions) / sum(n for _, _, n in positions),
            "tokens_per_pair": sum(r for _, r, _ in positions) / sum(n for _, _, n in positions),
            "micro_per_rank": micro,
            "accum": accum,
            "world": world,
            "lora": args.lora,
        }
        with open(args.result, "w") as f:
            json.dump(result, f)


# ----------------------------------------------------------------------------- the two tools


def run_paratrain(paths: dict, corpus: str, out: str, batch: int, micro: int, steps: int, args, env) -> dict:
    sets = [
        f"model.hf='{paths['policy']}'",
        "data.name='tokens'",
        f"data.args={{path = '{corpus}', block_size = {paths['block']}}}",
        "loss.name='preference'",
        "preference.loss_type='sigmoid'",
        f"preference.beta={BETA}",
        f"preference.reference='{'adapters_off' if args.lora else paths['ref']}'",
        *paratrain_layout(args),
        *(
            [f"model.lora.r={LORA['r']}", f"model.lora.alpha={LORA['alpha']}", "model.lora.target_modules='all-linear'"]
            if args.lora
            else []
        ),
        f"batch.global_batch_size={batch}",
        f"batch.micro_batch_size={micro}",
    ]
    rows = train_paratrain(out, sets, env, procs=args.procs, steps=steps, lr=args.lr)
    check_paratrain_rows(rows, steps=steps, procs=args.procs, batch=batch, micro=micro, items=True)
    return {
        "step_s": steady([r["time"] for r in rows]) if steps > WARMUP + 1 else None,
        "losses": [r["loss"] for r in rows],
        "pairs_per_step": [r["items"] for r in rows],
        "positions_per_pair": pair_positions(corpus, paths["block"], micro),
        "tokens_per_pair": sum(r["tokens"] for r in rows) / sum(r["items"] for r in rows),
    }


def run_trl(paths: dict, pairs_file: str, out: str, batch: int, micro: int, steps: int, args, env) -> dict:
    os.makedirs(out, exist_ok=True)
    result = os.path.join(out, "trl.json")
    accum = batch // (args.procs * micro)
    argv = [__file__, "--worker", "--policy", paths["policy"], "--ref", paths["ref"], "--tok", paths["tok"]]
    argv += ["--pairs-file", pairs_file, "--out", out, "--result", result, "--lr", str(args.lr)]
    argv += ["--steps", str(steps), "--micro", str(micro), "--accum", str(accum), "--block", str(paths["block"])]
    argv += worker_layout(args) + (["--lora"] if args.lora else [])
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.procs)]
    run(launch + argv, env)
    with open(result) as f:
        got = json.load(f)
    if got["world"] != args.procs or any(n != batch for n in got["pairs_per_step"]):
        raise SystemExit(f"TRL ran at world {got['world']} with {got['pairs_per_step']} pairs per step: void")
    return got


# ----------------------------------------------------------------------------- data and reference


def build(tmp: str, args, env: dict) -> dict:
    """Tokenizer, pairs (once, and repeated for the timing runs), the policy and reference, paratrain corpora."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    from paratrain.testing.sft_data import VOCAB, preference_pairs, save_chat_tokenizer, write_jsonl

    logging.disable_progress_bar()
    paths = {"tok": save_chat_tokenizer(os.path.join(tmp, "tok"))}
    rows = preference_pairs(args.pairs)
    for name, seed in (("policy", 0), ("ref", 1))[: 1 if args.lora else 2]:  # LoRA: the reference is adapters off
        paths[name] = save_policy(os.path.join(tmp, name), args, seed=seed, vocab=VOCAB, max_positions=1024)
    paths.setdefault("ref", "")
    tok = AutoTokenizer.from_pretrained(paths["tok"])
    longest = longest_pair(tok, rows)
    paths["block"] = 64 * math.ceil(longest / 64)
    paths["longest"] = longest
    repeat = math.ceil(1.2 * args.steps * args.batch / len(rows))  # one epoch holds every timed step
    paths["rows"], paths["repeat"] = rows, repeat
    paths["pairs"] = write_jsonl(os.path.join(tmp, "pairs.jsonl"), rows)
    paths["pairs_timing"] = write_jsonl(os.path.join(tmp, "pairs_timing.jsonl"), rows * repeat)
    for name in ("pairs", "pairs_timing"):
        out = os.path.join(tmp, "corpus_" + name)
        cmd = [sys.executable, "-m", "paratrain", "prepare", paths[name], "--format", "preference"]
        run(cmd + ["--tokenizer", paths["tok"], "--out", out, "--val-fraction", "0"], env)
        paths["corpus_" + name] = out
    return paths


def reference(paths: dict) -> dict:
    """Mean DPO loss of plain transformers on each pair alone: the replies' tokens from the
    template's assistant mask (``assistant_mask``), and with the ``"\\n"`` after each reply's
    ``<|im_end|>`` counted too, as TRL's completion holds it (``trl_tokens``)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths["tok"])

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)

    models = {"policy": load(paths["policy"]), "ref": load(paths["ref"])}
    terms = {"assistant_mask": [], "trl_tokens": []}
    with torch.no_grad():
        for row in paths["rows"]:
            logp = {}
            for k in ("chosen", "rejected"):
                out = tok.apply_chat_template(
                    row["prompt"] + row[k], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
                )
                ids = torch.tensor([out["input_ids"]])
                prompt = tok.apply_chat_template(
                    row["prompt"], tokenize=True, return_dict=True, add_generation_prompt=True
                )
                start = len(prompt["input_ids"])
                masks = {
                    "assistant_mask": torch.tensor(out["assistant_masks"])[1:].bool(),
                    "trl_tokens": torch.arange(1, ids.shape[1]) >= start,  # all after the generation prompt
                }
                for name, model in models.items():
                    logits = model(input_ids=ids).logits[0, :-1].float()
                    token_logp = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
                    for kind, mask in masks.items():
                        logp[kind, name, k] = token_logp[mask].sum()
            for kind in terms:
                h = (logp[kind, "policy", "chosen"] - logp[kind, "ref", "chosen"]) - (
                    logp[kind, "policy", "rejected"] - logp[kind, "ref", "rejected"]
                )
                terms[kind].append(-F.logsigmoid(BETA * h))
    return {kind: float(torch.stack(t).mean()) for kind, t in terms.items()}


def correctness(paths: dict, tmp: str, args, env: dict) -> dict:
    n = len(paths["rows"])
    micro = args.micro if n % (2 * args.micro) == 0 else 1
    ref = reference(paths)
    ours = run_paratrain(paths, paths["corpus_pairs"], os.path.join(tmp, "p_check"), n, micro, 1, args, env)
    theirs = run_trl(paths, paths["pairs"], os.path.join(tmp, "t_check"), n, micro, 1, args, env)
    print(f"first-step loss over all {n} pairs in one global batch (micro {micro}, world 2):")
    print(f"  transformers on each pair alone, assistant mask:             {ref['assistant_mask']:.7f}")
    print(f"  the same with the '\\n' after <|im_end|> counted (TRL's way): {ref['trl_tokens']:.7f}")
    got = {"reference": ref}
    for name, res in (("paratrain", ours), ("TRL", theirs)):
        loss = res["losses"][0]
        rel = {kind: (loss - value) / value for kind, value in ref.items()}
        print(
            f"  {name:<9} {loss:.7f}: vs assistant mask {rel['assistant_mask']:+.2e},"
            f" vs TRL's tokens {rel['trl_tokens']:+.2e}"
        )
        got[name] = {"loss": loss, "relative": rel}
    return got


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--rounds", type=int, default=10, help="paired rounds (paratrain and TRL once each)")
    p.add_argument("--steps", type=int, default=10, help=f"optimiser steps per run; the first {WARMUP} are warm-up")
    add_layout_args(p, micro=4, batch=16)  # --batch in pairs, --micro pairs per micro-batch per process
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (constant, no warmup)")
    p.add_argument(
        "--pairs", type=int, default=64, help="distinct preference pairs (src/paratrain/testing/sft_data.py)"
    )
    p.add_argument("--hidden", type=int, default=128, help="the Qwen2's hidden size (4x in the MLP)")
    p.add_argument("--layers", type=int, default=2, help="the Qwen2's decoder layers")
    p.add_argument(
        "--lora", action="store_true", help=f"LoRA r {LORA['r']} on all linear layers, the reference adapters off"
    )
    p.add_argument("--skip-check", action="store_true", help="leave out the first-step loss comparison")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round of 4 steps and the check, no JSON")
    p.add_argument("--result-file", default=RESULT, help="where the JSON goes (default next to this script)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--policy", "--ref", "--tok", "--pairs-file", "--out", "--result"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--accum", type=int, help=argparse.SUPPRESS)
    p.add_argument("--block", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return trl_worker(args)
    if args.quick:
        args.rounds, args.steps = 1, WARMUP + 2
    if args.steps <= WARMUP + 1:
        raise SystemExit(f"--steps must exceed {WARMUP + 1} (the first {WARMUP} are warm-up)")
    if args.batch % (args.procs * args.micro):
        raise SystemExit(f"--batch {args.batch} is not a multiple of --procs {args.procs} x --micro {args.micro}")
    # the loss check compares float32 losses with a separate reference model
    args.skip_check = args.skip_check or args.bf16 or args.lora
    env = peer_env(inherit_pythonpath=True, hub_kernels_off=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(tmp, args, env)
        accum = args.batch // (args.procs * args.micro)
        reference = f"LoRA r {LORA['r']}, reference adapters off" if args.lora else "reference a second Qwen2"
        setup = (
            f"{len(paths['rows'])} pairs (x{paths['repeat']} for timing, longest pair {paths['longest']} tokens,"
            f" paratrain block_size {paths['block']}, each micro-batch cut to its longest pair), {shape_of(args)}, {reference};"
            f" global batch {args.batch} pairs = {args.procs} x micro {args.micro} x accumulation {accum};"
            f" {describe_layout(args)}"
        )
        print(setup, flush=True)
        got = rounds_and_check(
            args, paths, tmp, env, run_paratrain=run_paratrain, run_trl=run_trl, correctness=correctness
        )
    if args.quick:
        print("--quick: results not written")
        return
    write_result(args.result_file, args, paths, setup, got)


if __name__ == "__main__":
    main()
