"""paratrain's reward model against TRL's ``RewardTrainer``: the same tiny Qwen2 sequence
classifier, the same preference pairs, the same global batch, world 2 on CPU (gloo, torchrun).

Data: the conversational pairs of ``src/paratrain/testing/sft_data.py: preference_pairs`` (TRL's explicit-prompt
form), the ChatML tokenizer of ``src/paratrain/testing/sft_data.py`` (pad ``<|endoftext|>``, id 256), and one
random Qwen2 sequence classifier with one label and its weights (hidden ``--hidden``, 4x in the
MLP, ``--layers`` layers, seed 2; ``tests/distributed/test_preference.py: save_reward_model``'s recipe at this
size, ``pad_token_id`` 256), loaded by both tools from the same directory. Both tools:
Bradley-Terry ``-log sigmoid(r_chosen - r_rejected)`` averaged over the pairs, a reply's reward
the score at the last token of the prompt and reply rendered by the chat template, global batch
``--batch`` pairs (``--micro`` pairs per micro-batch per process, accumulation filling the rest
over 2 processes), AdamW (torch's own, lr ``--lr``, betas (0.9, 0.95), eps 1e-8, no weight
decay, no warmup, constant schedule, gradient norm clipped to 1.0), float32, SDPA attention, no
activation checkpointing, no truncation:

- paratrain: ``paratrain prepare --format preference`` then ``paratrain train --nproc-per-node 2``
  with ``model.hf``, ``model.head = 'score'`` (transformers' ``AutoModelForSequenceClassification``,
  one label), ``loss.name = 'reward'``, ``data.name = 'tokens'`` and ``parallel.dp_replicate = 2``.
  A pair is one packed row ``[prompt + chosen | prompt + rejected | padding]`` of ``block_size``
  tokens, each side attending to itself only; ``block_size`` is the longest pair rounded up to 64.
- TRL 1.16: ``RewardTrainer(model, RewardConfig(...))`` under ``torchrun --nproc-per-node 2``
  (``use_cpu=True``, ``ddp_backend='gloo'``, ``bf16=False`` and ``gradient_checkpointing=False``
  against TRL's defaults, ``center_rewards_coefficient=None`` (its default), ``max_length`` =
  ``block_size`` (a filter on each side: none is dropped) and ``ddp_find_unused_parameters=False``).
  ``DataCollatorForPreference`` puts a micro-batch's chosen and rejected sequences in one batch of
  ``2 x micro`` rows right-padded to its longest side; the classifier reads each row's rightmost
  token that is not the pad token.

The worker checks ``torch.distributed.get_world_size() == 2`` on gloo, TRL's own
``world_size``, ``per_device_train_batch_size`` and ``gradient_accumulation_steps``, that TRL
kept every pair, set the classifier's ``pad_token_id`` to 256 and got no ``margin`` column, and
that every optimiser step saw ``--accum`` micro-batches of ``--micro`` pairs on each rank,
``--batch`` pairs in all (counted at ``compute_loss``); paratrain's metrics rows must show world 2,
the global batch, the micro-batch and the accumulation. Any other count voids the run.

Timing: as ``vs_trl_dpo.py`` (its ``steady``, ``WARMUP`` and launcher are imported): each run's
step time is the median difference of consecutive optimiser steps' ends after the first
``WARMUP`` steps (paratrain's metrics rows' ``time``; TRL's ``on_step_end``), the pairs repeated
so that one epoch holds every step; runs alternate (paratrain, TRL, TRL, paratrain, ...); the
paired ratio paratrain/TRL of each round is the observation, summarised by
``paired.summary_line``: the median ratio and the 95% CI of the geometric mean (below 1:
paratrain is faster). The results go to ``vs_trl_reward.json`` next to this script.

Correctness: each tool runs ONE step whose global batch is every pair (``--pairs``), and its
logged loss and ``grad_norm`` (before clipping) are compared with plain ``transformers``'
``AutoModelForSequenceClassification`` scoring each side alone (a batch of one, no padding: its
own pooling reads the last token), the Bradley-Terry loss written out (as
``tests/distributed/test_preference.py: reward_anchor``). What TRL 1.16 does differently
(``trl/trainer/reward_trainer.py``), none of which moves this comparison:

- the sequence end: nothing. TRL tokenizes ``prompt + reply`` with ``apply_chat_template`` (no
  generation prompt, ``RewardTrainer._prepare_dataset``), so its last token is the ``"\\n"`` the
  template writes after ``<|im_end|>``, the token paratrain reads too. (Unlike DPO, where TRL's
  completion counts that ``"\\n"`` and paratrain's targets stop at ``<|im_end|>``.) The score one
  token earlier, at ``<|im_end|>``, gives another loss (below): the check tells the two apart.
- ``center_rewards_coefficient`` (off by default, "recommended 0.01"): adds ``c x mean over the
  micro-batch of (r_chosen + r_rejected)^2``; paratrain has no such term. At 0.01 it would add
  0.0003066 here (4.5e-4 of the loss at the initial weights).
- a ``margin`` column, if the data has one: ``-log sigmoid(r_chosen - r_rejected - margin)``;
  paratrain has none (the pairs here have none either).
- the mean: per micro-batch, then divided by the accumulation (``loss_is_scaled_for_ga =
  False``), then averaged over ranks by DDP: the global mean only while every micro-batch holds
  as many pairs (so here: 64 = 8 micro-batches x 4 x 2, ``dataloader_drop_last``); paratrain's is
  the sum over the global batch's pairs over their global count.
- ``max_length`` drops a pair with a longer side (default 1024); paratrain cuts each side to half
  its row.

Measured (TRL 1.16.0, transformers 5.25, torch 2.13 CPU; defaults: 64 pairs, longest 325 tokens,
longest side 217, paratrain block_size 384 with each micro-batch cut to its longest pair rounded
up to 8, Qwen2 classifier hidden 128 x 2 layers, global batch 16 = 2 x 4 x 2, 10 rounds of 10
steps; this 2-core machine, load 1.5 to 2.1): paratrain 163 ms/step, TRL 187 ms/step (medians);
ratio paratrain/TRL median 0.854, geometric mean 0.866, 95% CI [0.817, 0.918]. Its forward passes
compute 232 positions per pair on average, TRL's 286 (each side padded to the micro-batch's
longest) for ~195 real tokens. With rows of ``block_size`` (384 positions, before
``data.args.pad_to``) paratrain was about 30% slower: ratio 1.301, [1.234, 1.362]. Loss check
over all 64 pairs: the anchor 0.6820681 (grad norm 0.8415126); paratrain 0.6820681 (+5.5e-8;
grad norm -1.4e-7), TRL 0.6820681 (0; grad norm 0); the score read at ``<|im_end|>``
instead gives 0.6907488, 1.26e-2 away from both tools.

    python benchmarks/peers/vs_trl_reward.py             # 10 rounds of 10 steps, then the loss check
    python benchmarks/peers/vs_trl_reward.py --quick     # 1 round of 4 steps and the check, no JSON

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
    WARMUP,
    check_paratrain_rows,
    pair_positions,
    peer_env,
    rounds_and_check,
    run,
    script_parser,
    steady,
    step_timer,
    train_paratrain,
    trl_optim_kwargs,
    trl_run_kwargs,
    write_result,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vs_trl_reward.json")
CENTER = 0.01  # TRL's recommended center_rewards_coefficient (off by default): priced in the check


# ----------------------------------------------------------------------------- TRL worker


def trl_worker(args) -> None:
    """One rank of the TRL run (started by torchrun)."""
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    torch.set_num_threads(1)
    with open(args.pairs_file) as f:
        rows = [json.loads(line) for line in f]
    micro, accum, steps = args.micro, args.accum, args.steps

    class Counted(RewardTrainer):
        """RewardTrainer that records the pairs of each micro-batch it computes a loss on."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if "margin" in inputs:
                raise SystemExit("TRL got a margin column: void")
            self.micro.append(int(inputs["input_ids"].shape[0]) // 2)  # [chosen..., rejected...]
            self.positions.append(int(inputs["input_ids"].numel()))  # padded to the micro-batch's longest side
            self.real.append(int(inputs["attention_mask"].sum()))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    config = RewardConfig(
        output_dir=args.out,
        max_steps=steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        **trl_optim_kwargs(args.lr),
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,  # every parameter has a gradient
        bf16=False,  # TRL's default is bf16 mixed precision; paratrain runs float32 here
        center_rewards_coefficient=None,  # TRL's default: no centering term (priced in the check)
        max_length=args.block,  # a filter on each side, not a cut: every side is shorter
        dataloader_drop_last=True,
        **trl_run_kwargs(),
    )
    timer = step_timer()
    trainer = Counted(
        model=AutoModelForSequenceClassification.from_pretrained(
            args.model, attn_implementation="sdpa", dtype=torch.float32
        ),
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(args.tok),
        callbacks=[timer],
    )
    trainer.micro, trainer.positions, trainer.real = [], [], []
    timer.trainer = trainer
    world = dist.get_world_size() if dist.is_initialized() else 1
    a = trainer.args
    if world != 2 or dist.get_backend() != "gloo" or a.world_size != 2:
        raise SystemExit(f"TRL joined a world of {world} ({a.world_size}), not 2 on gloo: void")
    if a.per_device_train_batch_size != micro or a.gradient_accumulation_steps != accum:
        raise SystemExit(
            f"TRL runs micro {a.per_device_train_batch_size} x accum {a.gradient_accumulation_steps}: void"
        )
    if len(trainer.train_dataset) != len(rows) or trainer.model.config.pad_token_id != args.pad_id:
        raise SystemExit(
            f"TRL kept {len(trainer.train_dataset)} of {len(rows)} pairs, pad id {trainer.model.config.pad_token_id}"
        )
    trainer.train()
    everyone, positions = [None, None], [None, None]
    dist.all_gather_object(everyone, timer.steps)
    dist.all_gather_object(positions, (sum(trainer.positions), sum(trainer.real), sum(map(sum, timer.steps))))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if len(logs) != steps or any(len(s) != steps for s in everyone):
        raise SystemExit(f"TRL ran {len(logs)} logged steps, {[len(s) for s in everyone]} per rank, not {steps}")
    for i, per_rank in enumerate(zip(*everyone)):
        if any(rank != [micro] * accum for rank in per_rank) or sum(map(sum, per_rank)) != micro * accum * 2:
            raise SystemExit(f"TRL step {i + 1}: micro-batches of pairs per rank {per_rank}, not {accum} x {micro}")
    if dist.get_rank() == 0:
        result = {
            "step_s": steady(timer.end) if steps > WARMUP + 1 else None,
            "inner_s": statistics.median([e - b for b, e in zip(timer.begin, timer.end)][WARMUP:] or [math.nan]),
            "losses": [h["loss"] for h in logs],
            "grad_norms": [h["grad_norm"] for h in logs],
            "pairs_per_step": [sum(map(sum, s)) for s in zip(*everyone)],
            # positions the forward computes, and the real tokens, per pair (2 x the micro-batch's longest side)
            "positions_per_pair": sum(p for p, _, _ in positions) / sum(n for _, _, n in positions),
            "tokens_per_pair": sum(r for _, r, _ in positions) / sum(n for _, _, n in positions),
            "micro_per_rank": micro,
            "accum": accum,
            "world": world,
        }
        with open(args.result, "w") as f:
            json.dump(result, f)


# ----------------------------------------------------------------------------- the two tools


def run_paratrain(paths: dict, corpus: str, out: str, batch: int, micro: int, steps: int, args, env) -> dict:
    sets = [
        f"model.hf='{paths['model']}'",
        "model.head='score'",
        "loss.name='reward'",
        "data.name='tokens'",
        f"data.args={{path = '{corpus}', block_size = {paths['block']}}}",
        "parallel.dp_replicate=2",
        f"batch.global_batch_size={batch}",
        f"batch.micro_batch_size={micro}",
    ]
    rows = train_paratrain(out, sets, env, procs=2, steps=steps, lr=args.lr)
    check_paratrain_rows(rows, steps=steps, procs=2, batch=batch, micro=micro, items=True)
    return {
        "step_s": steady([r["time"] for r in rows]) if steps > WARMUP + 1 else None,
        "losses": [r["loss"] for r in rows],
        "grad_norms": [r["grad_norm"] for r in rows],
        "pairs_per_step": [r["items"] for r in rows],
        "positions_per_pair": pair_positions(corpus, paths["block"], micro),
        "tokens_per_pair": sum(r["tokens"] for r in rows) / sum(r["items"] for r in rows),
    }


def run_trl(paths: dict, pairs_file: str, out: str, batch: int, micro: int, steps: int, args, env) -> dict:
    os.makedirs(out, exist_ok=True)
    result = os.path.join(out, "trl.json")
    accum = batch // (2 * micro)
    argv = [__file__, "--worker", "--model", paths["model"], "--tok", paths["tok"], "--pad-id", str(paths["pad_id"])]
    argv += ["--pairs-file", pairs_file, "--out", out, "--result", result, "--lr", str(args.lr)]
    argv += ["--steps", str(steps), "--micro", str(micro), "--accum", str(accum), "--block", str(paths["block"])]
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *argv], env)
    with open(result) as f:
        got = json.load(f)
    if got["world"] != 2 or any(n != batch for n in got["pairs_per_step"]):
        raise SystemExit(f"TRL ran at world {got['world']} with {got['pairs_per_step']} pairs per step: void")
    return got


