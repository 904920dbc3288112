"""The start-of-run layout probe (paratrain/preflight/probe.py, docs/layout-probe.md): a model whose loss
depends on how the batch is split stops the run with exit 2 and one line naming the first module
that differs; a layout-exact model trains, and the probe leaves the run's generators, buffers and
modes as they were. The models below are user factories (``model.factory``)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from torch import nn

import paratrain
from paratrain.config import ConfigError, load_config
from paratrain.objectives import build_objectives
from paratrain.objectives.registry import build_loss
from paratrain.preflight.probe import probe_micro_batch
from paratrain.step import StepContext
from paratrain.testing.dist_utils import paratrain_cli

pytestmark = pytest.mark.timeout(120)


class BatchNormNet(nn.Module):
    """A regression MLP with BatchNorm over its rows. ``rank``: the BatchNorm runs on that rank
    only (the others compute a layout-exact function, so only that rank's probe finds it)."""

    def __init__(self, dim: int = 8, hidden: int = 16, rank: int | None = None):
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.head = nn.Linear(hidden, 1)
        self.rank = rank

    def forward(self, x):
        h = self.fc(x)
        if self.rank is None or int(os.environ.get("RANK", "0")) == self.rank:
            h = self.bn(h)
        return self.head(torch.tanh(h))


class Noise(nn.Module):
    """Gaussian noise from the global generator, drawn in place (``Tensor.normal_``): not one of
    the draws the keyed path takes over (``torch.randn_like(x)`` would be keyed by the row)."""

    def forward(self, x):
        return x + 0.1 * torch.empty_like(x).normal_() if self.training else x


class SharedNoise(nn.Module):
    """Noise of one row shared by every row (``torch.randn(1, d)``): not a draw the keyed path
    takes (its first dimension is not the rows)."""

    def forward(self, x):
        return x + 0.1 * torch.randn(1, x.shape[-1]) if self.training else x


class NoisyNet(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16, shared: bool = False):
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.noise = SharedNoise() if shared else Noise()
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.noise(self.fc(x))))


def batch_norm_net(rank: int | None = None) -> nn.Module:
    return BatchNormNet(rank=rank)


def noisy_net(shared: bool = False) -> nn.Module:
    return NoisyNet(shared=shared)


REGRESSION = [
    "data.factory='paratrain.testing.toy:regression'",
    "loss.name='mse'",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "run.steps=2",
    "run.progress=false",
    "metrics.plot=false",
    "run.save_model=false",
]
GPT = [
    "model.name='gpt'",
    "model.args={n_layer = 2, n_head = 2, d_model = 32, block_size = 16, vocab_size = 32, dropout = 0.1}",
    "data.factory='paratrain.testing.toy:toy_lm'",
    "data.args={n = 32, seq_len = 16, vocab = 32}",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "run.steps=1",
    "run.progress=false",
    "metrics.plot=false",
    "run.save_model=false",
]


def train(tmp_path, *overrides: str) -> dict:
    return paratrain.train(load_config(None, [*overrides, f"run.out_dir='{tmp_path}'"]))


def cli_args(tmp_path, *overrides: str) -> list[str]:
    """``CONFIG --set ...`` for ``paratrain train``: an empty config file (every key's default) and the overrides."""
    config = tmp_path / "empty.toml"
    config.write_text("")
    return [str(config), *(a for o in overrides for a in ("--set", o))]


