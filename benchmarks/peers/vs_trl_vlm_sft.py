"""paratrain's vision-language SFT against TRL's ``SFTTrainer``: the same tiny LLaVA, the same
drawn-image conversations, the same global batch, world 2 on CPU (gloo, torchrun).

Data and model: ``src/paratrain/testing/vlm_models.py``: ``save_tiny_llava`` (a CLIP tower at
28x28 pixels, 4 image tokens per image, its projector, a Llama decoder; random weights, seed 0,
with its processor and a ChatML template with ``{% generation %}`` spans) and ``colour_rows``
(``--conversations`` TRL vision conversations about shapes drawn with Pillow: one image, two, or
none in every fifth row). Both tools: the loss on the assistant tokens only, one conversation per
row, right-padded to the micro-batch's longest (TRL refuses packing and padding-free for vision
data, ``SFTTrainer.__init__``), global batch ``--batch`` conversations (``--micro`` per
micro-batch per process, accumulation filling the rest over 2 processes), AdamW (torch's own, lr
``--lr``, betas (0.9, 0.95), eps 1e-8, no weight decay, no warmup, constant schedule, gradient
norm clipped to 1.0), float32, SDPA attention, the vision tower trained, no activation
checkpointing:

- paratrain: ``paratrain prepare --format chat --tokenizer MODEL`` (the processor's expansion,
  pixels stored beside the shards) then ``paratrain train --nproc-per-node 2`` with ``model.hf``,
  ``data.name = 'tokens'`` (block_size 128, packing ``padded``), ``parallel.dp_replicate = 2``.
- TRL 1.16: ``SFTTrainer(model, SFTConfig(assistant_only_loss=True, ...), processing_class=
  processor)`` under ``torchrun --nproc-per-node 2`` with the conversations and their PIL images
  in a ``datasets.Dataset`` (a text row's string content as one text part: Arrow cannot mix
  strings and part lists in a column; the template renders both alike); ``DataCollatorForVisionLanguageModeling`` renders and processes each
  micro-batch on the fly (``processor.apply_chat_template(..., return_assistant_tokens_mask=True)``),
  ``ddp_find_unused_parameters=True`` (TRL's own default for a VLM: a text-only micro-batch leaves
  the vision tower without gradients). Its loss: the fused LM head's token losses summed over
  ``num_items_in_batch``, the step's target count over every micro-batch and rank
  (``average_tokens_across_devices``).

The worker checks TRL's world (2, gloo), micro-batch and accumulation, and that every optimiser
step saw ``--batch`` conversations (counted at ``compute_loss``); paratrain's metrics rows must
show world 2, the global batch, micro-batch and accumulation. Any other count voids the run.

Timing: each run's step time is the median difference of consecutive optimiser steps' ends after
the first ``WARMUP`` steps (paratrain's metrics rows' ``time``; TRL's ``on_step_end``), the
conversations repeated so one epoch holds every step. Runs alternate (paratrain, TRL, TRL,
paratrain, ...); the paired ratio paratrain/TRL of each round is the observation, summarised by
``paired.summary_line``: median and the 95% CI of the geometric mean (below 1: paratrain is
faster). Results in ``vs_trl_vlm_sft.json`` next to this script.

The loss question: each tool runs ONE step over the first ``--check-batch`` conversations as one
global batch, at each micro-batch size of ``--check-micro`` (same global batch and world 2, so
accumulation changes with it); the step-1 loss and ``grad_norm`` (before clipping) of each run.
paratrain's must not move with the micro-batch (the global-token mean); whether TRL's does is
what is measured. Packing: TRL refuses it for vision data, so only the micro-batch is compared.

Measured: docs/vision-language.md ("Against TRL") and ``vs_trl_vlm_sft.json``.

    python benchmarks/peers/vs_trl_vlm_sft.py --rounds 6     # paired rounds, then the loss question
    python benchmarks/peers/vs_trl_vlm_sft.py --quick        # 1 round of 4 steps and the check, no JSON

Needs ``pip install trl`` (1.16 was measured) in the same environment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from paratrain.testing.paired import summary_line
from paratrain.testing.peers import (
    WARMUP,
    check_paratrain_rows,
    check_trl_gloo,
    check_trl_steps,
    gather,
    launch_trl,
    paired_rounds,
    parse_peer_args,
    peer_env,
    run,
    script_parser,
    steady,
    step_timer,
    train_paratrain,
    trl_optim_kwargs,
    trl_run_kwargs,
    write_trl_result,
)

RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vs_trl_vlm_sft.json")
PROCS = 2
BLOCK = 128  # the longest conversation (two images) is well under it


# ----------------------------------------------------------------------------- TRL worker


def trl_worker(args) -> None:
    """One rank of the TRL run (started by torchrun)."""
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(1)
    folder = os.path.dirname(args.rows_file)
    with open(args.rows_file) as f:
        rows = [json.loads(line) for line in f]
    for r in rows:  # TRL's collator takes PIL images; a text row gets an empty list
        r["images"] = [Image.open(os.path.join(folder, p)).convert("RGB") for p in r.get("images", [])]
        for m in r["messages"]:  # Arrow cannot mix string and list contents in one column: a string
            if isinstance(m["content"], str):  # becomes one text part, which the template renders alike
                m["content"] = [{"type": "text", "text": m["content"]}]
    micro, accum, steps = args.micro, args.accum, args.steps

    class Counted(SFTTrainer):
        """SFTTrainer that records the conversations and the step's target count of each micro-batch."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.micro.append(int(inputs["input_ids"].shape[0]))
            self.items.append(int(num_items_in_batch) if num_items_in_batch is not None else -1)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    config = SFTConfig(
        output_dir=args.out,
        max_steps=steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        **trl_optim_kwargs(args.lr),
        use_cpu=True,
        ddp_backend="gloo",
        bf16=False,  # TRL's default is bf16 mixed precision; paratrain runs float32 here
        ddp_find_unused_parameters=True,  # TRL's default for a VLM: text-only micro-batches
        assistant_only_loss=True,
        packing=False,  # refused for vision data by TRL 1.16
        max_length=BLOCK,
        dataloader_drop_last=True,
        **trl_run_kwargs(),
    )
    timer = step_timer()
    model = AutoModelForImageTextToText.from_pretrained(args.model, attn_implementation="sdpa", dtype=torch.float32)
    trainer = Counted(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoProcessor.from_pretrained(args.model),
        callbacks=[timer],
    )
    trainer.micro, trainer.items = [], []
    timer.trainer = trainer
    world = check_trl_gloo(trainer, procs=PROCS, micro=micro, accum=accum)
    trainer.train()
    everyone, logs = check_trl_steps(trainer, timer, steps=steps, micro=micro, accum=accum, world=world)
    items = gather(trainer.items)
    if dist.get_rank() == 0:
        result = {
            "step_s": steady(timer.end) if steps > WARMUP + 1 else None,
            "losses": [h["loss"] for h in logs],
            "grad_norms": [h["grad_norm"] for h in logs],
            "per_step": [sum(map(sum, s)) for s in zip(*everyone)],
            "num_items_in_batch": items[0][:accum],  # step 1's target count as TRL normalises by it
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
        f"parallel.dp_replicate={PROCS}",
        f"batch.global_batch_size={batch}",
        f"batch.micro_batch_size={micro}",
    ]
    rows = train_paratrain(out, sets, env, procs=PROCS, steps=steps, lr=args.lr)
    check_paratrain_rows(rows, steps=steps, procs=PROCS, batch=batch, micro=micro)
    return {
        "step_s": steady([r["time"] for r in rows]) if steps > WARMUP + 1 else None,
        "losses": [r["loss"] for r in rows],
        "grad_norms": [r["grad_norm"] for r in rows],
        "items": [r.get("items") for r in rows],
    }


