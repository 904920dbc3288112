"""Knowledge distillation (docs/preference.md#distillation): a student against a frozen teacher,
per target token over the global token count, exact on every layout.

The anchor is plain ``transformers``: the student and a teacher of another architecture and size
on **each conversation alone**, the divergence over the assistant tokens written out here; two
plain-SGD steps of paratrain (loss and ``grad_norm``) must equal it.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import paratrain
from paratrain.config import load_config
from paratrain.data.prepare import prepare
from paratrain.data.tokens import build_tokens
from paratrain.objectives.distill import divergence
from paratrain.testing.dist_utils import plain_sgd, read_metrics, run_ranks, sgd_step, train_rank
from paratrain.testing.hf_models import save_tiny
from paratrain.testing.sft_data import VOCAB, save_chat_tokenizer, stdlib_conversations, write_jsonl

pytest.importorskip("transformers")

SGD = [*plain_sgd(0.5), "run.progress=false", "metrics.plot=false", "data.shuffle=false"]


@pytest.fixture(scope="module")
def kd(tmp_path_factory):
    root = tmp_path_factory.mktemp("kd")
    tok = save_chat_tokenizer(str(root / "tok"))
    convs = stdlib_conversations(12)
    chat = write_jsonl(str(root / "chat.jsonl"), convs)
    student = save_tiny("qwen2", str(root / "student"), vocab_size=VOCAB, max_position_embeddings=512, seed=0)
    teacher = save_tiny(
        "llama",
        str(root / "teacher"),
        vocab_size=VOCAB,
        max_position_embeddings=512,
        hidden_size=64,
        intermediate_size=128,
        seed=3,
    )
    corpus = str(root / "corpus")
    prepare([chat], out_dir=corpus, tokenizer=tok, fmt="chat", val_fraction=0, progress=False)
    rows = len(build_tokens(corpus, block_size=512))
    return {"root": str(root), "tok": tok, "convs": convs, "student": student, "teacher": teacher, "corpus": corpus,
            "rows": rows}  # fmt: skip


def _config(kd: dict, name: str, *extra: str) -> list[str]:
    return [
        f"model.hf='{kd['student']}'",
        "data.name='tokens'",
        f"data.args={{path = '{kd['corpus']}', block_size = 512}}",
        "loss.name='distill'",
        f"distill.teacher='{kd['teacher']}'",
        f"run.out_dir='{kd['root']}/{name}'",
        f"batch.global_batch_size={kd['rows']}",
        "run.steps=2",
        *SGD,
        *extra,
    ]


def anchor(kd: dict, kind: str, *, temperature: float = 1.0, lr: float = 0.5, steps: int = 2):
    """Each step over every conversation (one global batch of all rows), the divergence per
    assistant token written out on transformers' own logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(kd["tok"])
    student = AutoModelForCausalLM.from_pretrained(kd["student"], attn_implementation="sdpa")
    teacher = AutoModelForCausalLM.from_pretrained(kd["teacher"], attn_implementation="sdpa")
    losses, norms = [], []
    for _ in range(steps):
        total, count = [], 0
        for c in kd["convs"]:
            out = tok.apply_chat_template(
                c["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids = torch.tensor([out["input_ids"]])
            mask = torch.tensor(out["assistant_masks"])[1:].bool()
            s = student(input_ids=ids).logits[0, :-1][mask].float() / temperature
            with torch.no_grad():
                t = teacher(input_ids=ids).logits[0, :-1][mask].float() / temperature
            p_log, q_log = t.log_softmax(-1), s.log_softmax(-1)
            if kind == "forward_kl":
                per = (p_log.exp() * (p_log - q_log)).sum(-1)
            else:  # reverse_kl
                per = (q_log.exp() * (q_log - p_log)).sum(-1)
            total.append(per.sum())
            count += int(mask.sum())
        loss, norm = sgd_step(student, torch.stack(total).sum() / count, lr)
        losses.append(loss)
        norms.append(norm)
    return losses, norms


def _run(kd: dict, name: str, *extra: str, world: int = 1):
    over = _config(kd, name, *extra)
    if world == 1:
        paratrain.train(load_config(None, over))
    else:
        run_ranks(train_rank, world, over)
    rows = read_metrics(os.path.join(kd["root"], name))
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows], rows


def test_forward_kl_equals_transformers_on_each_conversation_alone(kd):
    """At temperature 1.5: the student's and the teacher's logits both divided by it."""
    losses, norms = anchor(kd, "forward_kl", temperature=1.5)
    got_losses, got_norms, rows = _run(kd, "fkl", "distill.temperature=1.5")
    torch.testing.assert_close(got_losses, losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_norms, norms, rtol=1e-5, atol=0)
    assert rows[0]["student_ce"] > 0


@pytest.mark.slow
def test_reverse_kl_with_temperature_equals_transformers(kd):
    losses, norms = anchor(kd, "reverse_kl", temperature=2.0)
    got_losses, got_norms, _ = _run(kd, "rkl", "distill.divergence='reverse_kl'", "distill.temperature=2.0")
    torch.testing.assert_close(got_losses, losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_norms, norms, rtol=1e-5, atol=0)


def test_two_ranks_with_accumulation_give_the_one_process_numbers(kd):
    one = _run(kd, "one", "distill.divergence='jsd'")
    two = _run(kd, "two", "distill.divergence='jsd'", "parallel.dp_replicate=2", "batch.micro_batch_size=1", world=2)
    torch.testing.assert_close(two[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(two[1], one[1], rtol=1e-5, atol=0)


def _pp_one(kd: dict):
    """The one-process run the pipeline layouts compare with, once per test process."""
    if "pp_one" not in kd:
        kd["pp_one"] = _run(kd, "pp_one")
    return kd["pp_one"]


@pytest.mark.slow  # the fast tier's budget (issue 53); distillation at world 2 with accumulation stays fast
def test_pipeline_parallel_gives_the_one_process_numbers(kd):
    """pp 2 (world 2) with accumulation 2: the divergence is the schedule's loss on the last
    stage, per pipeline piece of rows (4 pieces of one row per step), the teacher (another
    architecture, whole on the last stage) run on each piece's own input rows (their indices ride
    the target); forward KL against one process, under plain SGD."""
    assert kd["rows"] == 4  # two micro-batches of 2 rows, each cut into 2 pieces of one row
    one = _pp_one(kd)
    two = _run(kd, "pp_two", "parallel.pp=2", "parallel.pp_microbatches=2", "batch.micro_batch_size=2", world=2)
    torch.testing.assert_close(two[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(two[1], one[1], rtol=1e-4, atol=0)
    assert [r["student_ce"] for r in two[2]] == pytest.approx([r["student_ce"] for r in one[2]], rel=1e-5)


@pytest.mark.slow  # world 4
@pytest.mark.parametrize("degree", ["dp_shard", "tp", "cp"])
def test_pipeline_lays_the_teacher_out_like_the_last_stage(kd, degree):
    """pp 2 x dp_shard 2, tp 2 or cp 2 (world 4): the teacher sharded by FSDP2, split by tensor
    parallel or run on the cp chunks with the ring attention over the last stage's two ranks (its
    collectives among them only), forward KL against one process under plain SGD. The teacher
    run on shifted rows under tp, or without context parallel under cp (-4e-3 relative), fails it."""
    one = _pp_one(kd)
    layout = ("parallel.pp=2", f"parallel.{degree}=2", "parallel.pp_microbatches=2", "batch.micro_batch_size=2")
    four = _run(kd, f"pp_{degree}", *layout, world=4)
    torch.testing.assert_close(four[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(four[1], one[1], rtol=1e-4, atol=0)


def test_pipeline_beside_every_degree_passes_the_preflight(kd):
    """Under pp the teacher is laid out as one more stage of the last stage's ranks: DDP, FSDP2,
    tensor and context parallel beside the pipeline are all accepted (the layouts run in the slow
    tier above)."""
    from paratrain.preflight import check_run

    for degree in ("dp_replicate", "dp_shard", "tp", "cp"):
        check_run(load_config(None, _config(kd, "pp_ok", "parallel.pp=2", f"parallel.{degree}=2")), 4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [("parallel.dp_shard=2", "parallel.tp=2"), ("parallel.dp_shard=4",), ("parallel.cp=2",)],
    ids=["fsdp2_tp2", "fsdp4", "cp2"],
)
def test_sharded_student_and_teacher_give_the_one_process_numbers(kd, layout):
    """The teacher laid out like the student: FSDP2 and TP shard both; context parallel splits
    both models' sequences (the divergence is per token, summed over the cp ranks)."""
    if "s_one" not in kd:  # the one-process run, once for both layouts
        kd["s_one"] = _run(kd, "s_one", "distill.top_k=8")
    one = kd["s_one"]
    world = 2 if layout == ("parallel.cp=2",) else 4
    four = _run(kd, "s_" + "_".join(x[9:].replace("=", "") for x in layout), "distill.top_k=8", *layout, world=world)
    torch.testing.assert_close(four[0], one[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(four[1], one[1], rtol=1e-4, atol=0)


def test_divergences_are_the_written_out_formulas():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(5, 11, generator=g, dtype=torch.float64), torch.randn(5, 11, generator=g, dtype=torch.float64)
    p, q = t.softmax(-1), s.softmax(-1)
    kl = lambda a, b: (a * (a.log() - b.log())).sum(-1)  # noqa: E731
    torch.testing.assert_close(divergence(s, t, kind="forward_kl").double(), kl(p, q), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(divergence(s, t, kind="reverse_kl").double(), kl(q, p), rtol=1e-5, atol=1e-6)
    m = 0.3 * p + 0.7 * q
    jsd = 0.3 * kl(p, m) + 0.7 * kl(q, m)
    torch.testing.assert_close(divergence(s, t, kind="jsd", beta=0.3).double(), jsd, rtol=1e-5, atol=1e-6)
    # top-k: the teacher's k most likely tokens, renormalised; the student's log-probabilities at them.
    top = t.topk(3, -1).indices
    pk = t.gather(-1, top).softmax(-1)
    want = (pk * (pk.log() - q.gather(-1, top).log())).sum(-1)
    torch.testing.assert_close(divergence(s, t, kind="forward_kl", top_k=3).double(), want, rtol=1e-5, atol=1e-6)
    # A temperature other than 1 divides both the student's and the teacher's logits.
    pt, qt = (t / 2.0).softmax(-1), (s / 2.0).softmax(-1)
    for kind, want in (("forward_kl", kl(pt, qt)), ("reverse_kl", kl(qt, pt))):
        got = divergence(s, t, kind=kind, temperature=2.0).double()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The same distributions: zero.
    assert divergence(s, s, kind="jsd").abs().max() < 1e-6 and math.isfinite(float(divergence(s, t, kind="jsd")[0]))


def test_auto_micro_batch_is_refused_naming_the_teacher():
    """The refusal of 'auto' spoke of "its pairs' rows" to a distillation run, which has none."""
    from types import SimpleNamespace

    from paratrain.config import ConfigError
    from paratrain.preflight.support import check_support

    cfg = load_config(None, ["loss.name='distill'", "distill.teacher='t'", "batch.micro_batch_size='auto'"])
    dims = SimpleNamespace(pp=1, tp=1, cp=1, ep=1, dp_shard=1, dp_replicate=1, fsdp_enabled=False)
    with pytest.raises(ConfigError, match=r"does not price this loss \(a pair per row, a reference or a teacher\)"):
        check_support(cfg, dims)
