"""paratrain against TRL's ``SFTTrainer``: supervised fine-tuning of the same tiny HF Llama on the same
conversations, world 2 on CPU (gloo, torchrun).

Data: a byte-level tokenizer with a ChatML template that has ``{% generation %}`` spans and
``--conversations`` chat rows about standard-library modules (``src/paratrain/testing/sft_data.py``), a random
``transformers`` Llama of that vocabulary (``src/paratrain/testing/hf_models.py``). Both tools train on the
assistant tokens only, whole conversations packed best-fit-decreasing into rows of 512 tokens
whose documents never attend to each other, with the same global batch of ``--batch`` rows
(``--micro`` rows per micro-batch, accumulation filling the rest over 2 processes), AdamW
(torch's own, lr ``--lr``, betas (0.9, 0.95), eps 1e-8, no weight decay, no warmup, constant
schedule, gradient norm clipped to 1.0), float32, no activation checkpointing:

- paratrain: ``paratrain prepare --format chat`` then ``paratrain train --nproc-per-node 2`` with
  ``model.hf``, ``data.name = 'tokens'`` (block_size 512, packing ``documents``) and
  ``parallel.dp_replicate = 2``.
- TRL 1.16: ``SFTTrainer`` + ``SFTConfig(assistant_only_loss=True, packing=True,
  packing_strategy='bfd', padding_free=True, max_length=512, use_cpu=True, optim='adamw_torch')``
  under ``torchrun --nproc-per-node 2``. What that does (read in TRL's source): ``SFTTrainer.
  _prepare_dataset`` tokenizes each conversation with ``apply_chat_template(...,
  return_assistant_tokens_mask=True)`` and sets the labels outside the assistant mask to -100
  (``build_labels``), then ``trl.data_utils.pack_dataset`` -> ``_pack_bfd`` packs whole
  conversations best-fit-decreasing into rows of ``max_length`` (longer ones truncated) and keeps
  each row's ``seq_lengths``. BFD forces padding-free (``SFTTrainer.__init__``), so
  ``DataCollatorForLanguageModeling`` concatenates the micro-batch's rows into ONE sequence with
  ``position_ids`` restarting at every document (``get_position_ids_from_packed_seq_lengths``), no
  attention mask, and the label of each document's first token set to -100; with SDPA,
  transformers' ``masking_utils.find_packed_sequence_indices`` turns the restarting positions into
  a block-diagonal causal mask over the whole flattened micro-batch (FlashAttention would use
  ``cu_seq_lens`` instead). The loss is TRL's fused LM head (``trainer/utils.add_fused_lm_head``:
  log-probabilities in tiles, no full logits) summed and divided by ``num_items_in_batch``, which
  ``Trainer._get_num_items_in_batch`` counts over ``labels[..., 1:]`` of every micro-batch of the
  step and all-gathers across ranks (``average_tokens_across_devices``), the loss multiplied by the
  world size against DDP's averaging: a global-token mean, like paratrain's.

The worker checks ``torch.distributed.get_world_size() == 2`` on gloo, and that every optimiser
step saw ``--batch`` packed rows over both ranks and normalised by the global target count (rows
counted at the collator, targets at ``compute_loss``); it fails otherwise. The timing corpus is the
conversations repeated so that one epoch holds every step (an epoch end would give TRL a short
last accumulation step).

Timing: each run's step time is the wall-clock difference of consecutive optimiser steps' ends
(paratrain's metrics rows' ``time``; TRL's ``on_step_end``), the whole loop iteration (data,
forward/backward, all-reduce, optimiser, logging), median over the steps after the first
``WARMUP``. Runs alternate (paratrain, TRL, TRL, paratrain, ...) so drifts in the machine's load
hit both; the paired ratio paratrain/TRL of each round is the observation, summarised by
``paired.summary_line``: the median ratio and the 95% CI of the geometric mean (below 1: paratrain
is faster). TRL's own ``on_step_begin`` -> ``on_step_end`` time (no data loading) is printed too.

Correctness: each tool runs ONE step whose global batch is every packed row of the conversations
(``--micro`` 1, accumulation over the rest), and its logged first loss is compared with the
reference: plain ``transformers`` on each conversation alone, unpacked, labels masked with
``apply_chat_template(..., return_assistant_tokens_mask=True)``, its ``labels=`` loss times the
conversation's targets, summed and divided by all targets (``tests/distributed/test_sft.py: reference``).
Measured (TRL 1.16.0, transformers 5.24, torch 2.13 CPU; 128 conversations, 38 rows of 512 for
both tools): both count the reference's 8180 targets and log its loss within 3e-9 (paratrain) and
2e-8 (TRL) relative (attention across documents moved paratrain's own test by 2.7e-5,
docs/sft.md), so TRL's packed, padding-free, assistant-only path is a global-token mean over
ranks and accumulation (not per device or per micro-batch), its documents do not see each other,
and its assistant mask (the turn's ``<|im_end|>`` included) is transformers'. Timing (defaults, 4 rounds, this 2-core machine
shared with other jobs, load about 5): paratrain 438 ms/step, TRL 678 ms/step (medians); ratio
paratrain/TRL median 0.642, geometric mean 0.633, 95% CI [0.299, 1.340]: faster in 3 of 4 pairs,
but too noisy to claim. A cost TRL pays by design on CPU: padding-free attention over the
flattened micro-batch is one (micro x 512)^2 masked SDPA, not micro blocks of 512^2.

    python benchmarks/peers/vs_trl.py --rounds 4 --steps 8
    python benchmarks/peers/vs_trl.py --dry-run      # 1 round of 4 steps and the correctness check

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

from paratrain.testing.paired import summary_line
from paratrain.testing.peers import (
    BLOCK,
    WARMUP,
    peer_env,
    run,
    script_parser,
    steady,
    step_timer,
    train_paratrain,
    trl_optim_kwargs,
    trl_run_kwargs,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ----------------------------------------------------------------------------- TRL worker


def trl_worker(args) -> None:
    """One rank of the TRL run (started by torchrun)."""
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(1)
    with open(args.chat) as f:
        rows = [json.loads(line) for line in f]
    tok = AutoTokenizer.from_pretrained(args.tok)

    class Counted(SFTTrainer):
        """SFTTrainer that records, per optimiser step, the rows and targets it trained on."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            local = int((inputs["labels"][:, 1:] != -100).sum())  # what Trainer counts, before its gather
            self.micro.append((self.collated.pop(0), local, float(num_items_in_batch)))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def make(micro: int, accum: int, steps: int, timer) -> Counted:
        config = SFTConfig(
            output_dir=args.out,
            max_steps=steps,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accum,
            **trl_optim_kwargs(args.lr),
            use_cpu=True,
            ddp_backend="gloo",
            bf16=False,  # TRL's default is bf16 mixed precision; paratrain runs float32 here
            assistant_only_loss=True,
            packing=True,
            packing_strategy="bfd",
            padding_free=True,
            max_length=BLOCK,
            dataloader_drop_last=True,
            **trl_run_kwargs(),
        )
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, attn_implementation="sdpa", dtype=torch.float32)
        t = Counted(
            model=model,
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            callbacks=[timer] if timer else [],
        )
        t.micro, t.collated, inner = [], [], t.data_collator

        def collate(examples):
            t.collated.append(len(examples))
            return inner(examples)

        t.data_collator = collate
        return t

    micro, steps = args.micro, args.steps
    if args.batch == 0:  # one step over every packed row: TRL's own row count first
        trainer = make(1, 1, 1, None)
        packed = len(trainer.train_dataset)
        if packed % 2:
            raise SystemExit(f"TRL packed {packed} rows, odd: no global batch of all rows at world 2")
        batch, micro, steps = packed, 1, 1
    else:
        batch = args.batch
    accum = batch // (micro * 2)
    if accum * micro * 2 != batch:
        raise SystemExit(f"--batch {batch} is not a multiple of 2 x --micro {micro}")
    timer = step_timer()
    trainer = make(micro, accum, steps, timer)
    timer.trainer = trainer
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != 2 or dist.get_backend() != "gloo" or trainer.args.world_size != 2:
        raise SystemExit(f"TRL joined a world of {world} ({trainer.args.world_size}), not 2 on gloo: void")
    trainer.train()
    everyone = [None, None]
    dist.all_gather_object(everyone, timer.steps)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if len(losses) != steps or any(len(s) != steps for s in everyone):
        raise SystemExit(f"TRL ran {len(losses)} logged steps, {[len(s) for s in everyone]} per rank, not {steps}")
    targets = []
    for i, per_rank in enumerate(zip(*everyone)):
        got_rows = sum(r for rank in per_rank for r, _, _ in rank)
        got_targets = sum(n for rank in per_rank for _, n, _ in rank)
        norms = {g for rank in per_rank for _, _, g in rank}
        if got_rows != batch or norms != {float(got_targets)}:
            raise SystemExit(
                f"TRL step {i + 1}: {got_rows} rows (not {batch}), {got_targets} targets, normalised by {norms}"
            )
        targets.append(got_targets)
    if dist.get_rank() == 0:
        result = {
            "step_s": steady(timer.end) if steps > WARMUP + 1 else None,
            "inner_s": statistics.median([e - b for b, e in zip(timer.begin, timer.end)][WARMUP:] or [math.nan]),
            "losses": losses,
            "targets": targets,
            "rows": len(trainer.train_dataset),
            "batch": batch,
            "world": world,
        }
        with open(args.result, "w") as f:
            json.dump(result, f)


