"""paratrain's KTO against TRL's ``KTOTrainer``: the same tiny Llama policy and a differing
reference model, the same unpaired examples, the same global batch, world 2 on CPU (gloo, torchrun).

Data: the conversational pairs of ``src/paratrain/testing/sft_data.py: preference_pairs`` in
TRL's unpaired form (``prompt``, ``completion``, ``label``): the chosen reply of even rows
(desirable), the rejected one of odd rows (undesirable), as ``tests/distributed/test_preference.py:
unpaired_rows``; the ChatML tokenizer with ``{% generation %}`` spans; a random Llama policy
(``--policy-seed``, default 0) and a random Llama reference of the same shape (``--ref-seed``,
default 1) (``src/paratrain/testing/hf_models.py``). Both tools: KTO, beta 0.1, desirable and
undesirable weights 1, the reference a separate frozen model, global batch ``--batch`` examples
(``--micro`` per micro-batch per process, accumulation filling the rest over 2 processes), AdamW
(torch's own, lr ``--lr``, betas (0.9, 0.95), eps 1e-8, no weight decay, no warmup, constant
schedule, gradient norm clipped to 1.0), float32, SDPA attention, no activation checkpointing, no
truncation:

- paratrain: ``paratrain prepare --format unpaired`` then ``paratrain train --nproc-per-node 2``
  with ``model.hf``, ``loss.name = 'preference'``, ``preference.loss_type = 'kto'``,
  ``preference.reference = DIR``, ``data.name = 'tokens'``, ``parallel.dp_replicate = 2``. An
  example is one packed row ``[prompt + completion | prompt + next row's completion | padding]``,
  each side attending to itself only, cut to the micro-batch's longest row rounded up to 8.
- TRL 1.16: ``KTOTrainer(model, ref_model, KTOConfig(...))`` under ``torchrun --nproc-per-node 2``
  (``use_cpu=True``, ``ddp_backend='gloo'``, ``bf16=False``, ``gradient_checkpointing=False``,
  ``max_length`` = the block, so nothing is cut, ``train_sampling_strategy='sequential'``, which
  TRL requires for KTO, ``ddp_find_unused_parameters=False``). Each micro-batch is two batches
  right-padded to their longest: the examples, and the KL sequences.

The worker checks ``torch.distributed.get_world_size() == 2`` on gloo, TRL's ``world_size``,
``per_device_train_batch_size`` and ``gradient_accumulation_steps``, and that every optimiser step
saw ``--accum`` micro-batches of ``--micro`` examples on each rank (counted at ``compute_loss``);
paratrain's metrics rows must show world 2, the global batch, the micro-batch and the
accumulation. Any other count voids the run. Timing, rounds and the result file as
``vs_trl_dpo.py`` (``paratrain.testing.peers.rounds_and_check``): the median step time after
``WARMUP`` steps, runs alternating, the paired ratio paratrain/TRL summarised by its median and
the 95% CI of the geometric mean; results in ``vs_trl_kto.json`` next to this script.

Where the two losses differ (both read in their code: ``src/paratrain/objectives/preference.py:
_kl`` and ``trl/trainer/kto_trainer.py: _compute_loss`` with ``_prepare_dataset``'s
``add_kl_completion_ids``). The per-example terms are the same formula (Ethayarajh et al. 2024,
eq. 7): ``w_d (1 - sigmoid(b (r - z0)))`` and ``w_u (1 - sigmoid(b (z0 - r)))``. Three things
differ, all by definition, none a bug that breaks its own definition:

1. **the reference point z0.** paratrain: ``max(0, mean over the whole global batch of
   log pi - log ref)`` of each prompt with the *next row's* completion (fixed when the corpus is
   prepared), computed before the micro-batch loop without a graph. TRL: per micro-batch, each
   prompt with the *previous* completion of its own chunk of ``per_device_train_batch_size``
   rows (rotated by one in dataset order; hence its required sequential sampling), the mean over
   the micro-batch, all-gathered and averaged over the ranks (``gather_for_metrics(kl).mean()``),
   then clamped at 0, detached. So TRL's z0 changes with the micro-batch size and the
   accumulation (a step of ``accum`` micro-batches uses ``accum`` different z0), and with the
   data order; paratrain's does not change with the layout.
2. **the completion's tokens.** TRL's completion is everything the template renders after the
   generation prompt: the assistant span *and* the ``"\\n"`` after ``<|im_end|>``; paratrain's
   targets are the template's ``{% generation %}`` span (as in DPO, ``vs_trl_dpo.py``).
3. **the mean.** TRL: the mean over a micro-batch (``losses.nanmean()``), divided by the
   accumulation, averaged over ranks: the global mean only because every micro-batch holds
   ``--micro`` examples; paratrain: the sum over the global batch over its count.

Correctness: each tool runs ONE step whose global batch is every example (``--examples``), at
each micro-batch size of ``--check-micro`` (default 4 and 8: accumulation 8 and 4), and
its logged loss is compared with plain ``transformers`` on each sequence alone, the KTO formula
written out, under four definitions: {paratrain's z0, TRL's z0} x {assistant-span tokens, TRL's
tokens}. paratrain should match (paratrain z0, span), TRL (TRL z0, TRL tokens); the two cross
terms show how much of the gap each difference makes. The reference's and policy's seeds are
chosen so that the KL estimates are positive (with z0 clamped to 0 on both sides the check could
not tell the definitions apart: with the seeds swapped every KL mean is negative, both z0 are 0
and the two tools differ only by the token convention).

Measured: see docs/preference.md ("KTO against TRL") and ``vs_trl_kto.json``.

    python benchmarks/peers/vs_trl_kto.py --rounds 8   # paired rounds of 10 steps, then the loss check
    python benchmarks/peers/vs_trl_kto.py --quick      # 1 round of 4 steps and the check, no JSON

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
    WARMUP,
    check_paratrain_rows,
    check_trl_gloo,
    check_trl_steps,
    gather,
    launch_trl,
    pair_positions,
    parse_peer_args,
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
RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vs_trl_kto.json")
PROCS = 2


# ----------------------------------------------------------------------------- TRL worker


def trl_worker(args) -> None:
    """One rank of the TRL run (started by torchrun)."""
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    torch.set_num_threads(1)
    with open(args.pairs_file) as f:
        rows = [json.loads(line) for line in f]
    micro, accum, steps = args.micro, args.accum, args.steps

    class Counted(KTOTrainer):
        """KTOTrainer that records the examples of each micro-batch it computes a loss on."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.micro.append(int(inputs["input_ids"].shape[0]))
            # positions the forward passes compute: the examples and the KL sequences, each padded to its longest
            self.positions.append(int(inputs["input_ids"].numel() + inputs["KL_input_ids"].numel()))
            self.real.append(int(inputs["attention_mask"].sum() + inputs["KL_attention_mask"].sum()))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def load(path: str):
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)

    config = KTOConfig(
        output_dir=args.out,
        max_steps=steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        **trl_optim_kwargs(args.lr),
        use_cpu=True,
        ddp_backend="gloo",
        bf16=False,  # TRL's default is bf16 mixed precision; paratrain runs float32 here
        ddp_find_unused_parameters=False,  # every parameter has a gradient
        beta=BETA,
        loss_type="kto",
        desirable_weight=1.0,
        undesirable_weight=1.0,
        max_length=args.block,  # every sequence is shorter, so nothing is cut
        train_sampling_strategy="sequential",  # TRL's default for KTO, required by its KL rotation
        dataloader_drop_last=True,
        **trl_run_kwargs(),
    )
    timer = step_timer()
    trainer = Counted(
        model=load(args.policy),
        ref_model=load(args.ref),
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(args.tok),
        callbacks=[timer],
    )
    trainer.micro, trainer.positions, trainer.real = [], [], []
    timer.trainer = trainer
    world = check_trl_gloo(trainer, procs=PROCS, micro=micro, accum=accum)
    if len(trainer.train_dataset) != len(rows):
        raise SystemExit(f"TRL kept {len(trainer.train_dataset)} of {len(rows)} examples: void")
    trainer.train()
    everyone, logs = check_trl_steps(trainer, timer, steps=steps, micro=micro, accum=accum, world=world)
    positions = gather((sum(trainer.positions), sum(trainer.real), sum(map(sum, timer.steps))))
    if dist.get_rank() == 0:
        result = {
            "step_s": steady(timer.end) if steps > WARMUP + 1 else None,
            "inner_s": statistics.median([e - b for b, e in zip(timer.begin, timer.end)][WARMUP:] or [math.nan]),
            "losses": [h["loss"] for h in logs],
            "kl": [h.get("kl") for h in logs],
            "pairs_per_step": [sum(map(sum, s)) for s in zip(*everyone)],
            "positions_per_pair": sum(p for p, _, _ in positions) / sum(n for _, _, n in positions),
            "tokens_per_pair": sum(r for _, r, _ in positions) / sum(n for _, _, n in positions),
            "world": world,
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
        "preference.loss_type='kto'",
        f"preference.beta={BETA}",
        f"preference.reference='{paths['ref']}'",
        f"parallel.dp_replicate={PROCS}",
        f"batch.global_batch_size={batch}",
        f"batch.micro_batch_size={micro}",
    ]
    rows = train_paratrain(out, sets, env, procs=PROCS, steps=steps, lr=args.lr)
    check_paratrain_rows(rows, steps=steps, procs=PROCS, batch=batch, micro=micro, items=True)
    return {
        "step_s": steady([r["time"] for r in rows]) if steps > WARMUP + 1 else None,
        "losses": [r["loss"] for r in rows],
        "kl": [r.get("kto_kl") for r in rows],
        "pairs_per_step": [r["items"] for r in rows],
        "positions_per_pair": pair_positions(corpus, paths["block"], micro),
        "tokens_per_pair": sum(r["tokens"] for r in rows) / sum(r["items"] for r in rows),
    }


