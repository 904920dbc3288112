"""Math over the batch, exact on every layout (docs/batch-math.md): BatchNorm over fixed groups of
``batch.norm_group`` samples (models/batch_norm.py, objectives/batch_norm.py) and losses over the
whole global batch by the gradient cache (objectives/batch_loss.py).

The reference is not paratrain: a plain PyTorch loop runs the whole global batch in one forward,
torch's own unmodified ``BatchNorm`` module called on each group of ``G`` rows in order (so its
running statistics are updated group after group, as one process would), the contrastive loss
written out here over all samples, and plain SGD. paratrain must give its losses, ``grad_norm``
and running statistics within 1e-5 at every micro-batch and data-parallel layout (DDP, FSDP2, a
group spread over 2 and 4 ranks; tensor parallel for the loss over the batch). Four injected
faults fail a comparison: statistics over the micro-batch instead of the group, running
statistics updated in another order, the cached gradient scaled by the number of micro-batches,
and a first pass without the rows' keys.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import paratrain
from paratrain import step as step_module
from paratrain.config import ConfigError, load_config
from paratrain.data.sampler import rank_micro_batches
from paratrain.models.batch_norm import GroupBatchNorm, check_groups
from paratrain.objectives import batch_loss, batch_norm
from paratrain.testing import toy
from paratrain.testing.dist_utils import plain_sgd, read_metrics, run_ranks

B, G, STEPS, LR = 32, 8, 3, 0.5
COMMON = [
    *plain_sgd(LR),
    "run.progress=false",
    "metrics.plot=false",
    f"batch.global_batch_size={B}",
    f"batch.norm_group={G}",
    f"run.steps={STEPS}",
    "data.shuffle=false",
]
MODELS = {
    "cnn": ["model.factory='paratrain.testing.toy:bn_cnn'", "data.factory='paratrain.testing.toy:images'"],
    "resnet": ["model.factory='paratrain.testing.toy:hf_resnet'", "data.factory='paratrain.testing.toy:images'"],
    "dual": [
        "model.factory='paratrain.testing.toy:dual_encoder'",
        "model.args={scale = true}",
        "data.factory='paratrain.testing.toy:pairs'",
        "loss.name='info_nce'",
    ],
    "dual_plain": [
        "model.factory='paratrain.testing.toy:dual_encoder'",
        "model.args={batch_norm = false}",
        "data.factory='paratrain.testing.toy:pairs'",
        "loss.name='info_nce'",
        # tensor parallel: the first layer column-, the last row-wise (outputs replicated over tp)
        "parallel.tp_plan={'tower.0' = 'colwise', 'tower.4' = 'rowwise'}",
    ],
}


# --- the reference: plain PyTorch, torch's own BatchNorm per group --------------------------


class PerGroup(nn.Module):
    """torch's unmodified BatchNorm module, called on each group of ``group`` rows in order."""

    def __init__(self, bn: nn.Module, group: int):
        super().__init__()
        self.bn, self.group = bn, group

    def forward(self, x):
        return torch.cat([self.bn(part) for part in x.split(self.group)])


def per_group(model: nn.Module, group: int) -> nn.Module:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                setattr(parent, name, PerGroup(child, group))
    return model


def info_nce(output) -> torch.Tensor:
    q, d, scale = output if len(output) == 3 else (*output, 1 / 0.05)  # loss.temperature's default
    logits = F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).T * scale
    labels = torch.arange(len(q))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def reference(name: str, *, group: int = G) -> tuple[list[float], list[float], dict]:
    """Losses, grad norms and final state of the whole-batch plain PyTorch loop."""
    torch.manual_seed(0)  # run.seed: the trainer seeds torch so before building the model
    if name == "cnn":
        model, data = toy.bn_cnn(), toy.images()
    elif name == "resnet":
        model, data = toy.hf_resnet(), toy.images()
    elif name == "dual_plain":  # no BatchNorm, no learnable scale: loss.temperature
        model, data = toy.dual_encoder(batch_norm=False), toy.pairs()
    else:
        model, data = toy.dual_encoder(scale=True), toy.pairs()
    model = per_group(model, group)
    losses, norms = [], []
    for step in range(STEPS):
        idx = [(step * B + i) % len(data) for i in range(B)]
        x = torch.stack([data[i][0] for i in idx])
        y = torch.stack([data[i][1] for i in idx])
        out = model(x)
        loss = info_nce(out) if name.startswith("dual") else F.cross_entropy(out, y)
        model.zero_grad()
        loss.backward()
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    state = {k.replace(".bn.", "."): v for k, v in model.state_dict().items()}
    return losses, norms, state