# ----------------------------------------------------------------------------- the two tools


def run_paratrain(paths: dict, corpus: str, out: str, batch: int, micro: int, steps: int, args, env) -> dict:
    sets = [
        f"model.hf='{paths['model']}'",
        "data.name='tokens'",
        f"data.args={{path = '{corpus}', block_size = {BLOCK}}}",
        "parallel.dp_replicate=2",
        f"batch.global_batch_size={batch}",
        f"batch.micro_batch_size={micro}",
    ]
    rows = train_paratrain(out, sets, env, procs=2, steps=steps, lr=args.lr)
    bad = [r for r in rows if r["world_size"] != 2 or r["global_batch_size"] != batch]
    if len(rows) != steps or bad:
        raise SystemExit(f"paratrain logged {len(rows)} steps, not {steps}, or other world/batch: {bad[:1]}")
    return {
        "step_s": steady([r["time"] for r in rows]) if steps > WARMUP + 1 else None,
        "losses": [r["loss"] for r in rows],
        "targets": [r["trainable_tokens"] for r in rows],
    }


def run_trl(paths: dict, chat: str, out: str, batch: int, micro: int, steps: int, args, env) -> dict:
    os.makedirs(out, exist_ok=True)
    result = os.path.join(out, "trl.json")
    argv = [__file__, "--worker", "--model-dir", paths["model"], "--tok", paths["tok"], "--chat", chat]
    argv += ["--out", out, "--result", result, "--lr", str(args.lr)]
    argv += ["--steps", str(steps), "--batch", str(batch), "--micro", str(micro)]
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *argv], env)
    with open(result) as f:
        got = json.load(f)
    assert got["world"] == 2, got
    return got