def one_error_line(stderr: str) -> str:
    """The one ``paratrain: error:`` line of a failed command (the log lines before it aside)."""
    errors = [line for line in stderr.splitlines() if line.startswith("paratrain: error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


def test_batch_norm_stops_train_with_exit_2_naming_the_module_and_is_accepted_when_asked(tmp_path):
    model = "model.factory='tests.distributed.test_probe:batch_norm_net'"  # torch's BatchNorm (batch.norm_group = 0)
    stop = [model, "batch.norm_group=0", f"run.out_dir='{tmp_path}/stop'"]
    res = paratrain_cli("train", *cli_args(tmp_path, *REGRESSION, *stop), timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    err = one_error_line(res.stderr)
    assert "layout probe: the first micro-batch's loss differs" in err, err
    assert "first differing module: 'bn' (BatchNorm1d): batch statistics (BatchNorm)" in err, err
    assert "set run.layout_dependent = true" in err, err
    assert (tmp_path / "stop" / "metrics.jsonl").read_text() == ""  # stopped before the first step

    summary = train(tmp_path / "accepted", *REGRESSION, model, "batch.norm_group=0", "run.layout_dependent=true")
    assert summary["steps"] == 2


def test_unkeyed_noise_is_named_with_its_cause(tmp_path):
    with pytest.raises(ConfigError) as e:
        train(tmp_path, *REGRESSION, "model.factory='tests.distributed.test_probe:noisy_net'")
    msg = str(e.value)
    assert "first differing module: 'noise' (Noise): random draws outside the keyed path" in msg, msg
    # run.probe = false: the run trains (silently layout-dependent, as asked)
    assert train(
        tmp_path / "off", *REGRESSION, "model.factory='tests.distributed.test_probe:noisy_net'", "run.probe=false"
    )


def test_a_draw_shared_by_the_rows_is_not_said_to_be_keyed(tmp_path, capsys):
    """torch.randn(1, d) in a forward: the start-up line says it is not keyed by the sample (it
    said "keyed by the sample", which the probe then contradicted), and the probe names it."""
    with pytest.raises(ConfigError) as e:
        train(
            tmp_path,
            *REGRESSION,
            "model.factory='tests.distributed.test_probe:noisy_net'",
            "model.args={shared = true}",
        )
    said = capsys.readouterr().err
    assert "random draws: the forward draws (randn); randn of shape (1, 16) is not keyed by the sample" in said, said
    assert "): keyed by the sample" not in said, said
    assert "first differing module: 'noise' (SharedNoise): random draws outside the keyed path" in str(e.value)


def test_gpt_dropout_passes_keyed_and_names_the_attention_unkeyed(tmp_path, capsys):
    assert train(tmp_path / "keyed", *GPT)["steps"] == 1
    said = capsys.readouterr().err
    assert "layout probe: the first micro-batch's loss and output (4 rows) are the same whole and split" in said, said
    with pytest.raises(ConfigError) as e:
        train(tmp_path / "unkeyed", *GPT, "run.keyed_random=false")
    msg = str(e.value)
    # The attention's dropout is inside scaled_dot_product_attention: its o_proj is the first
    # call whose output differs, with its input already different, so the attention is named.
    assert "first differing module: 'layers.0.attn' (Attention), in its own forward before" in msg, msg
    assert "random draws outside the keyed path" in msg, msg


def _ctx(loss: str = "mse") -> StepContext:
    cfg = load_config(None, [f"loss.name='{loss}'"])
    return StepContext(objectives=build_objectives(build_loss(cfg.loss, None)), device=torch.device("cpu"))


def _generators():
    return torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


@pytest.mark.parametrize("net", [lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)), NoisyNet])
def test_probe_leaves_generators_buffers_and_modes_as_they_were(net):
    """A plain model passes; a drawing one is found; after either, the global generators, the
    BatchNorm's running statistics and each module's mode are as before (the run's trajectory
    does not change)."""
    torch.manual_seed(0)
    model = net()
    model.eval()
    model[0].train() if isinstance(model, nn.Sequential) else model.noise.train()
    modes = [m.training for m in model.modules()]
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    torch.rand(3), random.random(), np.random.rand()  # some state, not the seed's first
    before = _generators()
    finding = probe_micro_batch(model, x, y, ctx=_ctx())
    after = _generators()
    assert torch.equal(before[0], after[0]) and before[1] == after[1] and (before[2] == after[2]).all()
    assert [m.training for m in model.modules()] == modes
    assert (finding.line is None) == isinstance(model, nn.Sequential), finding.line

    bn = BatchNormNet()
    stats = [b.clone() for b in bn.buffers()]
    finding = probe_micro_batch(bn, x, y, ctx=_ctx())
    assert finding.line is not None and "'bn' (BatchNorm1d)" in finding.line
    assert all(torch.equal(a, b) for a, b in zip(stats, bn.buffers(), strict=True))
    assert bn.training


def test_a_loss_that_fails_on_the_whole_micro_batch_is_not_called_a_layout_finding():
    """A user loss that returns a bare tensor fails on the whole micro-batch: its own line stops
    the run, not "the model fails on half of the first micro-batch ...; set run.layout_dependent
    = true to accept" (which would not have helped)."""
    sse = lambda out, y: ((out - y) ** 2).sum()  # noqa: E731 - no item count: bad input
    ctx = StepContext(
        objectives=build_objectives(build_loss(load_config(None, []).loss, sse)), device=torch.device("cpu")
    )
    finding = probe_micro_batch(nn.Linear(8, 1), torch.randn(4, 8), torch.randn(4, 1), ctx=ctx)
    assert finding.broken and "half" not in finding.line, finding.line
    assert finding.line.endswith("a user loss must return (sum_of_item_losses, item_count); it returned Tensor")


def test_two_ranks_stop_together_when_only_one_finds_it(tmp_path):
    """BatchNorm on rank 1 only: rank 0's own probe passes, yet both ranks stop with exit 2 and
    rank 1's line (the findings are gathered), instead of rank 0 waiting in the first step."""
    model = [
        "model.factory='tests.distributed.test_probe:batch_norm_net'",
        "model.args={rank = 1}",
        "batch.norm_group=0",
    ]
    res = paratrain_cli(
        "train",
        *cli_args(tmp_path, *REGRESSION, *model, f"run.out_dir='{tmp_path}/run'", "dist.timeout_s=60"),
        "--nproc-per-node",
        "2",
        timeout=110,
    )
    assert res.returncode == 2, res.stderr[-3000:]
    err = one_error_line(res.stderr)
    assert "(rank 1); first differing module: 'bn' (BatchNorm1d)" in err, err
    # The launcher's rank is the finder's: rank 0 stops a moment after it (it was a race, and
    # "worker rank 0 failed first" stood beside "(rank 1)").
    assert err.startswith("paratrain: error: worker rank 1 failed first (exit code 2): layout probe:"), err


def train_rank_stopped(overrides: list[str]) -> str | None:
    """One rank of a training (run_ranks): the probe's line it stopped with, None when it trained."""
    from paratrain.testing.dist_utils import train_rank

    try:
        train_rank(overrides)
    except ConfigError as e:
        return str(e)
    return None


def test_every_rank_raises_the_same_line_without_a_launcher(tmp_path):
    """Without a launcher that ends the other workers when one fails (torchrun's agent does), the
    gathered findings are what stops rank 0: it raises rank 1's line instead of training on."""
    from paratrain.testing.dist_utils import run_ranks

    model = [
        "model.factory='tests.distributed.test_probe:batch_norm_net'",
        "model.args={rank = 1}",
        "batch.norm_group=0",
    ]
    lines = run_ranks(
        train_rank_stopped, 2, [*REGRESSION, *model, f"run.out_dir='{tmp_path}'", "dist.timeout_s=30"], timeout=90
    )
    assert lines[0] is not None and lines[0] == lines[1], lines
    assert "(rank 1); first differing module: 'bn' (BatchNorm1d)" in lines[0], lines[0]
