"""Bitwise before/after check of the training step: short runs through the CLI, their per-step
figures in one JSON file, and a comparison of two such files for exact equality.

A refactor of the step (step.py, objectives/, loss.py, the pipeline's loss plumbing) must not
move a single bit of what a run computes. ``record`` runs a fixed set of 25 tiny runs, each with
``paratrain train CONFIG --nproc-per-node 2 --set ...`` (2 to 5 steps):

- layouts: the main job (configs/main.toml, 5 steps and a validation); configs/debug.toml with
  DDP (accumulation, clipping), FSDP2, TP, 1F1B, ring CP, the chunked loss (alone and with TP), a
  user ``(sum, count)`` loss; the GPT's mixture of experts with EP x FSDP2, 1F1B, TP, CP;
- tiny HF models: packed SFT (alone and CP 2), LoRA, Qwen3-MoE (DDP, 1F1B with activation
  checkpointing);
- objectives (plain SGD, micro-batches that accumulate): DPO against a reference model directory,
  KTO on unpaired rows (its KL estimate > 0, so z0 counts), a reward model (``model.head =
  'score'``), distillation from a Llama teacher at temperature 1.5, GRPO (two generation rounds,
  the k3 KL, clipping at step 2; every completion of ``rollouts.jsonl`` kept: tokens, text,
  reward, advantage), BatchNorm over groups of 8 that span both ranks (a toy CNN, the validation
  reading the running statistics), code search (configs/code_search.toml cut small: in-batch
  negatives over the global batch).

It keeps every number each step logs that the step computes (``loss``, ``grad_norm``,
``aux_loss``, the tokens per expert, ``val_loss``, the objectives' columns: STEP_KEYS);
``compare`` says which differ, by ``==`` on the JSON floats (exact: Python writes a float's
shortest round-tripping repr), and compares the rollouts row for row.

The code under test is the ``paratrain`` that ``--tree``'s ``src`` holds (put first on
PYTHONPATH of the launcher and its workers; the file also records where the package was imported
from, so a run of the wrong tree shows). The inputs (tiny Llama, Qwen2 and Qwen3-MoE models,
prepared conversations, pairs, unpaired rows, prompts) are made once in ``--fixtures`` by the
first recording's tree and shared by later ones, so only the step's code differs. A record that
finds the folder empty makes them with its own tree; if that tree's data code (data/prepare.py,
paratrain/testing/) changed since the baseline, record the baseline's commit again first.

The baseline of the objectives' restructuring ("Objectives as complete plug-ins") is
``benchmarks/parallel/bitwise_before_plugins.json``, recorded at commit 938bdd6 with the default
fixtures (/tmp/paratrain_bitwise); the set takes about 6 minutes here (2 cores, shared with
other test runs: 5 min 44 s and 6 min 39 s). Check a change against it::

    .venv/bin/python benchmarks/parallel/bitwise_runs.py record --tree . --out /tmp/after.json
    .venv/bin/python benchmarks/parallel/bitwise_runs.py compare benchmarks/parallel/bitwise_before_plugins.json /tmp/after.json

or record another commit first (``git worktree add /tmp/before COMMIT``, then ``record --tree
/tmp/before --out /tmp/before.json``). Not a speed figure: the runs are tiny and the step times
are not recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

# Per-step keys that are pure functions of the math (not of the clock or the memory).
STEP_KEYS = (
    "loss",
    "grad_norm",
    "val_loss",
    "aux_loss",
    "expert_tokens_min",
    "expert_tokens_max",
    "expert_imbalance",
    "trainable_tokens",
    "tokens",
    "items",
    "lr",
    "global_batch_size",
    # the objectives' own columns: preference, reward model, KTO, distillation, GRPO, code search
    "rewards_chosen",
    "rewards_rejected",
    "reward_margin",
    "reward_accuracy",
    "kto_kl",
    "student_ce",
    "reward",
    "reward_std",
    "reward_byte_mix",
    "completion_length",
    "clip_ratio",
    "kl",
    "logp_gap",
    "val_recall_at_1",
    "val_mrr",
)

QUIET = ["run.progress=false", "metrics.plot=false"]
DEBUG = "configs/debug.toml"
GPT_MOE = "model.args.moe={n_experts = 4, top_k = 2, n_shared_experts = 1, aux_loss_weight = 0.1}"


def runs(fixtures: str, toy_module: str = "paratrain.testing.toy") -> dict[str, tuple[str, list[str]]]:
    """name -> (config, --set overrides); every run on 2 processes."""
    short = ["run.steps=4", *QUIET]
    llama, sft = f"{fixtures}/llama", f"{fixtures}/sft_train"
    empty = f"{fixtures}/empty.toml"  # every key at its default but those set
    toy = [
        f"data.factory='{toy_module}:toy_lm'",
        "data.args={n = 32, seq_len = 16, vocab = 128}",
        "batch.global_batch_size=8",
    ]
    q3 = ["run.steps=3", *QUIET]
    tok = f"{fixtures}/tok"
    pref = [  # 16 preference pairs, one per row, 8 a step
        f"model.hf='{fixtures}/policy'",
        "data.name='tokens'",
        f"data.args={{path = '{fixtures}/pairs', block_size = 512}}",
        "loss.name='preference'",
        "batch.global_batch_size=8",
        "batch.micro_batch_size=2",
    ]
    hf_sgd = ["optim.name='sgd'", "optim.lr=0.1", "optim.beta1=0", "optim.weight_decay=0", "optim.grad_clip=0"]
    return {
        # The main job, cut to 5 steps, with one validation at the end (the eval step).
        "main_ddp": ("configs/main.toml", ["run.steps=5", "eval.interval=5", "eval.samples=64", *QUIET]),
        "debug_fsdp": (DEBUG, ["parallel.dp_shard=2", *short]),
        "debug_ddp_acc2_clip": (DEBUG, ["optim.grad_clip=0.5", "eval.interval=2", "eval.samples=16", *short]),
        "debug_tp2": (DEBUG, ["parallel.tp=2", *short]),
        "debug_pp2_1f1b": (DEBUG, ["parallel.pp=2", "parallel.pp_schedule='1f1b'", *short]),
        "debug_cp2_ring": (DEBUG, ["parallel.cp=2", "parallel.cp_attention='ring'", *short]),
        "debug_chunked_loss": (DEBUG, ["loss.chunk_size=24", *short]),
        "debug_chunked_loss_tp2": (DEBUG, ["loss.chunk_size=24", "parallel.tp=2", *short]),
        # A user (sum, count) loss: the counted (not static) path with its count all-reduce. It is
        # a mean of micro-batch means, which the start-of-run layout probe stops where it exists
        # (record adds run.layout_dependent = true for a tree that knows the key).
        "debug_user_loss": (DEBUG, [f"loss.name='{toy_module}:mean_of_means'", *short]),
        "moe_ep2_fsdp": (DEBUG, [GPT_MOE, "parallel.dp_shard=2", "parallel.ep=2", *short]),
        "moe_pp2_1f1b": (DEBUG, [GPT_MOE, "parallel.pp=2", "parallel.pp_schedule='1f1b'", *short]),
        "moe_tp2": (DEBUG, [GPT_MOE, "parallel.tp=2", *short]),
        "moe_cp2": (DEBUG, [GPT_MOE, "parallel.cp=2", *short]),
        # Fine-tuning: packed conversations (assistant-only loss) and LoRA on a tiny HF Llama.
        "hf_sft_packed": (
            empty,
            [
                f"model.hf='{llama}'",
                "data.name='tokens'",
                f"data.args={{path = '{sft}', block_size = 256}}",
                "batch.global_batch_size=4",
                "batch.micro_batch_size=1",
                *hf_sgd,
                "run.steps=3",
                *QUIET,
            ],
        ),
        "hf_sft_packed_cp2": (
            empty,
            [
                f"model.hf='{llama}'",
                "data.name='tokens'",
                f"data.args={{path = '{sft}', block_size = 256}}",
                "batch.global_batch_size=4",
                "batch.micro_batch_size=2",
                "parallel.cp=2",
                *hf_sgd,
                "run.steps=3",
                *QUIET,
            ],
        ),
        # A mixture of experts in a transformers model (Qwen3-MoE), alone and over 2 pipeline
        # stages with activation checkpointing (the stages find their routers by name).
        "hf_moe_ddp": (empty, [f"model.hf='{fixtures}/qwen3_moe'", *toy, "batch.micro_batch_size=2", *hf_sgd, *q3]),
        "hf_moe_pp2_ac": (
            empty,
            [
                f"model.hf='{fixtures}/qwen3_moe'",
                *toy,
                "batch.micro_batch_size=4",
                "parallel.pp=2",
                "parallel.pp_schedule='1f1b'",
                "parallel.activation_checkpointing='full'",
                *hf_sgd,
                *q3,
            ],
        ),
        "hf_lora": (
            empty,
            [
                f"model.hf='{llama}'",
                f"data.factory='{toy_module}:toy_lm'",
                "data.args={n = 32, seq_len = 16, vocab = 128}",
                "batch.global_batch_size=8",
                "batch.micro_batch_size=2",
                "model.lora.r=4",
                "model.lora.alpha=8",
                "model.lora.target_modules=['q_proj', 'v_proj', 'mlp.*_proj']",
                "model.lora.modules_to_save=['lm_head']",
                *hf_sgd,
                "run.steps=3",
                *QUIET,
            ],
        ),
        # Objectives beyond the token loss, on tiny Qwen2s (tests/distributed/test_preference.py,
        # test_distill.py, test_grpo.py): micro-batches of 2 on 2 ranks, so each step accumulates 2.
        "dpo": (empty, [*pref, f"preference.reference='{fixtures}/ref'", *hf_sgd, "run.steps=2", *QUIET]),
        "kto": (
            empty,
            [
                *pref,
                # the models swapped: the KL estimate is then > 0, so z0 is not clamped to 0
                f"model.hf='{fixtures}/ref'",
                f"data.args={{path = '{fixtures}/unpaired', block_size = 512}}",
                "preference.loss_type='kto'",
                f"preference.reference='{fixtures}/policy'",
                *hf_sgd,
                "run.steps=2",
                *QUIET,
            ],
        ),
        "reward_model": (
            empty,
            [*pref, f"model.hf='{fixtures}/rm'", "model.head='score'", "loss.name='reward'", *hf_sgd, *q3],
        ),
        "distill": (
            empty,
            [
                f"model.hf='{fixtures}/policy'",
                "data.name='tokens'",
                f"data.args={{path = '{sft}', block_size = 512}}",
                "loss.name='distill'",
                f"distill.teacher='{fixtures}/teacher'",
                "distill.temperature=1.5",
                "batch.global_batch_size=4",
                "batch.micro_batch_size=1",
                *hf_sgd,
                "run.steps=2",
                *QUIET,
            ],
        ),
        # GRPO: record also keeps rollouts.jsonl (every completion's tokens, text, reward and
        # advantage); 4 steps are two generation rounds, lr 2 so that step 2 clips.
        "grpo": (
            empty,
            [
                f"model.hf='{fixtures}/policy'",
                "data.name='prompts'",
                f"data.args={{path = '{fixtures}/prompts.jsonl', tokenizer = '{tok}', max_prompt_length = 40}}",
                "loss.name='grpo'",
                "rl.group_size=4",
                "rl.max_new_tokens=5",
                "rl.temperature=0.8",
                "rl.beta=0.05",
                "rl.steps_per_generation=2",
                "rl.rewards=['paratrain.testing.rl_data:byte_mix']",
                "batch.global_batch_size=8",
                "batch.micro_batch_size=2",
                *hf_sgd,
                "optim.lr=2.0",
                "run.steps=4",
                *QUIET,
            ],
        ),
        # BatchNorm over groups of 8 samples (tests/distributed/test_batch_math.py): micro-batches of
        # 4 on 2 ranks, so every group spans both ranks; the validation at the end reads the
        # running statistics.
        "batchnorm_groups": (
            empty,
            [
                f"model.factory='{toy_module}:bn_cnn'",
                f"data.factory='{toy_module}:images'",
                f"data.val_factory='{toy_module}:images'",
                "batch.global_batch_size=32",
                "batch.micro_batch_size=4",
                "batch.norm_group=8",
                "eval.interval=3",
                "eval.samples=32",
                *hf_sgd,
                *q3,
            ],
        ),
        # Code search cut small: in-batch negatives over the global batch (the gradient cache).
        "code_search": (
            "configs/code_search.toml",
            [
                "model.args={dim = 16, n_layer = 1, n_head = 2, d_model = 32, block_size = 32}",
                "data.args={seq_len = 32, max_files = 60}",
                "batch.global_batch_size=16",
                "batch.micro_batch_size=4",
                "eval.interval=2",
                "eval.samples=32",
                "checkpoint.at_end=false",
                "run.steps=2",
                *QUIET,
            ],
        ),
    }


def make_fixtures(fixtures: str, tree: str) -> None:
    """A tiny Llama of the chat tokenizer's vocabulary and 24 prepared conversations (the inputs
    of tests/distributed/test_sft.py), a tiny Qwen3-MoE with untied embeddings (pipeline parallel refuses
    tied ones), and the objectives' inputs (test_preference.py, test_distill.py, test_grpo.py),
    made once; made with ``tree``'s code, then only read."""
    os.makedirs(fixtures, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{tree}/src:{tree}"}  # the tree's paratrain (and its tests/)
    if not os.path.exists(f"{fixtures}/qwen3_moe/done"):
        moe = f"""
try:
    from paratrain.testing.hf_models import save_tiny
except ImportError:  # a tree from before paratrain.testing: the helpers sat in tests/
    from tests.hf_models import save_tiny
save_tiny("qwen3_moe", {fixtures + "/qwen3_moe"!r}, tie_word_embeddings=False)
open({fixtures + "/qwen3_moe/done"!r}, "w").close()
"""
        subprocess.run([sys.executable, "-c", moe], check=True, cwd=tree, env=env)
    script = f"""
from paratrain.data.prepare import prepare
try:
    from paratrain.testing.hf_models import save_tiny
    from paratrain.testing.sft_data import VOCAB, save_chat_tokenizer, stdlib_conversations, write_jsonl
except ImportError:  # a tree from before paratrain.testing: the helpers sat in tests/
    from tests.hf_models import save_tiny
    from tests.sft_data import VOCAB, save_chat_tokenizer, stdlib_conversations, write_jsonl
root = {fixtures!r}
tok = save_chat_tokenizer(root + "/tok")
chat = write_jsonl(root + "/chat.jsonl", stdlib_conversations(24))
save_tiny("llama", root + "/llama", vocab_size=VOCAB, max_position_embeddings=512)
prepare([chat], out_dir=root + "/sft_train", tokenizer=tok, fmt="chat", val_fraction=0, progress=False)
open(root + "/empty.toml", "w").close()
open(root + "/done", "w").close()
"""
    if not os.path.exists(f"{fixtures}/done"):
        subprocess.run([sys.executable, "-c", script], check=True, cwd=tree, env=env)
    # The objectives' inputs, as their tests make them: 16 preference pairs (and KTO's unpaired form
    # of them), a policy and a reference model, a reward model, a teacher, 16 GRPO prompts.
    objectives = f"""
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification
from paratrain.data.prepare import prepare
from paratrain.testing.hf_models import ARCHS, save_tiny
from paratrain.testing.rl_data import addition_rows
from paratrain.testing.sft_data import VOCAB, preference_pairs, write_jsonl
root, tok = {fixtures!r}, {fixtures + "/tok"!r}
tiny = dict(vocab_size=VOCAB, max_position_embeddings=512)
save_tiny("qwen2", root + "/policy", seed=0, **tiny)
save_tiny("qwen2", root + "/ref", seed=1, **tiny)
save_tiny("llama", root + "/teacher", seed=3, hidden_size=64, intermediate_size=128, **tiny)
args = {{**ARCHS["qwen2"], **tiny, "num_labels": 1}}
config = AutoConfig.for_model(args.pop("model_type"), pad_token_id=256, **args)
torch.manual_seed(2)
AutoModelForSequenceClassification.from_config(config).save_pretrained(root + "/rm")
rows = preference_pairs(16)
pairs = write_jsonl(root + "/pairs.jsonl", rows)
prepare([pairs], out_dir=root + "/pairs", tokenizer=tok, fmt="preference", val_fraction=0, progress=False)
unpaired = [
    {{"prompt": r["prompt"], "completion": r["chosen" if i % 2 == 0 else "rejected"], "label": i % 2 == 0}}
    for i, r in enumerate(rows)
]
unpaired = write_jsonl(root + "/unpaired.jsonl", unpaired)
prepare([unpaired], out_dir=root + "/unpaired", tokenizer=tok, fmt="unpaired", val_fraction=0, progress=False)
write_jsonl(root + "/prompts.jsonl", addition_rows(16, conversational=True))
open(root + "/objectives_done", "w").close()
"""
    if not os.path.exists(f"{fixtures}/objectives_done"):
        subprocess.run([sys.executable, "-c", objectives], check=True, cwd=tree, env=env)


def record(tree: str, out: str, fixtures: str, only: list[str] | None, nproc: int) -> None:
    tree = os.path.abspath(tree)
    fixtures = os.path.abspath(fixtures)
    make_fixtures(fixtures, tree)
    env = {**os.environ, "PYTHONPATH": f"{tree}/src:{tree}", "OMP_NUM_THREADS": "1"}
    where = subprocess.run(
        [sys.executable, "-c", "import paratrain; print(paratrain.__file__)"],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not where.startswith(tree + "/src/"):
        raise SystemExit(f"paratrain imported from {where}, not from {tree}/src")
    cli = os.path.join(os.path.dirname(sys.executable), "paratrain")
    result = {"tree": tree, "paratrain_file": where, "commit": _commit(tree), "runs": {}}
    if only and os.path.exists(out):  # more runs into an earlier recording of the same tree
        earlier = json.load(open(out))
        if earlier["paratrain_file"] != where:
            raise SystemExit(f"{out} was recorded with {earlier['paratrain_file']}, not {where}")
        result["runs"] = earlier["runs"]
    root = os.path.join(fixtures, "runs", os.path.basename(out).removesuffix(".json"))
    # A tree from before paratrain.testing kept the toy factories in tests/toy.py: the same code.
    toy_module = "paratrain.testing.toy" if os.path.exists(f"{tree}/src/paratrain/testing/toy.py") else "tests.toy"
    for name, (config, sets) in runs(fixtures, toy_module).items():
        if only and name not in only:
            continue
        out_dir = os.path.join(root, name)
        shutil.rmtree(out_dir, ignore_errors=True)  # a fresh run, never a refused or resumed one
        if name == "debug_user_loss" and "layout_dependent" in open(f"{tree}/src/paratrain/config.py").read():
            sets = [*sets, "run.layout_dependent=true"]
        cmd = [cli, "train", config, "--nproc-per-node", str(nproc), "--set", f"run.out_dir='{out_dir}'"]
        for s in sets:
            cmd += ["--set", s]
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
        steps = []
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            for line in f:
                row = json.loads(line)
                steps.append({k: row[k] for k in ("step", *STEP_KEYS) if k in row})
        result["runs"][name] = {"config": config, "set": sets, "steps": steps}
        if os.path.exists(os.path.join(out_dir, "rollouts.jsonl")):  # GRPO: every completion, token for token
            with open(os.path.join(out_dir, "rollouts.jsonl")) as f:
                result["runs"][name]["rollouts"] = [json.loads(line) for line in f]
        print(f"{name}: {len(steps)} steps, loss {[s.get('loss') for s in steps]} ({time.time() - t0:.0f} s)")
        with open(out, "w") as f:  # after each run: a partial file is still readable
            json.dump(result, f, indent=1)


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    print(f"A: {a['paratrain_file']} ({a['commit']})\nB: {b['paratrain_file']} ({b['commit']})")
    bad = 0
    for name in sorted(set(a["runs"]) | set(b["runs"])):
        if name not in a["runs"] or name not in b["runs"]:
            print(f"{name}: only in {'A' if name in a['runs'] else 'B'}")
            bad += 1
            continue
        sa, sb = a["runs"][name]["steps"], b["runs"][name]["steps"]
        diffs = [
            f"step {x.get('step')} {k}: {x.get(k)!r} != {y.get(k)!r}"
            for x, y in zip(sa, sb, strict=False)
            for k in sorted(set(x) | set(y))
            if x.get(k) != y.get(k)
        ]
        if len(sa) != len(sb):
            diffs.append(f"{len(sa)} steps != {len(sb)} steps")
        ra, rb = a["runs"][name].get("rollouts"), b["runs"][name].get("rollouts")
        if ra != rb:
            first = next((i for i, (x, y) in enumerate(zip(ra or [], rb or [])) if x != y), None)
            diffs.append(f"rollouts differ: {len(ra or [])} vs {len(rb or [])} rows, first differing row {first}")
        keys = sorted({k for s in sa for k in s} - {"step"})
        rollouts = f", {len(ra)} rollouts" if ra else ""
        print(f"{name}: {'bitwise equal' if not diffs else 'DIFFERS'} ({len(sa)} steps{rollouts}; {', '.join(keys)})")
        for d in diffs[:10]:
            print("   ", d)
        bad += bool(diffs)
    print(f"{'all runs bitwise equal' if not bad else f'{bad} run(s) differ'}")
    return 1 if bad else 0


def _commit(tree: str) -> str:
    head = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "src"], capture_output=True, text=True)
    return head.stdout.strip() + (" + uncommitted src changes" if dirty.stdout.strip() else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run the set with --tree's code and write the per-step figures")
    r.add_argument("--tree", default=".", help="checkout whose src/ and configs/ are run (default .)")
    r.add_argument("--out", required=True, help="JSON file to write")
    r.add_argument("--fixtures", default="/tmp/paratrain_bitwise", help="tiny model and data, made once")
    r.add_argument("--only", nargs="*", help="run only these names")
    r.add_argument("--nproc", type=int, default=2)
    c = sub.add_parser("compare", help="exit 0 when two recordings are bitwise equal")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args()
    if args.cmd == "record":
        record(args.tree, args.out, args.fixtures, args.only, args.nproc)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
