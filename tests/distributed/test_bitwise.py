"""run.bitwise (issue 59, docs/bitwise.md): the same weights bit for bit, zero tolerance, on one
process, with accumulation and under DDP, FSDP2 and HSDP, after AdamW steps (where rounding
otherwise grows); the validation loss too."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from safetensors.torch import load_file

from paratrain.testing.dist_utils import read_metrics, run_ranks, train_layouts, train_rank

TOY = [
    "model.args={n_layer = 2, n_head = 2, d_model = 32, block_size = 16, vocab_size = 32}",
    "data.factory='paratrain.testing.toy:toy_lm'",
    "data.args={n = 64, seq_len = 16, vocab = 32}",
    "batch.global_batch_size=16",
    "run.steps=6",
    "run.progress=false",
    "metrics.plot=false",
    # AdamW with decay and momentum, clipping on: the case where float32 differences grow.
    "optim.lr=1e-2",
    "optim.weight_decay=0.1",
    "optim.grad_clip=1.0",
    "optim.warmup_steps=1",
    # Validation after steps 3 and 6 on 32 samples, at each layout's own micro-batch.
    "eval.interval=3",
    "eval.samples=32",
    "data.val_factory='paratrain.testing.toy:toy_lm'",  # the training samples: what is checked is the sums
    "checkpoint.interval=6",  # the last step's optimiser state, compared too
]
BITWISE = ["run.bitwise=true", "run.bitwise_grain=2"]
FSDP2 = "parallel.dp_shard=2"
# A dual encoder with group BatchNorm (groups of 2: one per grain; its running statistics added in
# global group order), a learnable logit scale (an output shared by every row) and info_nce over the
# global batch (the gradient cache: the outputs gathered in global order), validation too.
DUAL = [
    *TOY,
    *BITWISE,
    "batch.norm_group=2",
    "model.factory='paratrain.testing.toy:dual_encoder'",
    "model.args={scale = true}",
    "data.factory='paratrain.testing.toy:pairs'",
    "data.args={}",
    "data.val_factory='paratrain.testing.toy:pairs'",
    "eval.samples=16",
    "loss.name='info_nce'",
]


def read_run(out: str) -> dict:
    """A finished run's logged values, its weights, and the optimiser state of its last checkpoint
    (AdamW's step, exp_avg and exp_avg_sq per parameter, whole: DCP's shards merged by torch's own
    dcp_to_torch_save; empty without a checkpoint)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    rows = read_metrics(out)
    optim = {}
    steps = sorted(glob.glob(os.path.join(out, "checkpoints", "step-*")), key=lambda p: int(p.rsplit("-", 1)[1]))
    if steps:
        dcp_to_torch_save(steps[-1], os.path.join(out, "last.pt"))
        optim = torch.load(os.path.join(out, "last.pt"), weights_only=False)["optim"]
    return {
        "losses": [r["loss"] for r in rows],
        "grad_norm": [r["grad_norm"] for r in rows],
        "items": [r.get("items", r.get("tokens")) for r in rows],
        "val_loss": [r["val_loss"] for r in rows if "val_loss" in r],
        "weights": load_file(os.path.join(out, "model.safetensors")),
        "optim": optim,
    }


def run_layout(root, name: str, world: int, micro: int, extra=()) -> dict:
    out = str(root / name)
    summaries = run_ranks(train_rank, world, [*TOY, f"batch.micro_batch_size={micro}", *extra, f"run.out_dir='{out}'"])
    return {**read_run(out), "accum": summaries[0]["batch"]["accum_steps"]}


def run_group(root, world: int, runs: dict[str, list[str]]) -> dict[str, dict]:
    """Runs ``{name: overrides}`` one after another in one launch of ``world`` ranks (a process
    start and its imports per launch, not per run: the test tiers' time)."""
    run_ranks(train_layouts, world, runs, str(root))
    return {n: {**read_run(str(root / n)), "accum": read_metrics(str(root / n))[0]["accum_steps"]} for n in runs}


