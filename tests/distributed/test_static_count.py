"""The data path's static item count (ItemLoss.items_per_sample): no count all-reduce.

A plain token stream declares ``items_per_sample`` (data/datasets.py); the step then computes
the global item count as arithmetic instead of counting and reducing it before the backward.
Checked at dp 2 against the counted path (the previous behaviour, still used by masked data):
the same counts, the same losses and gradient norms bitwise; a wrong declaration is caught by
the loss's own reduced count, on every rank at the same step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.data import Dataset

from paratrain.config import ConfigError, DataConfig, DistConfig, LossConfig, ParallelConfig
from paratrain.data.datasets import build_dataset, static_items_per_sample
from paratrain.data.sampler import load_batches, rank_slice
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.parallelize import parallelize
from paratrain.distributed.process_group import close_distributed, init_distributed
from paratrain.models.gpt import GPT_SPEC, build_gpt
from paratrain.objectives import BalanceLoss, ItemLoss
from paratrain.objectives.registry import build_loss, plugin_of
from paratrain.step import GlobalCount, StepContext, count_global_items, train_step
from paratrain.testing.dist_utils import run_ranks
from paratrain.trainer import static_item_count

GPT_ARGS = dict(n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=32)
SEQ = 16


class Stream(Dataset):
    """Windows of a random token stream: every target counts, as in stdlib_bytes."""

    def __init__(self, n: int = 32, items_per_sample: int | None = SEQ):
        g = torch.Generator().manual_seed(3)
        self.data = torch.randint(0, 32, (n * SEQ + 1,), generator=g)
        self.n = n
        if items_per_sample is not None:
            self.items_per_sample = items_per_sample

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        w = self.data[i * SEQ : i * SEQ + SEQ + 1]
        return w[:-1], w[1:]


def _rank(steps: int = 2) -> dict:
    """dp 2: the counts both ways, then ``steps`` SGD steps of identical models, counted, static
    and static with a wrong declaration (one item more per sample); returns what each rank saw."""
    ctx = init_distributed(DistConfig())
    try:
        cfg = ParallelConfig(dp_replicate=2)
        dims = ParallelDims.from_config(cfg, ctx.world_size)
        loss_fn = build_loss(LossConfig())
        counted = StepContext(objectives=(ItemLoss(loss_fn),), device=ctx.device, dp=dims.dp, dp_group=dims.group("dp"))
        static = replace(counted, objectives=(ItemLoss(loss_fn, items_per_sample=SEQ),))
        # the fault: a wrong declaration
        wrong = replace(counted, objectives=(ItemLoss(loss_fn, items_per_sample=SEQ + 1),))
        data = Stream()
        out = {"counted": [], "static": [], "wrong": [], "error": None}
        for name, step_ctx in (("counted", counted), ("static", static), ("wrong", wrong)):
            torch.manual_seed(0)
            model = parallelize(build_gpt(**GPT_ARGS), dims, cfg=cfg, device=ctx.device, spec=GPT_SPEC)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            for s in range(steps):
                mine = rank_slice(list(range(s * 8, s * 8 + 8)), dp_rank=dims.local_rank_in("dp"), dp=dims.dp)
                batches = load_batches(data, mine, 2)  # 2 micro-batches of 2 rows per rank
                if s == 0 and name != "wrong":
                    # The loss's items and, through an objective whose unit is a row, the rows.
                    out[f"{name}_counts"] = count_global_items(
                        batches,
                        objectives=(*step_ctx.objectives, BalanceLoss(())),
                        dp_group=step_ctx.dp_group,
                        dp=step_ctx.dp,
                    )
                try:
                    r = train_step(model, opt, batches, step_ctx)
                except ConfigError as e:
                    out["error"] = (name, s, str(e))
                    break
                out[name].append((r.loss, r.grad_norm, r.items, r.tokens))
        return out
    finally:
        close_distributed(ctx)


def test_static_count_is_the_counted_one_and_a_wrong_one_is_caught():
    ranks = run_ranks(_rank, 2, timeout=120)
    for r in ranks:
        # 8 rows of 16 targets: the arithmetic count is the reduced one, tokens and rows too.
        assert r["static_counts"] == r["counted_counts"] == GlobalCount((8 * SEQ, 8), 8 * SEQ, None)
        assert len(r["static"]) == 2 and r["static"] == r["counted"]  # bitwise: same losses and norms
        # The wrong declaration: the loss's own reduced count disagrees, on every rank at step 1.
        assert r["error"] is not None and r["error"][:2] == ("wrong", 0), r["error"]
        assert "items_per_sample" in r["error"][2] and f"gave {8 * (SEQ + 1)}" in r["error"][2]
    assert ranks[0]["static"] == ranks[1]["static"]


def test_which_data_paths_declare_a_static_count():
    stdlib = build_dataset(DataConfig(name="stdlib_bytes", args={"block_size": 16, "max_bytes": 20_000}))
    assert static_items_per_sample(stdlib) == 16
    counted = lambda cfg, fn=None: static_item_count(stdlib, cfg, plugin_of(cfg, fn))  # noqa: E731
    assert counted(LossConfig()) == 16
    assert counted(LossConfig(name="mse")) == 16
    # A loss that could skip a target, or counts its own way: counted and reduced as before.
    assert counted(LossConfig(ignore_index=0)) is None
    assert counted(LossConfig(), lambda output, target: (output.sum(), 1)) is None
    assert static_items_per_sample(torch.utils.data.Subset(stdlib, range(4))) is None  # wrappers hide it
    assert static_items_per_sample(Stream(items_per_sample=None)) is None
    with pytest.raises(ConfigError, match="items_per_sample"):
        static_items_per_sample(Stream(items_per_sample=0))


def test_a_tensor_dataset_s_count_is_read_off_its_targets():
    """TensorDataset(inputs, targets): the count is every target element when none is the ignore
    index (cross-entropy) or every one counts (mse); counted and reduced otherwise."""
    from torch.utils.data import TensorDataset

    def counted(dataset, cfg, fn=None):
        return static_item_count(dataset, cfg, plugin_of(cfg, fn))

    user = lambda output, target: (output.sum(), 1)  # noqa: E731  (a loss of one's own: counts its own way)
    x, y = torch.zeros(6, 8, dtype=torch.long), torch.ones(6, 8, dtype=torch.long)
    assert counted(TensorDataset(x, y), LossConfig()) == 8
    assert counted(TensorDataset(x, y.float()), LossConfig(name="mse")) == 8
    y[3, 2] = -100  # one ignored target: the count varies by sample
    assert counted(TensorDataset(x, y), LossConfig()) is None
    assert counted(TensorDataset(x, y), LossConfig(name="mse")) == 8
    assert counted(TensorDataset(x, y.float()), LossConfig()) is None  # soft targets
    assert counted(TensorDataset(x, x, y), LossConfig()) is None
    assert counted(TensorDataset(x, torch.ones(6, 8, dtype=torch.long)), LossConfig(), user) is None


def _trainer_rank(out_dir: str) -> tuple:
    import paratrain
    import paratrain.trainer as T

    seen = []
    step = T.train_step

    def recording(model, optimizer, batches, ctx, **kwargs):
        seen.append(ctx.objectives[0].items_per_sample)
        return step(model, optimizer, batches, ctx, **kwargs)

    T.train_step = recording
    cfg = paratrain.load_config(
        None,
        [
            f"run.out_dir='{out_dir}'",
            "run.steps=1",
            "run.save_model=false",
            "metrics.plot=false",
            "model.args={n_layer=1, n_head=2, d_model=16, block_size=16}",
            "data.args={block_size=16, max_bytes=20000}",
            "batch.global_batch_size=4",
        ],
    )
    summary = paratrain.train(cfg)
    return seen, summary["tokens"]


@pytest.mark.slow  # a whole run in process; the dp 2 step test above is the fast case
def test_the_trainer_hands_the_static_count_to_the_step(tmp_path):
    # The main job's data path (stdlib_bytes, cross_entropy): the step's loss gets items_per_sample.
    ((seen, tokens),) = run_ranks(_trainer_rank, 1, str(tmp_path), timeout=120)
    assert seen == [16] and tokens == 4 * 16
