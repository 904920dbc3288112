"""Preference training (docs/preference.md): DPO and its variants over pairs, exact on every layout.

The anchor is code we did not write: plain ``transformers`` on **each pair alone** (the prompt
and one reply rendered by the chat template, the reply's tokens from transformers' own assistant
mask), the log-probabilities summed from its logits and the loss formula written out here, for
a policy and a reference that differ (so the loss is not log 2). paratrain's first two steps
under plain SGD (loss, and ``grad_norm``: the gradient's size) must equal it, and every layout
(world size, accumulation, FSDP2, tensor parallel) must give the one-process numbers.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

import paratrain
from paratrain.config import load_config
from paratrain.data.prepare import prepare
from paratrain.data.tokens import build_tokens
from paratrain.objectives.preference import PreferenceLoss
from paratrain.testing.dist_utils import paratrain_cli, plain_sgd, read_metrics, run_ranks, sgd_step, train_rank
from paratrain.testing.hf_models import ARCHS, save_tiny
from paratrain.testing.sft_data import VOCAB, preference_pairs, save_chat_tokenizer, write_jsonl

pytest.importorskip("transformers")

SGD = [*plain_sgd(0.5), "run.progress=false", "metrics.plot=false", "data.shuffle=false"]
LORA = ("model.lora.target_modules=['q_proj', 'v_proj']", "model.lora.r=4", "model.lora.alpha=8")
PAIRS = 16


@pytest.fixture(scope="module")
def pref(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref")
    tok = save_chat_tokenizer(str(root / "tok"))
    rows = preference_pairs(PAIRS)
    data = write_jsonl(str(root / "pairs.jsonl"), rows)
    policy = save_tiny("qwen2", str(root / "policy"), vocab_size=VOCAB, max_position_embeddings=512, seed=0)
    ref = save_tiny("qwen2", str(root / "ref"), vocab_size=VOCAB, max_position_embeddings=512, seed=1)
    rm = save_reward_model(str(root / "rm"))
    corpus = str(root / "corpus")
    prepare([data], out_dir=corpus, tokenizer=tok, fmt="preference", val_fraction=0, progress=False)
    val = str(root / "val")  # the same pairs, all in the validation split
    prepare([data], out_dir=val, tokenizer=tok, fmt="preference", val_fraction=1, progress=False)
    return {
        "root": str(root),
        "tok": tok,
        "rows": rows,
        "policy": policy,
        "ref": ref,
        "rm": rm,
        "corpus": corpus,
        "val": val,
    }


def save_reward_model(path: str) -> str:
    """A tiny Qwen2 sequence classifier with one label (a reward model), with weights."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    args = {**ARCHS["qwen2"], "vocab_size": VOCAB, "max_position_embeddings": 512, "num_labels": 1}
    config = AutoConfig.for_model(args.pop("model_type"), pad_token_id=256, **args)
    torch.manual_seed(2)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    return path


def _config(pref: dict, name: str, *extra: str) -> list[str]:
    return [
        f"model.hf='{pref['policy']}'",
        "data.name='tokens'",
        f"data.args={{path = '{pref['corpus']}', block_size = 512}}",
        "loss.name='preference'",
        f"run.out_dir='{pref['root']}/{name}'",
        "batch.global_batch_size=8",
        "run.steps=2",
        *SGD,
        *extra,
    ]