def differences(a: dict, b: dict) -> list[str]:
    """What is not bitwise equal between two runs (empty: all of it is), the optimiser state too."""
    bad = [k for k in ("losses", "grad_norm", "items", "val_loss") if a[k] != b[k]]
    bad += [k for k in a["weights"] if not torch.equal(a["weights"][k], b["weights"][k])]
    if a["optim"].keys() != b["optim"].keys():
        return [*bad, "optimiser state keys"]
    return bad + [
        k
        for k, v in a["optim"].items()
        if not (torch.equal(v, b["optim"][k]) if torch.is_tensor(v) else v == b["optim"][k])
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two launches (one process, then world 2), each training its layouts one after another: the
    fast tier's time (6 launches took 21 s, alone on 2 cores). A run carries nothing to the next
    in its process that changes its numbers: the bitwise runs compared across the two launches show it."""
    root = tmp_path_factory.mktemp("bitwise")

    def layout(micro: int, *extra: str) -> list[str]:
        return [*TOY, f"batch.micro_batch_size={micro}", *extra]

    dual = {f"dual-1x{m}": [*DUAL, f"batch.micro_batch_size={m}"] for m in (16, 4)}
    one = {"ref-False": layout(16), "ref-True": layout(16, *BITWISE), "acc-True": layout(4, *BITWISE), **dual}
    dual = {"dual-ddp": [*DUAL, "batch.micro_batch_size=4"], "dual-fsdp": [*DUAL, "batch.micro_batch_size=4", FSDP2]}
    two = {"ddp-False": layout(4), "ddp-True": layout(4, *BITWISE), "fsdp-True": layout(4, *BITWISE, FSDP2), **dual}
    got = {**run_group(root, 1, one), **run_group(root, 2, two)}
    # FSDP2 with the mode only (off, it differs as DDP does).
    names = {"1x16": "ref", "2x4-acc2": "ddp", "1x4-acc4": "acc", "fsdp2x4-acc2": "fsdp"}
    out = {mode: {k: got[f"{v}-{mode}"] for k, v in names.items() if f"{v}-{mode}" in got} for mode in (True, False)}
    out["dual"] = {name: got[f"dual-{name}"] for name in ("1x16", "1x4", "ddp", "fsdp")}
    return out


def test_bitwise_equal_across_layouts(runs):
    ref = runs[True]["1x16"]
    assert runs[True]["1x4-acc4"]["accum"] == 4 and runs[True]["2x4-acc2"]["accum"] == 2
    assert len(ref["val_loss"]) == 2 and any(k.endswith(".exp_avg_sq") for k in ref["optim"])
    for name in ("1x4-acc4", "2x4-acc2", "fsdp2x4-acc2"):
        assert differences(runs[True][name], ref) == [], name
    # Anchored to the default step (itself anchored to plain PyTorch, test_invariance.py): the same
    # gradient to rounding at step 1 and the same loss after it, so a dropped grain or a wrong scale
    # (dp / items), shared by every bitwise layout, fails here.
    off = runs[False]["1x16"]
    for name in ("1x16", "2x4-acc2", "fsdp2x4-acc2"):
        assert runs[True][name]["grad_norm"][0] == pytest.approx(off["grad_norm"][0], rel=1e-5), name
        assert runs[True][name]["losses"][:2] == pytest.approx(off["losses"][:2], rel=1e-5), name


def test_bitwise_batch_norm_and_info_nce(runs):
    ref = runs["dual"]["1x16"]
    assert len(ref["val_loss"]) == 2 and "tower.1.running_mean" in ref["weights"]  # BatchNorm's, compared too
    for name in ("1x4", "ddp", "fsdp"):
        assert differences(runs["dual"][name], ref) == [], name


def test_without_bitwise_the_layouts_differ(runs):
    # Why the mode exists: the same comparison off is not bitwise equal (rounding, grown by AdamW).
    ref = runs[False]["1x16"]
    assert differences(runs[False]["2x4-acc2"], ref)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bitwise_world_4_hsdp_and_resume_at_world_1_with_keyed_dropout(tmp_path):
    """Accumulation 8, DDP and FSDP2 at world 4 and HSDP 2x2 over 50 AdamW steps, and an elastic shrink and grow,
    give the one-process run's bits, with dropout keyed by the sample (run.keyed_random, the default). An elastic
    resize restarts the workers, which resume the newest complete checkpoint at the new world
    size (checkpoint/checkpointer.py): here a FSDP2 world-2 run's step-3 checkpoint resumed at
    world 1 with accumulation 4, whose step-4 checkpoint is resumed at world 2 under DDP."""
    drop = [
        *BITWISE,
        "model.args={n_layer = 2, n_head = 2, d_model = 32, block_size = 16, vocab_size = 32, dropout = 0.1}",
        "checkpoint.interval=3",
    ]
    # The 50 AdamW steps at world 4 (a checkpoint at step 50 only: its optimiser state is compared)
    long = [*drop, "run.steps=50", "eval.interval=25", "checkpoint.interval=50"]

    def layout(micro: int, *extra: str) -> list[str]:
        return [*TOY, f"batch.micro_batch_size={micro}", *long, *extra]

    one = run_group(tmp_path, 1, {"ref50": layout(16), "acc8": layout(2)})
    ref50 = one["ref50"]
    assert len(ref50["losses"]) == 50 and len(ref50["val_loss"]) == 2
    assert one["acc8"]["accum"] == 8 and differences(one["acc8"], ref50) == []
    four = {"w4": layout(2), "fsdp4": layout(4, "parallel.dp_shard=4")}
    four["hsdp"] = layout(2, "parallel.dp_shard=2", "parallel.dp_replicate=2")
    for name, got in run_group(tmp_path, 4, four).items():
        assert differences(got, ref50) == [], name
    ref = run_layout(tmp_path, "ref", 1, 16, drop)
    run_layout(tmp_path, "w2", 2, 8, [*drop, FSDP2])
    src = tmp_path / "w2" / "checkpoints" / "step-3"
    resumed = run_layout(
        tmp_path, "resumed", 1, 4, [*drop, f"checkpoint.resume='{src}'", "checkpoint.interval=1", "checkpoint.keep=0"]
    )
    assert [resumed[k] for k in ("losses", "grad_norm", "items")] == [
        ref[k][3:] for k in ("losses", "grad_norm", "items")
    ]
    assert resumed["val_loss"] == ref["val_loss"][1:]  # after step 6
    assert [k for k in ref["weights"] if not torch.equal(resumed["weights"][k], ref["weights"][k])] == []
    src = tmp_path / "resumed" / "checkpoints" / "step-4"
    grown = run_layout(tmp_path, "grown", 2, 4, [*drop, f"checkpoint.resume='{src}'"])
    assert [grown[k] for k in ("losses", "grad_norm", "items")] == [
        ref[k][4:] for k in ("losses", "grad_norm", "items")
    ]
    assert grown["val_loss"] == ref["val_loss"][1:]
    assert [k for k in ref["weights"] if not torch.equal(grown["weights"][k], ref["weights"][k])] == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bitwise_hf_llama_cnn_dpo_and_kto(tmp_path):
    """The issue's other models: a transformers Llama (embedding, rotary, SDPA, RMSNorm backward)
    and a small CNN (conv backward) with keyed dropout and augmentation drawn in the dataset,
    with accumulation, DDP and FSDP2 at world 2, against one process, 50 AdamW steps (the optimiser state too). And objectives
    with their own terms: DPO against a differing reference (its log-probabilities computed per
    grain) and KTO (its z0 over the global batch, from the rows gathered in order), accumulation
    and DDP at world 2, 3 AdamW steps. One launch per world size."""
    pytest.importorskip("transformers")
    from paratrain.data.prepare import prepare
    from paratrain.testing.hf_models import save_tiny
    from paratrain.testing.sft_data import VOCAB, preference_pairs, save_chat_tokenizer, write_jsonl

    llama = [
        *TOY,
        *BITWISE,
        "run.steps=50",
        "checkpoint.interval=50",
        "eval.interval=25",
        f"model.hf='{save_tiny('llama', str(tmp_path / 'llama'))}'",
        "model.args={}",
        "data.args={n = 64, seq_len = 16, vocab = 128}",
    ]
    cnn = [
        *TOY,
        *BITWISE,
        "run.steps=50",
        "checkpoint.interval=50",
        "eval.interval=0",
        "model.factory='paratrain.testing.toy:small_cnn'",
        "model.args={}",
        "data.factory='paratrain.testing.toy:augmented'",
        "data.args={}",
    ]
    tok = save_chat_tokenizer(str(tmp_path / "tok"))
    corpus = str(tmp_path / "corpus")
    pairs = write_jsonl(str(tmp_path / "pairs.jsonl"), preference_pairs(16))
    prepare([pairs], out_dir=corpus, tokenizer=tok, fmt="preference", val_fraction=0, progress=False)
    # KTO's unpaired rows: the chosen reply of even pairs (desirable), the rejected of odd ones.
    rows = [
        {"prompt": r["prompt"], "completion": r["chosen" if i % 2 == 0 else "rejected"], "label": i % 2 == 0}
        for i, r in enumerate(preference_pairs(16))
    ]
    unpaired = str(tmp_path / "unpaired")
    prepare(
        [write_jsonl(f"{unpaired}.jsonl", rows)],
        out_dir=unpaired,
        tokenizer=tok,
        fmt="unpaired",
        val_fraction=0,
        progress=False,
    )
    tiny = {"vocab_size": VOCAB, "max_position_embeddings": 512}
    dpo = [
        *[t for t in TOY if t.startswith(("optim.", "run.progress", "metrics."))],
        "run.steps=3",
        "batch.global_batch_size=8",
        f"model.hf='{save_tiny('qwen2', str(tmp_path / 'policy'), **tiny, seed=0)}'",
        "data.name='tokens'",
        f"data.args={{path = '{corpus}', block_size = 256}}",
        "loss.name='preference'",
        f"preference.reference='{save_tiny('qwen2', str(tmp_path / 'ref'), **tiny, seed=1)}'",
    ]
    models = {"llama": llama, "cnn": cnn}
    world1, world2 = {}, {}
    for m, sets in models.items():
        world1[f"{m}-1x16"] = [*sets, "batch.micro_batch_size=16"]
        world1[f"{m}-1x4"] = [*sets, "batch.micro_batch_size=4"]
        world2[f"{m}-ddp"] = [*sets, "batch.micro_batch_size=4"]
        world2[f"{m}-fsdp"] = [*sets, "batch.micro_batch_size=4", FSDP2]
    # DPO: global batch 8 in grains of 2 ("1x16" named as the others: its one micro-batch, 8 pairs); the
    # default step at step 1 anchors it (the same loss and gradient).
    world1.update(
        {"dpo-1x16": [*dpo, *BITWISE, "batch.micro_batch_size=8"], "dpo-off": [*dpo, "batch.micro_batch_size=8"]}
    )
    world1["dpo-1x4"] = [*dpo, *BITWISE, "batch.micro_batch_size=4"]
    world2["dpo-ddp"] = [*dpo, *BITWISE, "batch.micro_batch_size=2"]
    # KTO: its reference point z0 (a mean over the global batch) from the rows gathered in order.
    kto = [*dpo, *BITWISE, "preference.loss_type='kto'", f"data.args={{path = '{unpaired}', block_size = 256}}"]
    world1.update({"kto-1x16": [*kto, "batch.micro_batch_size=8"], "kto-1x4": [*kto, "batch.micro_batch_size=4"]})
    world2["kto-ddp"] = [*kto, "batch.micro_batch_size=2"]
    run_ranks(train_layouts, 1, world1, str(tmp_path), timeout=600)
    run_ranks(train_layouts, 2, world2, str(tmp_path), timeout=600)
    for m in (*models, "dpo", "kto"):
        ref = read_run(str(tmp_path / f"{m}-1x16"))
        assert len(ref["losses"]) == (50 if m in models else 3)
        assert len(ref["val_loss"]) == (2 if m == "llama" else 0)
        for layout in ("1x4", "ddp", "fsdp") if m in models else ("1x4", "ddp"):
            assert differences(read_run(str(tmp_path / f"{m}-{layout}")), ref) == [], f"{m}-{layout}"
    on, off = read_run(str(tmp_path / "dpo-1x16")), read_run(str(tmp_path / "dpo-off"))
    assert on["losses"][0] == pytest.approx(off["losses"][0], rel=1e-5)
    assert on["grad_norm"][0] == pytest.approx(off["grad_norm"][0], rel=1e-5)