def run_trl(paths: dict, rows_file: str, out: str, batch: int, micro: int, steps: int, args, env) -> dict:
    os.makedirs(out, exist_ok=True)
    accum = batch // (PROCS * micro)
    argv = ["--model", paths["model"], "--rows-file", rows_file, "--out", out]
    argv += ["--lr", str(args.lr), "--steps", str(steps), "--micro", str(micro), "--accum", str(accum)]
    got = launch_trl(__file__, argv, env, procs=PROCS, result=os.path.join(out, "trl.json"))
    if got["world"] != PROCS or any(n != batch for n in got["per_step"]):
        raise SystemExit(f"TRL ran at world {got['world']} with {got['per_step']} conversations per step: void")
    return got


# ----------------------------------------------------------------------------- data


def build(tmp: str, args, env: dict) -> dict:
    """The tiny LLaVA, the drawn conversations (all, repeated for timing; the first --check-batch
    for the loss question), paratrain's corpora of each."""
    from paratrain.testing.sft_data import write_jsonl
    from paratrain.testing.vlm_models import colour_rows, save_tiny_llava

    paths = {"model": save_tiny_llava(os.path.join(tmp, "model"), seed=0)}
    rows = colour_rows(tmp, args.conversations)  # images under tmp/images, paths relative to tmp
    repeat = -(-int(1.2 * args.steps * args.batch) // len(rows))  # one epoch holds every timed step
    paths["repeat"], paths["n"] = repeat, len(rows)
    files = {"timing": rows * repeat, "check": rows[: args.check_batch]}
    for name, chosen in files.items():
        paths[name] = write_jsonl(os.path.join(tmp, f"{name}.jsonl"), chosen)
        out = os.path.join(tmp, "corpus_" + name)
        cmd = [sys.executable, "-m", "paratrain", "prepare", paths[name], "--format", "chat"]
        run(cmd + ["--tokenizer", paths["model"], "--out", out, "--val-fraction", "0"], env)
        paths["corpus_" + name] = out
    return paths


def loss_question(paths: dict, tmp: str, args, env: dict) -> dict:
    """Step 1 over the check conversations at each --check-micro: both tools' loss and grad norm."""
    n, got = args.check_batch, {"paratrain": {}, "TRL": {}}
    for micro in args.check_micro:
        ours = run_paratrain(paths, paths["corpus_check"], os.path.join(tmp, f"p_check{micro}"), n, micro, 1, args, env)
        theirs = run_trl(paths, paths["check"], os.path.join(tmp, f"t_check{micro}"), n, micro, 1, args, env)
        got["paratrain"][micro] = {
            "loss": ours["losses"][0],
            "grad_norm": ours["grad_norms"][0],
            "items": ours["items"][0],
        }
        got["TRL"][micro] = {
            "loss": theirs["losses"][0],
            "grad_norm": theirs["grad_norms"][0],
            "num_items_in_batch": theirs["num_items_in_batch"],
        }
    print(f"step 1 over {n} conversations in one global batch, world {PROCS}, by micro-batch per process:")
    first = args.check_micro[0]
    for tool, by in got.items():
        for micro, v in by.items():
            d_loss = (v["loss"] - by[first]["loss"]) / by[first]["loss"]
            d_norm = (v["grad_norm"] - by[first]["grad_norm"]) / by[first]["grad_norm"]
            extra = {k: v[k] for k in ("items", "num_items_in_batch") if k in v}
            print(
                f"  {tool:<9} micro {micro} (accum {n // (PROCS * micro)}): loss {v['loss']:.9g} ({d_loss:+.1e}),"
                f" grad_norm {v['grad_norm']:.9g} ({d_norm:+.1e}) {extra}"
            )
    return got


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--rounds", type=int, default=6, help="paired rounds (paratrain and TRL once each)")
    p.add_argument("--steps", type=int, default=10, help=f"optimiser steps per run; the first {WARMUP} are warm-up")
    p.add_argument("--batch", type=int, default=16, help="global batch, in conversations")
    p.add_argument("--micro", type=int, default=4, help="conversations per micro-batch per process")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (constant, no warmup)")
    p.add_argument("--conversations", type=int, default=64, help="distinct drawn-image conversations")
    p.add_argument("--check-batch", type=int, default=16, help="the loss question's global batch (its conversations)")
    p.add_argument("--check-micro", type=int, nargs="+", default=[1, 8], help="micro-batch sizes of the loss question")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round of 4 steps and the check, no JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--model", "--rows-file", "--out", "--result"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--accum", type=int, help=argparse.SUPPRESS)
    args = parse_peer_args(p, trl_worker)
    if args is None:  # this process was a TRL rank
        return
    if args.batch % (PROCS * args.micro) or any(args.check_batch % (PROCS * m) for m in args.check_micro):
        raise SystemExit(f"--batch and --check-batch must be multiples of {PROCS} x each micro-batch size")
    env = peer_env(inherit_pythonpath=True)
    got = {k: [] for k in ("ratio", "ours", "theirs", "load")}
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(tmp, args, env)
        accum = args.batch // (PROCS * args.micro)
        setup = (
            f"{paths['n']} drawn-image conversations (x{paths['repeat']} for timing), tiny LLaVA (CLIP 28x28,"
            f" 4 image tokens, Llama hidden 32 x 2 layers); global batch {args.batch} = {PROCS} x micro"
            f" {args.micro} x accumulation {accum}; {PROCS} processes on cpu, float32"
        )
        print(setup, flush=True)
        timing = {"corpus": "corpus_timing", "rows": "timing"}
        for r, res in paired_rounds(args, paths, tmp, env, run_paratrain=run_paratrain, run_trl=run_trl, **timing):
            a, b = res["paratrain"]["step_s"], res["trl"]["step_s"]
            got["ours"].append(a)
            got["theirs"].append(b)
            got["ratio"].append(a / b)
            got["load"].append(os.getloadavg()[0])
            print(
                f"round {r}: paratrain {a * 1e3:.1f} ms/step, TRL {b * 1e3:.1f} ms/step, ratio {a / b:.3f},"
                f" load {got['load'][-1]:.1f}",
                flush=True,
            )
        print(
            f"median step: paratrain {statistics.median(got['ours']) * 1e3:.1f} ms, TRL {statistics.median(got['theirs']) * 1e3:.1f} ms"
        )
        print(summary_line("ratio paratrain/TRL", got["ratio"]))
        check = loss_question(paths, tmp, args, env)
    if args.quick:
        print("--quick: results not written")
        return
    args_out = {k: v for k, v in vars(args).items() if v is not None and k not in ("worker", "quick")}
    write_trl_result(
        RESULT, setup=setup, got=got, args=args_out, ratio_median=statistics.median(got["ratio"]), check=check
    )


if __name__ == "__main__":
    main()