def side_logp(model, tok, prompt: list[dict], reply: list[dict]) -> tuple[torch.Tensor, int]:
    """log pi(reply | prompt) of one side alone: transformers' forward on the rendering, the
    reply's tokens from the template's assistant mask (the prompt holds no assistant turn)."""
    out = tok.apply_chat_template(prompt + reply, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = torch.tensor([out["input_ids"]])
    mask = torch.tensor(out["assistant_masks"])[1:].bool()
    logits = model(input_ids=ids).logits[0, :-1].float()
    token_logp = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    return token_logp[mask].sum(), int(mask.sum())


def anchor(pref: dict, loss_type: str, *, beta: float = 0.1, gamma: float = 0.5, lr: float = 0.5, steps: int = 2):
    """(losses, grad norms) of ``steps`` plain-SGD steps of 8 pairs each, the formula written out."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pref["tok"])
    policy = AutoModelForCausalLM.from_pretrained(pref["policy"], attn_implementation="sdpa")
    ref = AutoModelForCausalLM.from_pretrained(pref["ref"], attn_implementation="sdpa")
    mean = loss_type in ("ipo", "simpo", "orpo")
    losses, norms = [], []
    for step in range(steps):
        terms = []
        for row in pref["rows"][8 * step : 8 * step + 8]:
            sides = []
            for model in (policy, ref):
                with torch.set_grad_enabled(model is policy):
                    (c, nc), (r, nr) = (side_logp(model, tok, row["prompt"], row[k]) for k in ("chosen", "rejected"))
                sides.append((c / nc, r / nr) if mean else (c, r))
            (pc, pr), (rc, rr) = sides
            h = (pc - rc) - (pr - rr)
            if loss_type == "sigmoid":
                terms.append(-F.logsigmoid(beta * h))
            elif loss_type == "ipo":
                terms.append((h - 1 / (2 * beta)) ** 2)
            elif loss_type == "simpo":
                terms.append(-F.logsigmoid(beta * (pc - pr) - gamma))
            elif loss_type == "orpo":  # Hong et al. 2024, the NLL as the chosen reply's mean token NLL
                odds = lambda m: m - torch.log(1 - torch.exp(m))  # noqa: E731
                terms.append(-pc - beta * F.logsigmoid(odds(pc) - odds(pr)))
        loss, norm = sgd_step(policy, torch.stack(terms).mean(), lr)
        losses.append(loss)
        norms.append(norm)
    return losses, norms


def _run(pref: dict, name: str, *extra: str, world: int = 1) -> tuple[list[float], list[float], list[dict]]:
    over = _config(pref, name, *extra)
    if world == 1:
        paratrain.train(load_config(None, over))
    else:
        run_ranks(train_rank, world, over)
    rows = read_metrics(os.path.join(pref["root"], name))
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows], rows


def test_dpo_equals_transformers_on_each_pair_alone(pref):
    """DPO (sigmoid) against a reference model directory: paratrain's first two steps equal the
    written-out formula on transformers' forward of each pair alone."""
    losses, norms = anchor(pref, "sigmoid")
    assert abs(losses[0] - 0.6931) > 1e-3  # the reference differs from the policy
    got_losses, got_norms, rows = _run(pref, "dpo", f"preference.reference='{pref['ref']}'")
    torch.testing.assert_close(got_losses, losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_norms, norms, rtol=1e-5, atol=0)
    assert {"rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy"} <= rows[0].keys()
    assert rows[0]["reward_margin"] == pytest.approx(rows[0]["rewards_chosen"] - rows[0]["rewards_rejected"])


@pytest.mark.parametrize(
    "loss_type",
    # ipo in the fast tier: its sides are mean log-probabilities, each over its own reply's tokens,
    # and the anchor's replies differ in length (a chosen length dividing both fails it).
    ["ipo", pytest.param("simpo", marks=pytest.mark.slow), pytest.param("orpo", marks=pytest.mark.slow)],
)
def test_variants_equal_transformers_on_each_pair_alone(pref, loss_type):
    losses, norms = anchor(pref, loss_type)
    got_losses, got_norms, _ = _run(
        pref, f"v_{loss_type}", f"preference.loss_type='{loss_type}'", f"preference.reference='{pref['ref']}'"
    )
    torch.testing.assert_close(got_losses, losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_norms, norms, rtol=1e-5, atol=0)


def test_two_ranks_with_accumulation_give_the_one_process_numbers(pref):
    """World 2 with micro-batches of one pair (accumulation 4) against one process, whole batch;
    the initial policy as reference (a frozen copy)."""
    one = _run(pref, "l_one")
    two = _run(pref, "l_two", "parallel.dp_replicate=2", "batch.micro_batch_size=1", world=2)
    torch.testing.assert_close(two[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(two[1], one[1], rtol=1e-5, atol=0)
    # The initial policy as reference: the first step's loss is log 2, then it moves.
    assert one[0][0] == pytest.approx(0.6931472, abs=1e-6) and one[0][1] != one[0][0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.dp_shard=4", "batch.micro_batch_size=1", "parallel.activation_checkpointing='full'"),
        ("parallel.dp_shard=2", "parallel.tp=2"),
        ("parallel.dp_replicate=2", "parallel.dp_shard=2", "batch.micro_batch_size=2"),
    ],
    ids=["fsdp4_accum2_ac", "fsdp2_tp2", "hsdp"],
)
def test_sharded_layouts_give_the_one_process_numbers(pref, layout):
    ref = f"preference.reference='{pref['ref']}'"
    if "s_one" not in pref:  # the one-process run, once for the three layouts
        pref["s_one"] = _run(pref, "s_one", ref)
    one = pref["s_one"]
    four = _run(pref, "s_" + "_".join(x.split("=")[0][9:] for x in layout), ref, *layout, world=4)
    torch.testing.assert_close(four[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(four[1], one[1], rtol=1e-4, atol=0)


@pytest.mark.slow  # the fast tier's budget (issue 53); DPO at world 2 with accumulation stays fast
def test_context_parallel_gives_the_one_process_numbers(pref):
    """cp 2: each rank holds two chunks of every pair's row, so a side's log-probability (a
    reward model's score) is summed over the cp ranks with its gradient; DPO with a differing
    reference, and the reward model, against one process, under plain SGD."""
    ref = f"preference.reference='{pref['ref']}'"
    one = _run(pref, "cp_one", ref, "batch.micro_batch_size=4")
    two = _run(pref, "cp_two", ref, "parallel.cp=2", world=2)
    torch.testing.assert_close(two[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(two[1], one[1], rtol=1e-4, atol=0)
    assert [r["reward_accuracy"] for r in two[2]] == [r["reward_accuracy"] for r in one[2]]
    rm = (f"model.hf='{pref['rm']}'", "model.head='score'", "loss.name='reward'")
    one = _run(pref, "cp_rm_one", *rm)
    two = _run(pref, "cp_rm_two", *rm, "parallel.cp=2", "batch.micro_batch_size=2", world=2)
    torch.testing.assert_close(two[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(two[1], one[1], rtol=1e-4, atol=0)


@pytest.mark.slow
def test_compiled_dpo_equals_eager(pref):
    """train.compile: the policy's blocks compiled (rows of block_size, one shape; the frozen
    reference runs eagerly); DPO's losses and gradient norms equal the eager run's with the same
    rows (bitwise on CPU with torch 2.13; checked to 1e-6)."""
    ref = f"preference.reference='{pref['ref']}'"
    eager = _run(pref, "compile_eager", ref, "batch.micro_batch_size=4", "data.args.pad_to=0")
    compiled = _run(pref, "compile_on", ref, "batch.micro_batch_size=4", "train.compile=true")
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-6, atol=0)


@pytest.mark.slow  # the fast tier's budget; DPO at world 2 with accumulation stays fast
def test_pipeline_parallel_gives_the_one_process_numbers(pref):
    """pp 2: the pair loss is the schedule's loss on the last stage, per piece of 2 pairs (4
    pieces per step), with the reference's log-probabilities from the reference's own pipeline
    kept per row there; rows are block_size wide (pad_to 0), one process's as wide as its
    longest pair. DPO with a differing reference, and
    the reward model, against one process, under plain SGD."""
    ref = f"preference.reference='{pref['ref']}'"
    # Rows of 256 (the longest pair has 247 tokens); one process cuts them to its longest pair.
    data = f"data.args={{path = '{pref['corpus']}', block_size = 256}}"
    pp = (data, "parallel.pp=2", "parallel.pp_microbatches=4", "batch.micro_batch_size=8")
    one = _run(pref, "pp_one", ref, "batch.micro_batch_size=8")
    two = _run(pref, "pp_two", ref, *pp, world=2)
    torch.testing.assert_close(two[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(two[1], one[1], rtol=1e-4, atol=0)
    assert [r["reward_accuracy"] for r in two[2]] == [r["reward_accuracy"] for r in one[2]]
    rm = (f"model.hf='{pref['rm']}'", "model.head='score'", "loss.name='reward'")
    one = _run(pref, "pp_rm_one", *rm, "batch.micro_batch_size=8")
    two = _run(pref, "pp_rm_two", *rm, *pp, world=2)
    torch.testing.assert_close(two[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(two[1], one[1], rtol=1e-4, atol=0)


@pytest.mark.slow
def test_pipeline_with_data_parallel_accumulation_and_lora(pref):
    """pp 2 x dp_replicate 2 (world 4) with accumulation 2 and pieces of one pair (the frozen
    reference's stages are not wrapped in DDP: no gradient), pp 2 x cp 2, pp 2 x tp 2, and pp 2 with LoRA,
    whose reference is the policy's own pipeline with its adapters off, against one process."""
    ref = f"preference.reference='{pref['ref']}'"
    data = f"data.args={{path = '{pref['corpus']}', block_size = 256}}"
    one = _run(pref, "ppdp_one", ref, "batch.micro_batch_size=8")
    four = _run(
        pref,
        "ppdp_four",
        ref,
        data,
        "parallel.pp=2",
        "parallel.dp_replicate=2",
        "parallel.pp_microbatches=2",
        "batch.micro_batch_size=2",
        world=4,
    )
    torch.testing.assert_close(four[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(four[1], one[1], rtol=1e-4, atol=0)
    pp_cp = ("parallel.pp=2", "parallel.cp=2", "parallel.pp_microbatches=4", "batch.micro_batch_size=8")
    four = _run(pref, "ppcp_four", ref, data, *pp_cp, world=4)  # the last stage's sides summed over cp
    torch.testing.assert_close(four[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(four[1], one[1], rtol=1e-4, atol=0)
    pp_tp = ("parallel.pp=2", "parallel.tp=2", "parallel.pp_microbatches=4", "batch.micro_batch_size=8")
    four = _run(pref, "pptp_four", ref, data, *pp_tp, world=4)  # both models' stages split over tp
    torch.testing.assert_close(four[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(four[1], one[1], rtol=1e-4, atol=0)
    one = _run(pref, "pplora_one", *LORA)
    two = _run(pref, "pplora_two", *LORA, data, "parallel.pp=2", "batch.micro_batch_size=4", world=2)
    torch.testing.assert_close(two[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(two[1], one[1], rtol=1e-4, atol=0)
    assert abs(two[0][1] - two[0][0]) > 1e-5  # the reference is not the policy with its adapters on


def test_lora_reference_is_the_policy_with_adapters_off(pref):
    """LoRA: the default reference is the same model with its adapters off. At step 1 the
    adapters are zero, so the loss is log 2; a reference computed with the adapters on would keep
    it there (the policy against itself): step 2 must move. The trained adapters export with
    --peft and --merge, and both exports compute the same."""
    losses, _, _ = _run(pref, "lora1", *LORA)
    assert losses[0] == pytest.approx(0.6931472, abs=1e-6)
    assert abs(losses[1] - losses[0]) > 1e-5
    # The DPO-trained adapters export as for SFT: PEFT's model of them (its own LoRA modules)
    # computes what the merged transformers export does, and not what the base model does.
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    from paratrain.cli import main as cli_main

    run, out = os.path.join(pref["root"], "lora1"), os.path.join(pref["root"], "lora1_export")
    assert cli_main(["export", run, "--peft", f"{out}/peft"]) == 0
    assert cli_main(["export", run, "--hf", f"{out}/merged", "--merge"]) == 0
    x = torch.arange(1, 33)[None]
    with torch.no_grad():
        peft = AutoPeftModelForCausalLM.from_pretrained(f"{out}/peft").eval()(x).logits
        merged = AutoModelForCausalLM.from_pretrained(f"{out}/merged").eval()(x).logits
        base = AutoModelForCausalLM.from_pretrained(pref["policy"]).eval()(x).logits
    torch.testing.assert_close(peft, merged, rtol=1e-5, atol=1e-5)
    assert (merged - base).abs().max() > 1e-4


@pytest.mark.slow
def test_lora_on_fsdp2_gives_the_one_process_numbers(pref):
    one = _run(pref, "lora_one", *LORA)
    two = _run(pref, "lora2", *LORA, "parallel.dp_shard=2", "batch.micro_batch_size=2", world=2)
    torch.testing.assert_close(two[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(two[1], one[1], rtol=1e-4, atol=0)


def test_rows_end_at_the_micro_batchs_longest_pair(pref, tmp_path):
    """data.args.pad_to: a micro-batch's rows are cut to its longest pair, rounded up to pad_to; the
    cut columns are padding only, and a row's reference-store key holds its width. The
    default is 8, 0 (rows of block_size) under train.compile, a multiple of tp with sequence
    parallel; pad_to on a corpus without pairs is one line."""
    from paratrain.config import ConfigError
    from paratrain.objectives.reference_store import row_keys
    from paratrain.preflight import check_run

    cut = build_tokens(path=pref["corpus"], block_size=512, pad_to=8)
    whole = build_tokens(path=pref["corpus"], block_size=512, pad_to=0)
    samples = [cut[i] for i in range(4)]
    longest = max(int((x[1] >= 0).sum()) for x, _ in samples)
    (x, t), (fx, ft) = cut.collate(samples), whole.collate(samples)
    assert x.shape[-1] == -(-longest // 8) * 8 < 512 and fx.shape[-1] == 512
    w = x.shape[-1]
    assert torch.equal(fx[..., :w], x) and torch.equal(ft[..., :w], t)
    assert (fx[:, 1, w:] == -1).all() and (ft[:, 0, w:] == -100).all()  # what was cut is padding
    # A row's store key is its pair and its width (the reference's rounding depends on the width):
    # the same pairs in another order keep their keys, the same pair cut to another width is another row.
    assert row_keys(cut.collate(samples[::-1])[0]) == row_keys(x)[::-1]
    assert row_keys(fx) == [row_keys(s[0][None])[0] for s in samples] and not set(row_keys(fx)) & set(row_keys(x))

    def resolved(*extra: str, world: int = 1):
        cfg = load_config(None, _config(pref, "pad", *extra))
        check_run(cfg, world)
        return cfg.data.args["pad_to"]

    assert resolved() == 8 and resolved("train.compile=true") == 0 and resolved("parallel.pp=2", world=2) == 0
    assert resolved("parallel.tp=2", "parallel.sequence_parallel=true", world=2) == 8
    with pytest.raises(ConfigError, match=r"pad_to = 4: rows must split into equal parts over tp = 8 \(sequence"):
        resolved("parallel.tp=8", "parallel.sequence_parallel=true", "data.args.pad_to=4", world=8)
    with pytest.raises(ConfigError, match=r"pad_to = -8 must be an integer >= 0"):
        resolved("data.args.pad_to=-8")  # -8 % 8 == 0: refused before the worker builds the data
    with pytest.raises(ConfigError, match=r"pad_to = 8 with parallel.pp = 2: pipeline stages run one row width"):
        resolved("parallel.pp=2", "data.args.pad_to=8", world=2)
    text = tmp_path / "a.txt"
    text.write_text("plain text, no pairs\n" * 50)
    corpus = str(tmp_path / "text")
    prepare([str(text)], out_dir=corpus, tokenizer=pref["tok"], val_fraction=0, progress=False)
    with pytest.raises(ConfigError, match="data.args.pad_to cuts the padding of preference pairs"):
        build_tokens(path=corpus, block_size=64, pad_to=8)


def test_pair_losses_are_the_papers_formulas():
    """Each loss_type's per-pair loss and rewards from given log-probabilities, written out."""
    policy = torch.tensor([[-3.0, -5.0], [-7.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-4.0, -4.5], [-6.0, -3.0]], dtype=torch.float64)
    h = (policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1])
    b, e = 0.2, 0.1
    want = {
        "sigmoid": -(1 - e) * F.logsigmoid(b * h) - e * F.logsigmoid(-b * h),
        "robust": ((1 - e) * -F.logsigmoid(b * h) + e * F.logsigmoid(-b * h)) / (1 - 2 * e),
        "hinge": torch.relu(1 - b * h),
        "ipo": (h - 1 / (2 * b)) ** 2,
        "sigmoid_norm": -(1 - e) * F.logsigmoid(b * h) - e * F.logsigmoid(-b * h),
        "simpo": -(1 - e) * F.logsigmoid(b * (policy[:, 0] - policy[:, 1]) - 0.5)
        - e * F.logsigmoid(-(b * (policy[:, 0] - policy[:, 1]) - 0.5)),
    }
    mean = policy / 10  # mean token log-probabilities for ORPO (must be < 0)
    odds = mean - torch.log(1 - mean.exp())
    orpo = PreferenceLoss("orpo", beta=b).pair_losses(mean, ref)[0]
    torch.testing.assert_close(orpo, -mean[:, 0] - b * F.logsigmoid(odds[:, 0] - odds[:, 1]))
    for loss_type, expected in want.items():
        objective = PreferenceLoss(loss_type, beta=b, label_smoothing=e, gamma=0.5)
        losses, rewards = objective.pair_losses(policy, ref)
        torch.testing.assert_close(losses, expected)
        torch.testing.assert_close(rewards, b * (policy if loss_type == "simpo" else policy - ref))


def test_prepare_reads_trls_preference_formats(pref, tmp_path):
    """The implicit-prompt and plain-string forms give pairs; a pair is one row [chosen | rejected]
    whose targets are the replies' tokens only."""
    explicit = pref["rows"][:4]
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in explicit]
    plain = [
        {"prompt": r["prompt"][0]["content"], "chosen": r["chosen"][0]["content"], "rejected": "No."} for r in explicit
    ]
    corpora = {}
    for name, rows in (("explicit", explicit), ("implicit", implicit), ("plain", plain)):
        path = write_jsonl(str(tmp_path / f"{name}.jsonl"), rows)
        corpora[name] = build_tokens(str(prepare_to(path, pref["tok"], tmp_path / name)), block_size=512)
    a, b = corpora["explicit"], corpora["implicit"]
    assert len(a) == len(b) == 4
    for i in range(4):
        torch.testing.assert_close(a[i], b[i])  # the same prompt found from the common messages
    x, t = corpora["plain"][0]
    assert x.shape == (2, 512) and t.shape == (2, 512)
    side = t[1]
    targets = t[0]
    # Every target is a reply's token, and each side has some.
    assert (side[targets >= 0] >= 0).all() and {0, 1} <= set(side[targets >= 0].tolist())
    # The prompt's tokens are not targets: the first target sits after the prompt's length.
    from transformers import AutoTokenizer

    prompt_len = len(AutoTokenizer.from_pretrained(pref["tok"])(plain[0]["prompt"])["input_ids"])
    assert int((targets >= 0).nonzero()[0]) == prompt_len - 1


def prepare_to(path: str, tok: str, out) -> str:
    prepare([path], out_dir=str(out), tokenizer=tok, fmt="preference", val_fraction=0, progress=False)
    return str(out)


def test_bad_preference_input_is_one_line(pref, tmp_path):
    bad = write_jsonl(str(tmp_path / "bad.jsonl"), [*pref["rows"][:2], {"prompt": "x", "chosen": "y"}])
    out = paratrain_cli(
        "prepare", bad, "--out", str(tmp_path / "c"), "--tokenizer", pref["tok"], "--format", "preference"
    )
    assert out.returncode == 2
    line = out.stderr.strip()
    assert "\n" not in line and "bad.jsonl:3" in line and "'rejected'" in line, line
    config = tmp_path / "empty.toml"
    config.write_text("")
    sets = [a for o in _config(pref, "pp", "parallel.pp=2", "data.args.pad_to=8") for a in ("--set", o)]
    out = paratrain_cli("train", str(config), "--nproc-per-node", "2", *sets)
    line = out.stderr.strip()
    tail = out.stderr[-2000:]
    assert out.returncode == 2 and "parallel.pp = 2" in line and "pad_to = 0" in line and "\n" not in line, tail


def reward_anchor(pref: dict, *, lr: float = 0.5, steps: int = 2):
    """(losses, grad norms, model after the steps) of transformers' sequence classifier scoring
    each side alone (its own pooling: the last token), the Bradley-Terry loss written out."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pref["tok"])
    model = AutoModelForSequenceClassification.from_pretrained(pref["rm"], attn_implementation="sdpa")
    with torch.no_grad():
        scores = [[score(model, tok, row["prompt"] + row[k]) for k in ("chosen", "rejected")] for row in pref["rows"]]
    accuracy = sum(float(c > r) for c, r in scores) / len(scores)
    losses, norms = [], []
    for step in range(steps):
        terms = []
        for row in pref["rows"][8 * step : 8 * step + 8]:
            c, r = (score(model, tok, row["prompt"] + row[k]) for k in ("chosen", "rejected"))
            terms.append(-F.logsigmoid(c - r))
        loss, norm = sgd_step(model, torch.stack(terms).mean(), lr)
        losses.append(loss)
        norms.append(norm)
    return losses, norms, model, accuracy


def score(model, tok, messages: list[dict]) -> torch.Tensor:
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    return model(input_ids=torch.tensor([ids])).logits[0, 0]


def test_reward_model_equals_transformers_and_exports_a_classifier(pref):
    """A reward model (model.head = 'score', loss.name = 'reward'): two SGD steps equal
    transformers' sequence classifier on each side alone; the run's export loads back in
    AutoModelForSequenceClassification and scores as the anchor's trained model does."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from paratrain.launch.eval_worker import eval_checkpoint

    losses, norms, trained, accuracy = reward_anchor(pref)
    reward = ("model.head='score'", "loss.name='reward'", f"model.hf='{pref['rm']}'")
    got_losses, got_norms, _ = _run(pref, "rm1", *reward)
    torch.testing.assert_close(got_losses, losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_norms, norms, rtol=1e-5, atol=0)
    # Pairwise accuracy of the initial model over the validation pairs (paratrain eval).
    over = [*_config(pref, "rm_eval", *reward), f"data.args={{path = '{pref['val']}', block_size = 512}}"]
    result = eval_checkpoint(load_config(None, over), "")
    assert result["val_reward_accuracy"] == pytest.approx(accuracy, abs=1e-9) and 0 < accuracy < 1
    exported = AutoModelForSequenceClassification.from_pretrained(os.path.join(pref["root"], "rm1", "hf"))
    tok = AutoTokenizer.from_pretrained(pref["tok"])
    with torch.no_grad():
        for row in pref["rows"][:4]:
            messages = row["prompt"] + row["chosen"]
            torch.testing.assert_close(score(exported, tok, messages), score(trained, tok, messages), rtol=0, atol=1e-5)
    # `paratrain generate` of it: one line (it read the classifier as a causal LM, a random LM head).
    from paratrain.config import ConfigError
    from paratrain.generate import generate_text

    with pytest.raises(ConfigError, match=r"trained a reward model \(model.head = 'score'\), which scores"):
        generate_text(os.path.join(pref["root"], "rm1"), "def", max_new_tokens=2)
    pref["reward"] = (reward, losses, norms)


@pytest.mark.slow
def test_reward_models_on_two_ranks(pref):
    """World 2 with accumulation (DDP) gives the anchor's numbers; a causal LM's directory, whose
    weights have no score head (initialised from the seed as transformers does, the same on
    every rank), trains alike on one process and on FSDP2."""
    reward = ("model.head='score'", "loss.name='reward'", f"model.hf='{pref['rm']}'")
    losses, norms = pref["reward"][1:] if "reward" in pref else reward_anchor(pref)[:2]
    two = _run(pref, "rm2", *reward, "parallel.dp_replicate=2", "batch.micro_batch_size=2", world=2)
    torch.testing.assert_close(two[0], losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(two[1], norms, rtol=1e-5, atol=0)
    lm = ("model.head='score'", "loss.name='reward'", "run.steps=1")
    one = _run(pref, "rm_lm1", *lm)
    shard = _run(pref, "rm_lm2", *lm, "parallel.dp_shard=2", world=2)
    assert one[0][0] > 0
    torch.testing.assert_close(shard[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(shard[1], one[1], rtol=1e-4, atol=0)


@pytest.mark.parametrize(
    "layout",
    [
        ("run.seed=0",),  # one process, accumulation 4
        pytest.param(("parallel.dp_replicate=2",), marks=pytest.mark.slow),
        pytest.param(("parallel.dp_shard=2",), marks=pytest.mark.slow),
        pytest.param(
            ("parallel.dp_shard=2", "model.lora.target_modules=['q_proj', 'v_proj']", "model.lora.r=4"),
            marks=pytest.mark.slow,
        ),
        pytest.param(("parallel.pp=2",), marks=pytest.mark.slow),  # the reference's pipeline fills it
        pytest.param(("parallel.cp=2",), marks=pytest.mark.slow),  # the chunks' sums over cp, keyed by the whole row
        pytest.param(("parallel.pp=2", "parallel.cp=2"), marks=pytest.mark.slow),  # over the last stage's cp ranks
    ],
    ids=["one_process", "ddp", "fsdp2", "fsdp2_lora", "pp", "cp", "pp_cp"],
)
def test_precomputed_reference_equals_the_per_step_one(pref, layout):
    """preference.precompute: the reference's numbers computed once into a store keyed by the
    pair give the per-step reference's losses and gradients (1e-6); a second run with the same
    store computes nothing (its values file is not rewritten; checked on one process, and for a
    store filled at cp 2, whose keys are the whole rows', by one process: keys of the cp chunks
    would find nothing)."""
    name = "_".join(x.split("=")[0].split(".")[-1] for x in layout)
    world = 1 if name == "seed" else 4 if name == "pp_cp" else 2
    ref = "" if "lora" in name else f"preference.reference='{pref['ref']}'"
    extra = [x for x in (ref, *layout, "batch.micro_batch_size=2", "run.steps=4") if x]
    step = _run(pref, f"p_step_{name}", *extra, world=world)
    store = os.path.join(pref["root"], f"store_{name}")
    pre = _run(pref, f"p_pre_{name}", *extra, "preference.precompute=true", f"preference.store='{store}'", world=world)
    torch.testing.assert_close(pre[0], step[0], rtol=0, atol=0)
    torch.testing.assert_close(pre[1], step[1], rtol=0, atol=0)
    if world > 1 and name != "cp":
        return
    values = os.path.join(store, "values.pt")
    written = os.stat(values).st_mtime_ns
    one = [x for x in extra if x != "parallel.cp=2"]
    again = _run(pref, f"p_again_{name}", *one, "preference.precompute=true", f"preference.store='{store}'")
    assert os.stat(values).st_mtime_ns == written
    torch.testing.assert_close(again[0], pre[0], rtol=0 if world == 1 else 1e-5, atol=0)


def unpaired_rows(rows: list[dict]) -> list[dict]:
    """KTO's unpaired form of the pairs: the chosen reply (desirable) of even rows, the rejected
    (undesirable) of odd ones."""
    return [
        {"prompt": r["prompt"], "completion": r["chosen" if i % 2 == 0 else "rejected"], "label": i % 2 == 0}
        for i, r in enumerate(rows)
    ]


def kto_anchor(pref: dict, rows: list[dict], *, beta: float = 0.1, lr: float = 0.5, steps: int = 2):
    """KTO (Ethayarajh et al. 2024) written out on transformers' forward of each example alone;
    the KL rows pair each prompt with the next row's completion, z0 over the step's global batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pref["tok"])
    policy = AutoModelForCausalLM.from_pretrained(pref["policy"], attn_implementation="sdpa")
    ref = AutoModelForCausalLM.from_pretrained(pref["ref"], attn_implementation="sdpa")
    others = [rows[(i + 1) % len(rows)]["completion"] for i in range(len(rows))]
    losses, norms = [], []
    for step in range(steps):
        batch = range(8 * step, 8 * step + 8)
        with torch.no_grad():
            kl = [
                side_logp(policy, tok, rows[i]["prompt"], others[i])[0]
                - side_logp(ref, tok, rows[i]["prompt"], others[i])[0]
                for i in batch
            ]
        z0 = max(0.0, float(torch.stack(kl).mean()))
        terms = []
        for i in batch:
            with torch.no_grad():
                r_ref = side_logp(ref, tok, rows[i]["prompt"], rows[i]["completion"])[0]
            ratio = side_logp(policy, tok, rows[i]["prompt"], rows[i]["completion"])[0] - r_ref
            if rows[i]["label"]:
                terms.append(1 - torch.sigmoid(beta * (ratio - z0)))
            else:
                terms.append(1 - torch.sigmoid(beta * (z0 - ratio)))
        loss, norm = sgd_step(policy, torch.stack(terms).mean(), lr)
        losses.append(loss)
        norms.append(norm)
    return losses, norms


def test_kto_on_unpaired_rows_equals_transformers_and_every_layout(pref, tmp_path):
    """KTO on `prepare --format unpaired` rows: two SGD steps equal the written-out loss on
    transformers' forward of each example alone (z0 over the global batch); world 2 with
    micro-batches of one example gives the same numbers (the slow case below; TRL's z0 is per
    micro-batch)."""
    rows = unpaired_rows(pref["rows"])
    data = write_jsonl(str(tmp_path / "unpaired.jsonl"), rows)
    corpus = str(tmp_path / "kto")
    prepare([data], out_dir=corpus, tokenizer=pref["tok"], fmt="unpaired", val_fraction=0, progress=False)
    losses, norms = kto_anchor(pref, rows)
    kto = (
        "preference.loss_type='kto'",
        f"preference.reference='{pref['ref']}'",
        f"data.args={{path = '{corpus}', block_size = 512}}",
    )
    got_losses, got_norms, got = _run(pref, "kto1", *kto)
    torch.testing.assert_close(got_losses, losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_norms, norms, rtol=1e-5, atol=0)
    assert got[0]["kto_kl"] >= 0
    pref["kto"] = (kto, losses, norms)  # test_kto_at_world_2 (slow) compares with the same anchor


@pytest.mark.slow
def test_kto_at_world_2_with_micro_batches_of_one_and_context_parallel(pref, tmp_path):
    if "kto" not in pref:
        test_kto_on_unpaired_rows_equals_transformers_and_every_layout(pref, tmp_path)
    kto, losses, norms = pref["kto"]
    two = _run(pref, "kto2", *kto, "parallel.dp_replicate=2", "batch.micro_batch_size=1", world=2)
    torch.testing.assert_close(two[0], losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(two[1], norms, rtol=1e-5, atol=0)
    # Context parallel: the example's and its KL document's log-probabilities summed over cp ranks.
    cp = _run(pref, "kto_cp2", *kto, "parallel.cp=2", world=2)
    torch.testing.assert_close(cp[0], losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(cp[1], norms, rtol=1e-4, atol=0)


@pytest.mark.slow
def test_kto_at_pp_2_equals_one_process(pref, tmp_path):
    """pp 2: KTO's KL pass runs the policy forward through its pipeline (the rows' KL estimates
    on the last stage, summed over the stages and ranks), the reference through its own; pieces
    of 2 examples, against one process under plain SGD, the logged kto_kl too."""
    rows = unpaired_rows(pref["rows"])
    data = write_jsonl(str(tmp_path / "unpaired.jsonl"), rows)
    corpus = str(tmp_path / "kto")
    prepare([data], out_dir=corpus, tokenizer=pref["tok"], fmt="unpaired", val_fraction=0, progress=False)
    kto = ("preference.loss_type='kto'", f"preference.reference='{pref['ref']}'")
    one = _run(pref, "kto_pp_one", *kto, f"data.args={{path = '{corpus}', block_size = 512}}")
    pp = ("parallel.pp=2", "parallel.pp_microbatches=4", "batch.micro_batch_size=8")
    two = _run(pref, "kto_pp_two", *kto, f"data.args={{path = '{corpus}', block_size = 256}}", *pp, world=2)
    torch.testing.assert_close(two[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(two[1], one[1], rtol=1e-4, atol=0)
    torch.testing.assert_close([r["kto_kl"] for r in two[2]], [r["kto_kl"] for r in one[2]], rtol=1e-5, atol=1e-7)
    assert one[2][0]["kto_kl"] > 0  # z0 is not clamped to 0 here: the KL pass counts


def test_a_corpus_and_a_loss_that_do_not_match_are_one_line(pref, tmp_path):
    """A preference corpus trained with another loss, a pair loss on another corpus, a teacher of
    another vocabulary: each a ConfigError naming the fix (exit 2 and one line from the CLI),
    not a shape error inside the step."""
    from paratrain.config import ConfigError

    with pytest.raises(ConfigError, match="loss.name = 'preference'"):
        paratrain.train(load_config(None, _config(pref, "bad1", "loss.name='cross_entropy'")))
    text = str(tmp_path / "text.txt")
    with open(text, "w") as f:
        f.write("def f():\n    return 1\n" * 200)
    corpus = str(tmp_path / "text")
    prepare([text], out_dir=corpus, tokenizer=pref["tok"], val_fraction=0, progress=False)
    other = f"data.args={{path = '{corpus}', block_size = 64}}"
    with pytest.raises(ConfigError, match="--format preference"):
        paratrain.train(load_config(None, _config(pref, "bad2", other)))
    teacher = save_tiny("qwen2", str(tmp_path / "teacher"))  # a vocabulary of 128, the student's is 259
    distill = ("loss.name='distill'", f"distill.teacher='{teacher}'", "run.steps=1")
    with pytest.raises(ConfigError, match="vocabulary of 128"):
        paratrain.train(load_config(None, [*_config(pref, "bad3", *distill), other]))
    # A frozen model's directory without weights: its own key named, not model.hf_weights (the policy's).
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(teacher, "config.json"), bare)
    distill = ("loss.name='distill'", f"distill.teacher='{bare}'", "run.steps=1")
    with pytest.raises(ConfigError, match=r"^distill.teacher = '.*' has no \*.safetensors weights"):
        paratrain.train(load_config(None, [*_config(pref, "bad4", *distill), other]))
    # KTO on pairs, a pair loss on unpaired rows: said before the model is built, in its direction
    # (the step's check spoke of an unpaired corpus when the corpus held pairs).
    with pytest.raises(ConfigError, match="'kto' trains on unpaired examples, but data.args.path holds pairs"):
        paratrain.train(load_config(None, _config(pref, "bad5", "preference.loss_type='kto'")))
    unpaired = str(tmp_path / "kto")
    rows = write_jsonl(str(tmp_path / "unpaired.jsonl"), unpaired_rows(pref["rows"]))
    prepare([rows], out_dir=unpaired, tokenizer=pref["tok"], fmt="unpaired", val_fraction=0, progress=False)
    with pytest.raises(ConfigError, match="data.args.path is an unpaired corpus"):
        paratrain.train(load_config(None, [*_config(pref, "bad6"), f"data.args={{path = '{unpaired}'}}"]))


def _moe_pair(pref: dict) -> tuple[str, str]:
    """A Mixtral policy and reference (balance loss on, weight 0.5), once per test process."""
    root = pref["root"]
    if "moe" not in pref:
        pref["moe"] = tuple(
            save_tiny("mixtral", f"{root}/moe_{name}", vocab_size=VOCAB, max_position_embeddings=512, seed=seed)
            for name, seed in (("policy", 0), ("ref", 1))
        )
    return pref["moe"]


def test_mixture_of_experts_needs_rows_of_block_size(pref):
    """DPO with a mixture of experts: its balance loss counts every position of a row, so rows are
    block_size wide (data.args.pad_to defaults to 0, another value is one line); rows cut to each
    micro-batch's longest pair changed the balance loss with the micro-batch (grad_norm 7% apart
    between micro-batches of 4 and 8). The layouts are the slow test's below."""
    from paratrain.config import ConfigError
    from paratrain.preflight import check_run

    policy, ref = _moe_pair(pref)
    base = (f"model.hf='{policy}'", f"preference.reference='{ref}'")
    with pytest.raises(ConfigError, match=r"data.args.pad_to = 8 with a mixture of experts"):
        check_run(load_config(None, _config(pref, "moe_no", *base, "data.args.pad_to=8")), 1)


@pytest.mark.slow
def test_mixture_of_experts_with_fsdp2_precompute_and_pipeline(pref):
    """DPO with a mixture of experts against one micro-batch of 8: accumulation 2, ep 2 x DDP 2,
    ep 2 x FSDP2 2 with the precomputed reference store, and pp 2 x ep 2 x DDP 2 (world 4)."""
    policy, ref = _moe_pair(pref)
    base = (f"model.hf='{policy}'", f"preference.reference='{ref}'")
    one = _run(pref, "moe_one_slow", *base, "batch.micro_batch_size=8")
    fsdp = ("parallel.dp_shard=2", "parallel.ep=2", "preference.precompute=true", "batch.micro_batch_size=4")
    pp = ("parallel.pp=2", "parallel.dp_replicate=2", "parallel.ep=2", "parallel.pp_microbatches=2")
    runs = [
        _run(pref, "moe_acc2", *base, "batch.micro_batch_size=4"),
        _run(pref, "moe_ep2", *base, "parallel.dp_replicate=2", "parallel.ep=2", "batch.micro_batch_size=2", world=2),
        _run(pref, "moe_fsdp", *base, *fsdp, world=2),
        _run(pref, "moe_pp", *base, *pp, "batch.micro_batch_size=2", world=4),
    ]
    for got in runs:
        torch.testing.assert_close(got[0], one[0], rtol=1e-5, atol=0)
        torch.testing.assert_close(got[1], one[1], rtol=1e-4, atol=0)