def run_trl(paths: dict, rows_file: str, out: str, batch: int, micro: int, steps: int, args, env) -> dict:
    os.makedirs(out, exist_ok=True)
    accum = batch // (PROCS * micro)
    argv = ["--policy", paths["policy"], "--ref", paths["ref"], "--tok", paths["tok"]]
    argv += ["--pairs-file", rows_file, "--out", out, "--lr", str(args.lr)]
    argv += ["--steps", str(steps), "--micro", str(micro), "--accum", str(accum), "--block", str(paths["block"])]
    got = launch_trl(__file__, argv, env, procs=PROCS, result=os.path.join(out, "trl.json"))
    if got["world"] != PROCS or any(n != batch for n in got["pairs_per_step"]):
        raise SystemExit(f"TRL ran at world {got['world']} with {got['pairs_per_step']} examples per step: void")
    return got


# ----------------------------------------------------------------------------- data and reference


def unpaired(rows: list[dict]) -> list[dict]:
    """TRL's unpaired form: the chosen reply (desirable) of even rows, the rejected of odd ones."""
    return [
        {"prompt": r["prompt"], "completion": r["chosen" if i % 2 == 0 else "rejected"], "label": i % 2 == 0}
        for i, r in enumerate(rows)
    ]


def build(tmp: str, args, env: dict) -> dict:
    """Tokenizer, examples (once, and repeated for the timing runs), the policy and reference, paratrain corpora."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    from paratrain.testing.hf_models import save_tiny
    from paratrain.testing.sft_data import VOCAB, preference_pairs, save_chat_tokenizer, write_jsonl

    logging.disable_progress_bar()
    paths = {"tok": save_chat_tokenizer(os.path.join(tmp, "tok"))}
    rows = unpaired(preference_pairs(args.examples))
    h = args.hidden
    shape = dict(vocab_size=VOCAB, hidden_size=h, intermediate_size=4 * h, num_hidden_layers=args.layers)
    for name, seed in (("policy", args.policy_seed), ("ref", args.ref_seed)):
        paths[name] = save_tiny("llama", os.path.join(tmp, name), max_position_embeddings=1024, seed=seed, **shape)
    tok = AutoTokenizer.from_pretrained(paths["tok"])
    # a row: the example and the mismatched KL sequence (the next row's completion) side by side
    lengths = [
        len(tok.apply_chat_template(r["prompt"] + r["completion"], tokenize=True, return_dict=True)["input_ids"])
        for r in rows
    ]
    longest = max(a + b for a, b in zip(lengths, lengths[1:] + lengths[:1]))
    paths["block"] = 64 * math.ceil(longest / 64)
    paths["longest"] = longest
    repeat = math.ceil(1.2 * args.steps * args.batch / len(rows))  # one epoch holds every timed step
    paths["rows"], paths["repeat"] = rows, repeat
    paths["pairs"] = write_jsonl(os.path.join(tmp, "rows.jsonl"), rows)
    paths["pairs_timing"] = write_jsonl(os.path.join(tmp, "rows_timing.jsonl"), rows * repeat)
    for name in ("pairs", "pairs_timing"):
        out = os.path.join(tmp, "corpus_" + name)
        cmd = [sys.executable, "-m", "paratrain", "prepare", paths[name], "--format", "unpaired"]
        run(cmd + ["--tokenizer", paths["tok"], "--out", out, "--val-fraction", "0"], env)
        paths["corpus_" + name] = out
    return paths


def reference(paths: dict, micro: int) -> dict:
    """The mean KTO loss of one step over every example, from plain transformers on each
    sequence alone, under {paratrain's z0, TRL's z0} x {the assistant span, TRL's tokens (the
    span and the "\\n" after it)}; and the z0 values."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths["tok"])

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)

    models = {"policy": load(paths["policy"]), "ref": load(paths["ref"])}
    rows = paths["rows"]
    n = len(rows)

    @torch.no_grad()
    def gap(prompt, completion) -> dict:
        """log pi - log ref of the completion after the prompt, for each token convention."""
        out = tok.apply_chat_template(
            prompt + completion, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = torch.tensor([out["input_ids"]])
        start = len(
            tok.apply_chat_template(prompt, tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"]
        )
        masks = {
            "span": torch.tensor(out["assistant_masks"])[1:].bool(),
            "trl": torch.arange(1, ids.shape[1]) >= start,  # all after the generation prompt
        }
        got = {k: 0.0 for k in masks}
        for name, model in models.items():
            token_logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            for k, m in masks.items():
                got[k] += float(token_logp[m].sum()) * (1 if name == "policy" else -1)
        return got

    own = [gap(r["prompt"], r["completion"]) for r in rows]
    nxt = [gap(r["prompt"], rows[(i + 1) % n]["completion"]) for i, r in enumerate(rows)]  # paratrain's KL rows
    chunk = lambda i: i // micro * micro  # noqa: E731  TRL rotates within chunks of the micro-batch size
    prev = [gap(r["prompt"], rows[chunk(i) + (i - chunk(i) - 1) % micro]["completion"]) for i, r in enumerate(rows)]

    def z_paratrain(tokens):
        return max(0.0, statistics.fmean(g[tokens] for g in nxt))

    def z_trl(tokens):
        """Per micro-batch index j of the step: ranks r hold chunks j * PROCS + r (sequential order)."""
        zs = {}
        for j in range(n // (micro * PROCS)):
            per_rank = [
                statistics.fmean(prev[i][tokens] for i in range((j * PROCS + r) * micro, (j * PROCS + r + 1) * micro))
                for r in range(PROCS)
            ]
            zs[j] = max(0.0, statistics.fmean(per_rank))
        return zs

    def loss(tokens, which):
        zs = z_trl(tokens) if which == "trl" else None
        terms = []
        for i, r in enumerate(rows):
            z = zs[i // (micro * PROCS)] if zs is not None else z_paratrain(tokens)
            ratio = own[i][tokens]
            x = ratio - z if r["label"] else z - ratio
            terms.append(1 - 1 / (1 + math.exp(-BETA * x)))
        return statistics.fmean(terms)

    result = {f"z0_{w}_{t}": loss(t, w) for w in ("paratrain", "trl") for t in ("span", "trl")}
    result["z0_paratrain"] = {t: z_paratrain(t) for t in ("span", "trl")}
    result["z0_trl_per_micro_batch"] = {t: list(z_trl(t).values()) for t in ("span", "trl")}
    return result


def correctness(paths: dict, tmp: str, args, env: dict) -> dict:
    """Step 1 over every example at each micro-batch size of --check-micro: both tools against the
    four written-out definitions, and each tool's loss between the micro-batch sizes."""
    n, got = len(paths["rows"]), {}
    for micro in args.check_micro:
        got[micro] = check_at(paths, tmp, args, env, n, micro)
    first, *rest = args.check_micro
    for name in ("paratrain", "TRL"):
        moves = [(got[m][name]["loss"] - got[first][name]["loss"]) / got[first][name]["loss"] for m in rest]
        print(f"  {name}'s step-1 loss, micro {rest} against micro {first}: {', '.join(f'{x:+.2e}' for x in moves)}")
    return got


def check_at(paths: dict, tmp: str, args, env: dict, n: int, micro: int) -> dict:
    ref = reference(paths, micro)
    ours = run_paratrain(paths, paths["corpus_pairs"], os.path.join(tmp, f"p_check{micro}"), n, micro, 1, args, env)
    theirs = run_trl(paths, paths["pairs"], os.path.join(tmp, f"t_check{micro}"), n, micro, 1, args, env)
    print(f"first-step loss over all {n} examples in one global batch (micro {micro}, world {PROCS}):")
    print(
        f"  paratrain's z0 (global, next row's completion): span {ref['z0_paratrain']['span']:.5f},"
        f" TRL tokens {ref['z0_paratrain']['trl']:.5f}; paratrain logged kto_kl {ours['kl'][0]:.5f}"
    )
    zs = ref["z0_trl_per_micro_batch"]["trl"]
    print(
        f"  TRL's z0 per micro-batch (TRL tokens): {', '.join(f'{z:.5f}' for z in zs)}; TRL logged kl {theirs['kl'][0]}"
    )
    keys = [k for k in ref if k.startswith("z0_") and not isinstance(ref[k], dict)]
    for k in keys:
        print(f"  reference, {k:<19} {ref[k]:.7f}")
    got = {"reference": ref}
    for name, res in (("paratrain", ours), ("TRL", theirs)):
        value = res["losses"][0]
        rel = {k: (value - ref[k]) / ref[k] for k in keys}
        print(f"  {name:<9} {value:.7f}: " + ", ".join(f"vs {k} {v:+.2e}" for k, v in rel.items()))
        got[name] = {"loss": value, "kl": res["kl"][0], "relative": rel}
    return got


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--rounds", type=int, default=8, help="paired rounds (paratrain and TRL once each)")
    p.add_argument("--steps", type=int, default=10, help=f"optimiser steps per run; the first {WARMUP} are warm-up")
    p.add_argument("--batch", type=int, default=16, help="global batch, in examples")
    p.add_argument("--micro", type=int, default=4, help="examples per micro-batch per process (TRL needs > 1)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (constant, no warmup)")
    p.add_argument("--examples", type=int, default=64, help="distinct unpaired examples")
    p.add_argument("--hidden", type=int, default=128, help="the Llama's hidden size (4x in the MLP)")
    p.add_argument("--layers", type=int, default=2, help="the Llama's decoder layers")
    p.add_argument("--policy-seed", type=int, default=0, help="the policy's init seed")
    p.add_argument("--ref-seed", type=int, default=1, help="the reference's init seed")
    p.add_argument(
        "--check-micro", type=int, nargs="+", default=[4, 8], help="micro-batch sizes of the loss check (default 4 8)"
    )
    p.add_argument("--skip-check", action="store_true", help="leave out the first-step loss comparison")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round of 4 steps and the check, no JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--policy", "--ref", "--tok", "--pairs-file", "--out", "--result"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    for hidden in ("--accum", "--block"):
        p.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    args = parse_peer_args(p, trl_worker)
    if args is None:  # this process was a TRL rank
        return
    micros = [args.micro, *args.check_micro]
    if min(micros) < 2 or args.batch % (PROCS * args.micro) or any(args.examples % (PROCS * m) for m in micros):
        raise SystemExit(f"--batch and --examples must be multiples of {PROCS} x --micro, and --micro at least 2")
    env = peer_env(inherit_pythonpath=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(tmp, args, env)
        accum = args.batch // (PROCS * args.micro)
        setup = (
            f"{len(paths['rows'])} unpaired examples (x{paths['repeat']} for timing, longest row"
            f" example + KL sequence {paths['longest']} tokens, paratrain block_size {paths['block']}), Llama hidden"
            f" {args.hidden} x {args.layers} layers, reference a second Llama; global batch {args.batch}"
            f" examples = {PROCS} x micro {args.micro} x accumulation {accum}; {PROCS} processes on cpu, float32"
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