def read_run(out: str) -> tuple[list[float], list[float], dict]:
    rows = read_metrics(out)
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows], load_file(os.path.join(out, "model.safetensors"))


def assert_matches(out: str, ref, *, rtol: float = 1e-5) -> None:
    loss, norm, state = read_run(out)
    ref_loss, ref_norm, ref_state = ref
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0, msg=lambda m: f"{out} loss: {m}")
    torch.testing.assert_close(norm, ref_norm, rtol=rtol, atol=0, msg=lambda m: f"{out} grad_norm: {m}")
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        names = [k for k in ref_state if k.endswith(key)]
        for k in names:
            torch.testing.assert_close(state[k], ref_state[k], rtol=rtol, atol=1e-7, msg=lambda m: f"{out} {k}: {m}")


def train(out: str, model: str, *overrides: str) -> str:
    paratrain.train(load_config(None, [*COMMON, *MODELS[model], *overrides, f"run.out_dir='{out}'"]))
    return out


# --- fast: world 1 ---------------------------------------------------------------------------


def test_at_the_global_batch_it_is_torchs_batch_norm(tmp_path):
    """norm_group = the global batch, one micro-batch: torch's unmodified BatchNorm2d, trained
    by a plain loop (the definition reduces to the usual one)."""
    ref = reference("cnn", group=B)
    assert_matches(train(f"{tmp_path}/whole", "cnn", f"batch.norm_group={B}", f"batch.micro_batch_size={B}"), ref)


@pytest.mark.parametrize("model", ["cnn", "dual", pytest.param("resnet", marks=pytest.mark.slow)])
def test_world_1_matches_the_whole_batch_reference_at_any_micro_batch(tmp_path, model):
    """Also transformers' ResNet: its six BatchNorm2d are converted as a user's are."""
    ref = reference(model)
    for micro in (B, G, G // 2) if model == "cnn" else (B, G):
        if micro < G:  # a group never spans a micro-batch of one rank
            with pytest.raises(ConfigError, match="cannot hold whole BatchNorm groups"):
                train(f"{tmp_path}/m{micro}", model, f"batch.micro_batch_size={micro}")
            continue
        assert_matches(train(f"{tmp_path}/m{micro}", model, f"batch.micro_batch_size={micro}"), ref)


def test_injected_faults_fail_the_comparison(tmp_path, monkeypatch):
    """Statistics over the micro-batch, running statistics in another order, the cached gradient
    scaled by the number of micro-batches: each one fails the reference comparison."""
    cnn, dual = reference("cnn"), reference("dual")
    with monkeypatch.context() as m:  # the whole micro-batch as one group
        m.setattr(GroupBatchNorm, "_whole_groups", lambda self, x, k, record: _one_group(self, x))
        with pytest.raises(AssertionError):
            # (the start-of-run probe sees this one: the loss changes when the micro-batch is split)
            over = [f"batch.micro_batch_size={B}", "run.layout_dependent=true"]
            assert_matches(train(f"{tmp_path}/micro_stats", "cnn", *over), cnn)
    with monkeypatch.context() as m:  # each micro-batch's calls in turn, not each call's groups in order
        m.setattr(batch_norm, "ordinal", lambda call, group, *, calls, groups: group * calls + call)
        with pytest.raises(AssertionError, match="running_"):
            assert_matches(train(f"{tmp_path}/order", "dual", f"batch.micro_batch_size={G}"), dual)
    with monkeypatch.context() as m:
        loss = batch_loss.BatchLoss.loss
        m.setattr(batch_loss.BatchLoss, "loss", lambda self, o, t: _scaled(loss(self, o, t), len(self.cached)))
        with pytest.raises(AssertionError, match="scaled loss"):  # step 2, after a 4x step
            assert_matches(train(f"{tmp_path}/scaled", "dual", f"batch.micro_batch_size={G}"), dual)


def test_world_2_with_groups_across_ranks_and_accumulation(tmp_path):
    """The fast tier's multi-rank case: DDP 2 with micro-batches of 4, so every group of 8 spans
    both ranks (its sums all-reduced, its running variance unbiased over the whole group, not
    over one rank's rows) and each rank accumulates 4 micro-batches, whose shared logit scale's
    cached gradient is split over the micro-batches of every rank (dp x accumulation), against
    the plain-PyTorch reference. Both faults are invisible at world 1."""
    runs = {"dual_ddp2_span": ["dual", "parallel.dp_replicate=2", "batch.micro_batch_size=4"]}
    run_ranks(train_runs, 2, runs, str(tmp_path), timeout=300)
    assert_matches(f"{tmp_path}/dual_ddp2_span", reference("dual"))


def _one_group(module, x):
    out = F.batch_norm(x, None, None, module.weight, module.bias, True, 0.0, module.eps)
    var, mean = torch.var_mean(x.detach(), dim=[0, 2, 3], correction=1)
    return out, (mean.view(1, -1), var.view(1, -1), True)


def _scaled(term, factor):
    return None if term is None else term * factor


def test_a_user_loss_over_the_global_batch(tmp_path):
    """``loss.over = 'global_batch'`` with the user's own function: micro-batch 8 = 32."""
    user = [
        "model.args={batch_norm = false}",
        "loss.name='paratrain.testing.toy:in_batch_mean_loss'",
        "loss.over='global_batch'",
    ]
    whole = train(f"{tmp_path}/whole", "dual", *user, f"batch.micro_batch_size={B}")
    split = train(f"{tmp_path}/split", "dual", *user, "batch.micro_batch_size=4")
    (a, na, _), (b, nb, _) = read_run(whole), read_run(split)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=0)
    torch.testing.assert_close(nb, na, rtol=1e-5, atol=0)