# ----------------------------------------------------------------------------- data and reference


def build(tmp: str, args, env: dict) -> dict:
    """Tokenizer, conversations (once, and repeated for the timing runs), tiny Llama, paratrain corpora."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    from paratrain.testing.hf_models import save_tiny
    from paratrain.testing.sft_data import VOCAB, save_chat_tokenizer, stdlib_conversations, write_jsonl

    logging.disable_progress_bar()
    paths = {"tok": save_chat_tokenizer(os.path.join(tmp, "tok")), "model": os.path.join(tmp, "llama")}
    convs = stdlib_conversations(args.conversations)
    h = args.hidden
    save_tiny(
        "llama",
        paths["model"],
        vocab_size=VOCAB,
        max_position_embeddings=BLOCK,
        hidden_size=h,
        intermediate_size=4 * h,
        num_hidden_layers=args.layers,
    )
    # The timing corpus: enough copies that one epoch (at least tokens / BLOCK rows) holds every step, and 20% more.
    tok = AutoTokenizer.from_pretrained(paths["tok"])
    tokens = sum(
        len(tok.apply_chat_template(c["messages"], tokenize=True, return_dict=True)["input_ids"]) for c in convs
    )
    repeat = math.ceil(1.2 * args.steps * args.batch * BLOCK / tokens)
    paths["convs"] = convs
    paths["chat"] = write_jsonl(os.path.join(tmp, "chat.jsonl"), convs)
    paths["chat_timing"] = write_jsonl(os.path.join(tmp, "chat_timing.jsonl"), convs * repeat)
    for name in ("chat", "chat_timing"):
        out = os.path.join(tmp, "corpus_" + name)
        cmd = [sys.executable, "-m", "paratrain", "prepare", paths[name], "--format", "chat"]
        run(cmd + ["--tokenizer", paths["tok"], "--out", out, "--val-fraction", "0"], env)
        paths["corpus_" + name] = out
    paths["repeat"] = repeat
    return paths


def reference(paths: dict) -> tuple[float, int]:
    """(mean loss, targets) of plain transformers on each conversation alone, unpacked, assistant mask."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths["tok"])
    model = AutoModelForCausalLM.from_pretrained(paths["model"], attn_implementation="sdpa", dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for c in paths["convs"]:
            out = tok.apply_chat_template(
                c["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids = torch.tensor([out["input_ids"]])
            labels = torch.where(torch.tensor([out["assistant_masks"]]).bool(), ids, -100)
            n = int((labels[0, 1:] != -100).sum())  # transformers shifts the labels inside
            total += float(model(input_ids=ids, labels=labels).loss.double()) * n
            count += n
    return total / count, count


def correctness(paths: dict, tmp: str, args, env: dict) -> None:
    from paratrain.data.tokens import build_tokens

    rows = len(build_tokens(paths["corpus_chat"], block_size=BLOCK))
    if rows % 2:
        raise SystemExit(f"paratrain packed {rows} rows, odd: pick another --conversations")
    ref, ref_targets = reference(paths)
    ours = run_paratrain(paths, paths["corpus_chat"], os.path.join(tmp, "p_check"), rows, 1, 1, args, env)
    theirs = run_trl(paths, paths["chat"], os.path.join(tmp, "t_check"), 0, 1, 1, args, env)
    print(
        f"first-step loss over all {len(paths['convs'])} conversations in one global batch"
        f" (paratrain {rows} rows, TRL {theirs['rows']} rows of {BLOCK}):"
    )
    print(f"  reference (transformers, each conversation alone): {ref:.7f} over {ref_targets} targets")
    for name, got in (("paratrain", ours), ("TRL", theirs)):
        loss, n = got["losses"][0], got["targets"][0]
        print(f"  {name:<9} {loss:.7f} over {n} targets: relative difference {(loss - ref) / ref:+.2e}")


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--rounds", type=int, default=4, help="paired rounds (paratrain and TRL once each)")
    p.add_argument("--steps", type=int, default=8, help=f"optimiser steps per run; the first {WARMUP} are warm-up")
    p.add_argument("--batch", type=int, default=8, help="global batch, in packed rows of 512 tokens")
    p.add_argument("--micro", type=int, default=2, help="rows per micro-batch per process")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (constant, no warmup)")
    p.add_argument("--conversations", type=int, default=128, help="chat rows (src/paratrain/testing/sft_data.py)")
    p.add_argument("--hidden", type=int, default=128, help="the Llama's hidden size (4x in the MLP)")
    p.add_argument("--layers", type=int, default=2, help="the Llama's decoder layers")
    p.add_argument("--skip-check", action="store_true", help="leave out the first-step loss comparison")
    p.add_argument("--dry-run", action="store_true", help="1 round of 4 steps, then the loss comparison")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--model-dir", "--tok", "--chat", "--out", "--result"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return trl_worker(args)
    if args.dry_run:
        args.rounds, args.steps = 1, WARMUP + 2
    if args.steps <= WARMUP + 1:
        raise SystemExit(f"--steps must exceed {WARMUP + 1} (the first {WARMUP} are warm-up)")
    env = peer_env()
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(tmp, args, env)
        print(
            f"{len(paths['convs'])} conversations (x{paths['repeat']} for timing), Llama hidden {args.hidden}"
            f" x {args.layers} layers; global batch {args.batch} rows of {BLOCK}, micro {args.micro}, world 2",
            flush=True,
        )
        ratios, ours, theirs = [], [], []
        for r in range(args.rounds):
            order = ("paratrain", "trl") if r % 2 == 0 else ("trl", "paratrain")
            got = {}
            for tool in order:
                out = os.path.join(tmp, f"{tool}{r}")
                if tool == "paratrain":
                    corpus = paths["corpus_chat_timing"]
                    got[tool] = run_paratrain(paths, corpus, out, args.batch, args.micro, args.steps, args, env)
                else:
                    chat = paths["chat_timing"]
                    got[tool] = run_trl(paths, chat, out, args.batch, args.micro, args.steps, args, env)
            a, b = got["paratrain"]["step_s"], got["trl"]["step_s"]
            ours.append(a)
            theirs.append(b)
            ratios.append(a / b)
            print(
                f"round {r}: paratrain {a * 1e3:.1f} ms/step, TRL {b * 1e3:.1f} ms/step"
                f" (begin->end {got['trl']['inner_s'] * 1e3:.1f}), ratio {ratios[-1]:.3f}",
                flush=True,
            )
        mine, other = statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3
        print(f"median step: paratrain {mine:.1f} ms, TRL {other:.1f} ms")
        print(f"paired ratios: {', '.join(f'{x:.3f}' for x in ratios)} (min {min(ratios):.3f}, max {max(ratios):.3f})")
        print(summary_line("ratio paratrain/TRL", ratios))
        if not args.skip_check:
            correctness(paths, tmp, args, env)


if __name__ == "__main__":
    main()
