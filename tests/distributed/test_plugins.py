"""A user's objective from the user's own package (loss.name = 'package.module:name' naming an
objectives.registry.Plugin) runs through the same plug-in API as the built-in ones, and is exact
on every layout: world 1 against dp 2 with accumulation 2 under plain SGD, loss and grad_norm.
Anchor: at equal lengths the mean of the samples' token means is the token mean, so step 1
equals the built-in cross-entropy's. The wrong variant (a per-micro-batch mean) fails."""

from __future__ import annotations

import pytest
import torch

from paratrain.config import ConfigError, LossConfig, load_config
from paratrain.objectives.registry import BUILTIN, Plugin, plugin_of
from paratrain.preflight import check_run
from paratrain.testing.dist_utils import paratrain_cli, plain_sgd, read_metrics, run_ranks, train_rank

TOY = [
    "model.args={n_layer = 2, n_head = 2, d_model = 32, block_size = 16, vocab_size = 32}",
    "data.factory='paratrain.testing.toy:toy_lm'",
    "data.args={n = 64, seq_len = 16, vocab = 32}",
    "batch.global_batch_size=8",
    "run.steps=3",
    "run.progress=false",
    "metrics.plot=false",
    *plain_sgd(0.3),
]


# Samples of equal length (every byte a target): the mean of the samples' token means is the token mean.
EQUAL = [
    "model.args={n_layer = 2, n_head = 2, d_model = 32, block_size = 16, vocab_size = 256}",
    "data.factory=''",
    "data.name='stdlib_bytes'",
    "data.args={block_size = 16, max_bytes = 20000}",
]


def _run(tmp_path, name: str, loss: str, *extra: str, world: int = 1, micro: int = 8):
    out = tmp_path / name
    over = [*TOY, *extra, f"loss.name='{loss}'", f"batch.micro_batch_size={micro}", f"run.out_dir='{out}'"]
    run_ranks(train_rank, world, over)
    rows = read_metrics(str(out))
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


def test_a_users_plugin_is_anchored_to_the_builtin_cross_entropy(tmp_path):
    """Its exactness on the layouts and its wrong variant: the `verify --layouts` test below."""
    one = _run(tmp_path, "one", "tests.plugins.sample_nll:plugin")
    # toy_lm's samples hold unequal numbers of targets: the sample mean is another loss than the token mean
    assert one[0][0] != pytest.approx(_run(tmp_path, "ce", "cross_entropy")[0][0], rel=1e-4)
    equal = _run(tmp_path, "equal", "tests.plugins.sample_nll:plugin", *EQUAL)
    builtin = _run(tmp_path, "equal_ce", "cross_entropy", *EQUAL)
    torch.testing.assert_close(equal[0][0], builtin[0][0], rtol=1e-6, atol=0)
    torch.testing.assert_close(equal[1][0], builtin[1][0], rtol=1e-5, atol=0)


def test_the_registry_is_the_one_place_that_names_the_losses():
    """Every built-in is a Plugin; a user's function becomes one, a user's Plugin is taken as it
    is, an unknown name is one line naming the built-ins."""
    assert set(BUILTIN) == {"cross_entropy", "mse", "info_nce", "preference", "reward", "distill", "grpo"}
    assert plugin_of(LossConfig(name="tests.plugins.sample_nll:plugin")).name == "sample_nll"
    user = plugin_of(LossConfig(), lambda output, target: (output.sum(), 1))
    assert isinstance(user, Plugin) and not user.builtin and user.objective is None
    with pytest.raises(ConfigError, match="names an Objective class; name a Plugin"):
        plugin_of(LossConfig(name="tests.plugins.sample_nll:SampleNLL"))
    with pytest.raises(ConfigError, match="loss.name = 'hinge' is unknown; use one of 'cross_entropy'"):
        plugin_of(LossConfig(name="hinge"))
    with pytest.raises(ConfigError, match="loss.name = 'hinge' is unknown"):  # before any process starts
        check_run(load_config(None, ["loss.name='hinge'"]), 1)


VERIFY = """
[run]
steps = 2
[model]
args = { n_layer = 2, n_head = 2, d_model = 32, block_size = 16, vocab_size = 32 }
[data]
factory = "paratrain.testing.toy:toy_lm"
args = { n = 64, seq_len = 16, vocab = 32 }
[batch]
global_batch_size = 8
[loss]
name = "tests.plugins.sample_nll:plugin"
[optim]
lr = 0.3
"""


def test_verify_layouts_reports_a_users_plugin_exact_and_its_per_micro_batch_mean_off(tmp_path):
    """`paratrain verify --layouts` on the user's plug-in: dp 2 x accumulation 2 within 1e-4 of one
    process under plain SGD, cp refused as the plug-in declares, pp refused (no pipeline hooks);
    the per-micro-batch variant is reported with its relative differences and exit code 1: at
    accumulation 4 its step-1 gradient is four micro-batch means, 4 times the global mean's."""
    cfg = tmp_path / "plugin.toml"
    cfg.write_text(VERIFY)
    # The three waits (140 + 50 + 90 s) fit inside pytest's 300 s: a hang reports its own command.
    r = paratrain_cli(
        "verify", str(cfg), "--layouts", "ddp,cp,pp", "--steps", "2", "--out-dir", str(tmp_path / "ok"), timeout=140
    )
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "verify: OK" in r.stdout and "cp      refused: " in r.stdout and "pipeline hooks" in r.stdout, r.stdout
    ddp = next(line.split() for line in r.stdout.splitlines() if line.startswith("ddp "))
    assert max(float(x) for x in ddp[2:5]) < 1e-4, r.stdout  # loss, grad_norm, parameters
    # Every layout asked for refused: nothing verified, never an "OK".
    r = paratrain_cli("verify", str(cfg), "--layouts", "cp,pp", "--out-dir", str(tmp_path / "none"), timeout=50)
    assert r.returncode == 1 and "verify: nothing verified" in r.stdout, r.stdout + r.stderr[-2000:]
    wrong = "loss.name='tests.plugins.sample_nll:per_micro_batch'"
    r = paratrain_cli(
        "verify", str(cfg), "--layouts", "accum", "--steps", "1", "--out-dir", str(tmp_path / "wrong"), "--set", wrong,
        timeout=90,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    assert "verify: FAILED past tolerance 1e-04: accum (grad_norm, parameters)" in r.stdout, r.stdout
    accum = next(line.split() for line in r.stdout.splitlines() if line.startswith("accum "))
    assert float(accum[3]) == pytest.approx(3.0, rel=1e-4)  # four micro-batch means: |4g - g| / |g|