def test_the_layout_holds_each_group_in_one_micro_step():
    """Groups wider than a micro-batch: every position once, each group at one micro-step of
    consecutive ranks; otherwise each rank's contiguous share (the default layout)."""
    for dp, micro, group in [(4, 2, 8), (4, 4, 8), (2, 4, 8), (4, 8, 8), (2, 8, 4)]:
        per = [
            rank_micro_batches(list(range(B)), dp_rank=r, dp=dp, micro_batch_size=micro, group=group) for r in range(dp)
        ]
        assert sorted(p for rank in per for mb in rank for p in mb) == list(range(B))
        for step in range(len(per[0])):
            rows = sorted(p for rank in per for p in rank[step])
            groups = {p // group for p in rows}
            assert all(sum(p // group == g for p in rows) == group for g in groups), (dp, micro, group, step)
    assert check_groups(group=8, global_batch_size=32, micro_batch_size=2, dp=2) is not None  # 4 ranks needed
    assert check_groups(group=8, global_batch_size=36, micro_batch_size=4, dp=1) is not None
    assert check_groups(group=8, global_batch_size=32, micro_batch_size=2, dp=4) is None


# --- slow: world 2 and 4 ----------------------------------------------------------------------


def train_runs(runs: dict[str, list[str]], root: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        for name, (model, *overrides) in runs.items():
            train(f"{root}/{name}", model, *overrides)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_world_2_and_4_match_the_whole_batch_reference(tmp_path):
    """DDP and FSDP2 at world 2 and 4, with accumulation, and groups spread over 2 and 4 ranks;
    the loss over the global batch with tensor parallel (tp 2, and dp 2 x tp 2); a compiled model."""
    root = str(tmp_path)
    ddp2, fsdp2 = "parallel.dp_replicate=2", "parallel.dp_shard=2"
    ddp4, fsdp4 = "parallel.dp_replicate=4", "parallel.dp_shard=4"
    world2 = {
        "cnn_ddp2": ["cnn", ddp2, "batch.micro_batch_size=16"],
        "cnn_fsdp2_accum": ["cnn", fsdp2, "batch.micro_batch_size=8"],
        "dual_ddp2_span": ["dual", ddp2, "batch.micro_batch_size=4"],
        "dual_fsdp2": ["dual", fsdp2, "batch.micro_batch_size=16"],
        "dual_plain_tp2": ["dual_plain", "parallel.tp=2", "batch.micro_batch_size=8"],
    }
    world4 = {
        "cnn_ddp4_span4": ["cnn", ddp4, "batch.micro_batch_size=2"],
        "cnn_fsdp4": ["cnn", fsdp4, "batch.micro_batch_size=8"],
        "dual_ddp4_accum": ["dual", ddp4, "batch.micro_batch_size=8"],
        "dual_fsdp4_span": ["dual", fsdp4, "batch.micro_batch_size=4"],
        "dual_plain_dp2_tp2": ["dual_plain", "parallel.dp_replicate=2", "parallel.tp=2", "batch.micro_batch_size=4"],
    }
    # torch.compile of the whole model (a user model's default): the groups' statistics recorded from it
    train(f"{root}/cnn_compiled", "cnn", "batch.micro_batch_size=8", "train.compile=true")
    run_ranks(train_runs, 2, world2, root, timeout=300)  # inside the case's 900 s: a hang names its ranks
    run_ranks(train_runs, 4, world4, root, timeout=300)  # inside the case's 900 s: a hang names its ranks
    refs = {name: reference(name) for name in ("cnn", "dual", "dual_plain")}
    for name, (model, *_) in {**world2, **world4, "cnn_compiled": ["cnn"]}.items():
        assert_matches(f"{root}/{name}", refs[model])


def test_find_batch_picks_among_micro_batches_that_hold_whole_groups():
    """``micro_batch_size = 'auto'`` and find-batch: a BatchNorm model's candidates are the
    divisors that hold whole groups (8 of 48 fits, not 12); a model without BatchNorm keeps all."""
    from paratrain.batch.auto import find_micro_batch
    from paratrain.preflight import check_run

    def picked(model: str) -> int:
        over = [
            f"model.factory='paratrain.testing.toy:{model}'",
            "data.factory='paratrain.testing.toy:images'",
            "batch.global_batch_size=48",
        ]
        cfg = load_config(None, [*over, "batch.norm_group=8", "batch.memory_gib=1", "batch.memory_margin=0"])
        dims, _ = check_run(cfg, 1)
        fits_12 = lambda m: m * (1 << 30) // 12  # noqa: E731  (a micro-batch of m fits when m <= 12)
        return find_micro_batch(cfg, dims, device=torch.device("cpu"), method="trial", measure=fits_12).micro_batch_size

    assert picked("bn_cnn") == 8 and picked("small_cnn") == 12
    with pytest.raises(ConfigError, match="batch.norm_group = 12 does not divide"):
        cfg = load_config(
            None, ["model.factory='paratrain.testing.toy:bn_cnn'", "data.factory='paratrain.testing.toy:images'"]
        )
        cfg.batch.norm_group = 12
        find_micro_batch(cfg, check_run(cfg, 1)[0], device=torch.device("cpu"), method="trial", measure=lambda m: 0)


def test_the_memory_estimate_of_a_loss_over_the_global_batch():
    """find-batch, plan and ``micro_batch_size = 'auto'`` run the step on fake tensors, where every
    host read is a placeholder: info_nce's count from the rows' shapes (a sample per row) once met
    the loss's own count read as 1, and every one of them stopped with "the loss returned item
    count 1 but counting the targets gave 64" (configs/code_search.toml, any layout)."""
    from paratrain.batch.measure import StepRunner, estimate_peak
    from paratrain.preflight import check_run

    cfg = load_config(None, [*MODELS["dual_plain"], "batch.global_batch_size=8"])
    dims, _ = check_run(cfg, 1)
    runner = StepRunner(cfg, dims, device=torch.device("cpu"))
    params = sum(p.numel() * 4 for p in runner.build()[0].parameters())
    assert estimate_peak(runner, 4) > 2 * params  # the weights and their gradients at least


def test_code_search_example_trains_and_reports_recall(tmp_path):
    """The example's data (held-out functions disjoint from the training ones), its dual encoder,
    and the eval's recall@1 and MRR over every held-out document, checked by hand on a toy."""
    from paratrain.data.code_search import PAD, code_search
    from paratrain.loss import retrieval_metrics

    train_set, val_set = code_search(seq_len=32, max_files=60), code_search(seq_len=32, split="val", max_files=60)
    assert len(val_set) >= 32 and not {q for q, _ in train_set.items} & {q for q, _ in val_set.items}
    x, _ = train_set[0]
    assert x.shape == (2, 32) and int(x.max()) <= PAD
    q = torch.eye(3)
    assert retrieval_metrics(q, q) == {"recall_at_1": 1.0, "mrr": 1.0}
    # query 0's document ranks 2nd, query 1's 1st, query 2's 3rd: recall 1/3, MRR (1/2 + 1 + 1/3) / 3
    d = torch.tensor([[0.6, 0.8, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    m = retrieval_metrics(torch.eye(3), d)
    assert m["recall_at_1"] == pytest.approx(1 / 3) and m["mrr"] == pytest.approx((1 / 2 + 1 + 1 / 3) / 3)

    over = [
        "model.factory='paratrain.models.gpt.encoder:gpt_encoder'",
        "model.args={n_layer = 1, d_model = 32, n_head = 2, block_size = 32, dim = 16}",
        "data.name='code_search'",
        "data.args={seq_len = 32, max_files = 60}",
        "loss.name='info_nce'",
        "batch.global_batch_size=16",
        "batch.micro_batch_size=4",
        "run.steps=2",
        "eval.interval=2",
        "eval.samples=32",
        "run.progress=false",
        "metrics.plot=false",
        f"run.out_dir='{tmp_path}'",
    ]
    paratrain.train(load_config(None, over))
    last = read_metrics(str(tmp_path))[-1]
    assert 0 <= last["val_recall_at_1"] <= last["val_mrr"] <= 1 and last["val_mrr"] >= 1 / 32


def test_layouts_not_covered_are_refused_in_one_line():
    """Model parallel with BatchNorm groups or a loss over the whole batch, batch.adaptive with the
    latter, and dropout drawn twice without keyed draws: each refused with the key to set."""
    from types import SimpleNamespace

    from paratrain.build import check_batch_math
    from paratrain.objectives.registry import build_loss

    def refused(model, *over, tp=1, pp=1, keyed=True):
        cfg = load_config(None, [*COMMON, *MODELS[model], *over])
        dims = SimpleNamespace(pp=pp, tp=tp, cp=1, ep=1, dp=2 // tp // pp)
        with pytest.raises(ConfigError) as e:
            check_batch_math(
                cfg, dims, toy.bn_cnn() if model == "cnn" else toy.tagger(), build_loss(cfg.loss), keyed=keyed
            )
        return str(e.value)

    from paratrain.preflight.support import check_support

    def refused_by_config(model, *over, pp=1):  # preflight/support.py, before any process starts
        cfg = load_config(None, [*COMMON, *MODELS[model], *over])
        with pytest.raises(ConfigError) as e:
            check_support(cfg, SimpleNamespace(pp=pp, tp=1, cp=1, ep=1, dp_shard=1, dp_replicate=2, fsdp_enabled=False))
        return str(e.value)

    assert "not with parallel.tp = 2; set parallel.tp = 1" in refused("cnn", tp=2)
    assert "not with parallel.pp = 2" in refused_by_config("dual", pp=2)  # tensor parallel it takes
    assert "turn it off" in refused_by_config("dual", "batch.adaptive=true")
    assert "set run.keyed_random = true" in refused("dual", keyed=False)


def test_the_second_pass_draws_the_first_passs_dropout(tmp_path, monkeypatch):
    """Dropout in the dual encoder: the gradient cache's two passes draw the same keyed masks, so
    micro-batches of 4 give micro-batch 32's losses and gradient norms; a first pass without the
    rows' keys (torch's own dropout there) does not."""
    over = ["model.args={scale = true, p = 0.2, batch_norm = false}"]
    runs = {}
    for name, micro in (("whole", B), ("split", 4)):
        runs[name] = read_run(train(f"{tmp_path}/{name}", "dual", *over, f"batch.micro_batch_size={micro}"))
    for a, b in zip(runs["split"][:2], runs["whole"][:2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    forward = step_module.no_grad_forward
    monkeypatch.setattr(
        step_module, "no_grad_forward", lambda model, batches, ctx, keys: forward(model, batches, ctx, None)
    )
    fault = read_run(train(f"{tmp_path}/fault", "dual", *over, "batch.micro_batch_size=4"))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(fault[1], runs["whole"][1], rtol=1e-5, atol=0)


def test_every_batch_norm_kind_is_converted_with_its_keys():
    """BatchNorm1d/2d/3d and SyncBatchNorm become group BatchNorms; state_dict keys and tensors stay."""
    from paratrain.models.batch_norm import NormLayout, convert_batch_norm

    model = nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm2d(3), nn.BatchNorm3d(3), nn.SyncBatchNorm(3, momentum=None))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = convert_batch_norm(model, NormLayout(group=4))
    assert len(converted) == 4 and all(isinstance(m, GroupBatchNorm) for m in model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    x = torch.randn(8, 3, 2, 2, 2)
    model[2].train()
    out = model[2](x)  # two groups of 4, each normalised on its own
    torch.testing.assert_close(out[:4], F.batch_norm(x[:4], None, None, training=True), rtol=1e-5, atol=1e-6)
    model.eval()
    torch.testing.assert_close(model[2](x), x / (1 + 1e-5) ** 0.5)  # eval: torch's, the running statistics