# ----------------------------------------------------------------------------- data and reference


def save_reward_model(path: str, *, hidden: int, layers: int, pad_id: int, seed: int = 2) -> str:
    """A Qwen2 sequence classifier with one label and random weights (``tests/distributed/test_preference.py:
    save_reward_model``'s recipe, at this benchmark's size)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from paratrain.testing.hf_models import ARCHS
    from paratrain.testing.sft_data import VOCAB

    args = {**ARCHS["qwen2"], "vocab_size": VOCAB, "max_position_embeddings": 1024, "num_labels": 1}
    args |= {"hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": layers}
    config = AutoConfig.for_model(args.pop("model_type"), pad_token_id=pad_id, **args)
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    return path


def build(tmp: str, args, env: dict) -> dict:
    """Tokenizer, pairs (once, and repeated for the timing runs), the reward model, paratrain corpora."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    from paratrain.testing.sft_data import preference_pairs, save_chat_tokenizer, write_jsonl

    logging.disable_progress_bar()
    paths = {"tok": save_chat_tokenizer(os.path.join(tmp, "tok"))}
    tok = AutoTokenizer.from_pretrained(paths["tok"])
    paths["pad_id"] = tok.pad_token_id  # <|endoftext|>: what TRL sets as the classifier's pad_token_id
    rows = preference_pairs(args.pairs)
    paths["model"] = save_reward_model(
        os.path.join(tmp, "rm"), hidden=args.hidden, layers=args.layers, pad_id=paths["pad_id"]
    )
    longest = side = 0
    for r in rows:
        lengths = [
            len(tok.apply_chat_template(r["prompt"] + r[k], tokenize=True, return_dict=True)["input_ids"])
            for k in ("chosen", "rejected")
        ]
        longest, side = max(longest, sum(lengths)), max(side, *lengths)
    paths["block"] = 64 * math.ceil(longest / 64)
    paths["longest"], paths["longest_side"] = longest, side
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
    """Plain transformers on each side alone (batch of one, no padding: the classifier reads the
    last token), the Bradley-Terry loss written out, as the mean over all pairs: its value and
    gradient norm with the score at the rendering's last token (the ``"\\n"`` after
    ``<|im_end|>``: what both tools should read); its value with the score at ``<|im_end|>``
    (one token earlier: shows the check tells the two apart); and TRL's centering term
    ``CENTER * mean (r_chosen + r_rejected)^2``, off by default."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths["tok"])
    model = AutoModelForSequenceClassification.from_pretrained(
        paths["model"], attn_implementation="sdpa", dtype=torch.float32
    )
    end = tok.convert_tokens_to_ids("<|im_end|>")
    last, early, centre = [], [], []
    for row in paths["rows"]:
        r, r_early = [], []
        for k in ("chosen", "rejected"):
            ids = tok.apply_chat_template(row["prompt"] + row[k], tokenize=True, return_dict=True)["input_ids"]
            if ids[-2] != end or tok.decode(ids[-1:]) != "\n":
                raise SystemExit(f"the rendering ends {tok.decode(ids[-2:])!r}, not '<|im_end|>\\n'")
            r.append(model(input_ids=torch.tensor([ids])).logits[0, 0])
            with torch.no_grad():
                r_early.append(model(input_ids=torch.tensor([ids[:-1]])).logits[0, 0])
        last.append(-F.logsigmoid(r[0] - r[1]))
        early.append(-F.logsigmoid(r_early[0] - r_early[1]))
        centre.append(((r[0] + r[1]) ** 2).detach())
    loss = torch.stack(last).mean()
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return {
        "last_token": float(loss.detach()),
        "last_token_grad_norm": float(norm),
        "at_im_end": float(torch.stack(early).mean()),
        "center_term": CENTER * float(torch.stack(centre).mean()),
    }


def correctness(paths: dict, tmp: str, args, env: dict) -> dict:
    n = len(paths["rows"])
    micro = args.micro if n % (2 * args.micro) == 0 else 1
    ref = reference(paths)
    ours = run_paratrain(paths, paths["corpus_pairs"], os.path.join(tmp, "p_check"), n, micro, 1, args, env)
    theirs = run_trl(paths, paths["pairs"], os.path.join(tmp, "t_check"), n, micro, 1, args, env)
    print(f"first-step loss over all {n} pairs in one global batch (micro {micro}, world 2):")
    print(
        f"  transformers on each side alone, score at the last token ('\\n'): {ref['last_token']:.7f}"
        f" (grad norm {ref['last_token_grad_norm']:.6f})"
    )
    print(f"  the same with the score at <|im_end|>, one token earlier:        {ref['at_im_end']:.7f}")
    print(f"  TRL's centering term at its recommended {CENTER} (off by default): +{ref['center_term']:.7f}")
    got = {"reference": ref}
    for name, res in (("paratrain", ours), ("TRL", theirs)):
        loss, norm = res["losses"][0], res["grad_norms"][0]
        rel = (loss - ref["last_token"]) / ref["last_token"]
        rel_early = (loss - ref["at_im_end"]) / ref["at_im_end"]
        rel_norm = (norm - ref["last_token_grad_norm"]) / ref["last_token_grad_norm"]
        print(
            f"  {name:<9} {loss:.7f}: vs last token {rel:+.2e}, vs <|im_end|> {rel_early:+.2e};"
            f" grad norm {norm:.6f} ({rel_norm:+.2e})"
        )
        got[name] = {
            "loss": loss,
            "relative": rel,
            "relative_to_im_end": rel_early,
            "grad_norm": norm,
            "grad_norm_relative": rel_norm,
        }
    return got


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--rounds", type=int, default=10, help="paired rounds (paratrain and TRL once each)")
    p.add_argument("--steps", type=int, default=10, help=f"optimiser steps per run; the first {WARMUP} are warm-up")
    p.add_argument("--batch", type=int, default=16, help="global batch, in pairs")
    p.add_argument("--micro", type=int, default=4, help="pairs per micro-batch per process")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (constant, no warmup)")
    p.add_argument(
        "--pairs", type=int, default=64, help="distinct preference pairs (src/paratrain/testing/sft_data.py)"
    )
    p.add_argument("--hidden", type=int, default=128, help="the Qwen2's hidden size (4x in the MLP)")
    p.add_argument("--layers", type=int, default=2, help="the Qwen2's decoder layers")
    p.add_argument("--skip-check", action="store_true", help="leave out the first-step loss comparison")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round of 4 steps and the check, no JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--model", "--tok", "--pairs-file", "--out", "--result"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    for hidden in ("--accum", "--block", "--pad-id"):
        p.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return trl_worker(args)
    if args.quick:
        args.rounds, args.steps = 1, WARMUP + 2
    if args.steps <= WARMUP + 1:
        raise SystemExit(f"--steps must exceed {WARMUP + 1} (the first {WARMUP} are warm-up)")
    if args.batch % (2 * args.micro):
        raise SystemExit(f"--batch {args.batch} is not a multiple of 2 x --micro {args.micro}")
    env = peer_env()
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(tmp, args, env)
        accum = args.batch // (2 * args.micro)
        setup = (
            f"{len(paths['rows'])} pairs (x{paths['repeat']} for timing, longest pair {paths['longest']} tokens,"
            f" longest side {paths['longest_side']}, paratrain block_size {paths['block']}, each micro-batch cut to its longest pair), Qwen2 sequence classifier"
            f" hidden {args.hidden} x {args.layers} layers; global batch {args.batch} pairs = 2 processes x micro"
            f" {args.micro} x accumulation {accum}"
        )
        print(setup, flush=True)
        got = rounds_and_check(
            args, paths, tmp, env, run_paratrain=run_paratrain, run_trl=run_trl, correctness=correctness
        )
    if args.quick:
        print("--quick: results not written")
        return
    write_result(RESULT, args, paths, setup, got)


if __name__ == "__main__":
    main()
