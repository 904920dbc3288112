"""The Python API, Slurm rank mapping and backend choice."""

from __future__ import annotations

import importlib
import os
import re

import pytest
import torch

from paratrain.config import ConfigError, DistConfig, load_config
from paratrain.distributed.process_group import _slurm_to_torch_env, resolve_backend
from paratrain.objectives.registry import Plugin
from paratrain.preflight import check_run
from paratrain.testing.dist_utils import plain_sgd, run_ranks


def api_rank(out_dir: str) -> list[float]:
    import paratrain
    from paratrain.testing.toy import mlp, regression

    cfg = paratrain.load_config(
        None,
        [
            f"run.out_dir='{out_dir}'",
            "run.steps=5",
            "run.progress=false",
            "batch.global_batch_size=16",
            "batch.micro_batch_size=4",
            "loss.name='mse'",
            *plain_sgd(0.1),  # compared across world sizes: AdamW would grow the rounding step by step
        ],
    )
    torch.manual_seed(0)
    model = mlp()
    sse = lambda out, y: (((out - y) ** 2).sum(), y.numel())  # noqa: E731 - a user loss as a plain callable
    return paratrain.train(cfg, model=model, dataset=regression(), loss=sse)["losses"]


def test_train_api_with_user_objects_matches_across_world_sizes(tmp_path):
    one = run_ranks(api_rank, 1, str(tmp_path / "a"))[0]
    two = run_ranks(api_rank, 2, str(tmp_path / "b"))
    assert two[0] == two[1] and len(one) == 5
    torch.testing.assert_close(torch.tensor(two[0]), torch.tensor(one), rtol=1e-5, atol=0)


PLUGIN_TOY = [
    "model.args={n_layer = 2, n_head = 2, d_model = 32, block_size = 16, vocab_size = 32}",
    "data.factory='paratrain.testing.toy:toy_lm'",
    "data.args={n = 64, seq_len = 16, vocab = 32}",
    "batch.global_batch_size=8",
    "run.steps=1",
    "run.progress=false",
    "metrics.plot=false",
    *plain_sgd(0.3),
]


def plugin_rank(out_dir: str, sets: list[str], name: str = "sample_nll:plugin", passed: bool = True) -> list[float]:
    """A user's objective plug-in passed as an object (docs/objectives.md's example), not named by
    loss.name; or (``passed=False``) the same plug-in named by loss.name."""
    import importlib

    import paratrain

    module, attr = name.split(":")
    plugin = getattr(importlib.import_module(f"tests.plugins.{module}"), attr)
    named = [] if passed else [f"loss.name='tests.plugins.{name}'"]
    cfg = paratrain.load_config(None, [*PLUGIN_TOY, f"run.out_dir='{out_dir}'", *sets, *named])
    return paratrain.train(cfg, loss=plugin if passed else None)["losses"]


def test_a_plugin_passed_to_train_is_refused_where_it_says_so(tmp_path):
    """The plug-in's refused degrees hold for the object passed to train() as for loss.name: at
    cp = 2 the sample mean over half rows trained on, its loss 6.9073 against 3.4566 at world 1."""
    with pytest.raises(
        AssertionError, match=r"the loss passed to train\(\) \('sample_nll'\) does not run with parallel.cp = 2"
    ):
        run_ranks(plugin_rank, 2, str(tmp_path), ["parallel.cp=2"], timeout=120)


def _plugin(name: str) -> Plugin:
    module, attr = name.split(":")
    return getattr(importlib.import_module(f"tests.plugins.{module}"), attr)


@pytest.mark.parametrize(
    ("name", "sets", "line"),
    [
        # Passed, it trained on under run.bitwise (loss.name = 'cross_entropy' has no objective of its own).
        (
            "sample_nll:plugin",
            ["run.bitwise=true", "run.bitwise_grain=4", "batch.micro_batch_size=8"],
            "run.bitwise = true does not run with {loss} (a plug-in with its own objective)",
        ),
        # Plugin(priced=False): named or passed, the estimate and the noise probe ran on it (the
        # rows read a built-in's flag only).
        ("flags:unpriced", ["batch.micro_batch_size='auto'"], "{loss} with batch.micro_batch_size = 'auto'"),
        ("flags:unpriced", ["batch.adaptive=true"], "{loss} with batch.adaptive = true is not supported"),
        # Any objective of its own, named or passed: the probe stopped in AttributeError ... 'loss_fn'.
        (
            "sample_nll:plugin",
            ["batch.adaptive=true"],
            "{loss} (a plug-in with its own objective) with batch.adaptive = true is not supported",
        ),
    ],
)
def test_a_plugin_passed_to_train_meets_the_refusals_of_its_flags_as_when_named(name, sets, line):
    """check_run reads the run's plug-in, resolved once from loss.name or the object passed to
    train(): the same refusal either way, each naming the loss as the user gave it."""
    plugin = _plugin(name)
    for loss, words, named in (
        (None, f"loss.name = 'tests.plugins.{name}'", [f"loss.name='tests.plugins.{name}'"]),
        (plugin, f"the loss passed to train() ({plugin.name!r})", []),
    ):
        with pytest.raises(ConfigError, match=re.escape(line.format(loss=words))) as e:
            check_run(load_config(None, [*PLUGIN_TOY, *sets, *named]), 1, loss=loss)
        assert "\n" not in str(e.value)


def test_a_plugin_passed_to_train_without_image_rows_is_refused_with_an_image_text_model(tmp_path):
    """Passed, sample_nll (no Plugin(images=True)) was accepted with a tiny LLaVA (the row read
    loss.name = 'cross_entropy''s flag) and stopped the first step in a traceback: AttributeError:
    'ImageTextBatch' object has no attribute 'shape'."""
    from paratrain.testing.vlm_models import save_tiny_llava

    cfg = [f"model.hf='{save_tiny_llava(str(tmp_path / 'llava'), weights=False)}'"]
    for loss, named in ((None, ["loss.name='tests.plugins.sample_nll:plugin'"]), (_plugin("sample_nll:plugin"), [])):
        with pytest.raises(ConfigError, match="does not declare image rows"):
            check_run(load_config(None, [*cfg, *named]), 1, loss=loss)


def test_a_plugin_passed_to_train_asks_for_its_own_reference_key(tmp_path):
    """Plugin(reference='rl.reference'): passed, the build read preference.reference instead and
    stopped on it ('adapters_off' without LoRA) where the same plug-in named by loss.name trained."""
    sets = ["preference.reference='adapters_off'"]  # not this plug-in's key: never read
    named = run_ranks(plugin_rank, 1, str(tmp_path / "named"), sets, "flags:rl_reference", False, timeout=120)
    passed = run_ranks(plugin_rank, 1, str(tmp_path / "passed"), sets, "flags:rl_reference", timeout=120)
    assert passed == named and len(passed[0]) == 1


@pytest.mark.parametrize(
    ("cfg", "kwargs", "needle"),
    [
        ("configs/debug.toml", {}, "paratrain.train takes a Config, not str"),  # was AttributeError: 'dist'
        (None, {"model": torch.nn.Linear}, "takes a torch.nn.Module instance, not the class Linear"),
        (None, {"dataset": len}, "train(dataset=...) takes a map-style dataset"),
        # A string loss was "the model fails on half of the first micro-batch ...; set run.layout_dependent".
        (None, {"loss": "mse"}, "train(loss=...) takes a function (output, target)"),
    ],
)
def test_train_refuses_objects_of_the_wrong_kind_in_one_line(cfg, kwargs, needle):
    """Checked before any process group exists: one ConfigError line, not a traceback from the build."""
    import paratrain

    with pytest.raises(ConfigError) as e:
        paratrain.train(paratrain.load_config(None, []) if cfg is None else cfg, **kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_slurm_env_mapping(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        # setenv first, so that monkeypatch also removes what _slurm_to_torch_env sets: a RANK
        # left behind would make every later in-process run wait for 7 other ranks.
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[012-015],gpu020")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    _slurm_to_torch_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("3", "8", "1")
    assert os.environ["MASTER_ADDR"] == "gpu012" and os.environ["MASTER_PORT"] == str(29500 + 4242 % 1000)


def test_torchrun_variables_win_over_slurm(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    for k in ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    _slurm_to_torch_env()
    assert os.environ["RANK"] == "0"


def test_backend_choice():
    cpu = torch.device("cpu")
    assert resolve_backend(DistConfig(), cpu) == "gloo"
    assert resolve_backend(DistConfig(), torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert resolve_backend(DistConfig(backend="gloo"), torch.device("cuda", 0)) == "gloo"
    with pytest.raises(ConfigError, match="nccl' needs CUDA"):
        resolve_backend(DistConfig(backend="nccl"), cpu)


def test_train_stays_the_function_after_the_cli_is_imported():
    """`-m paratrain.train` is a module of the same name as the API function: nothing in the
    package may import it, or `paratrain.train` would become the module."""
    import paratrain
    import paratrain.cli  # noqa: F401
    import paratrain.trainer

    assert paratrain.train is paratrain.trainer.train


def test_a_loss_whose_count_disagrees_with_the_targets_fails_on_every_rank(tmp_path):
    """The loss's own item count is checked against the pre-backward count on the dp-reduced
    sums, so every rank raises the same clear error instead of one rank leaving the others."""
    from paratrain.testing.dist_utils import train_rank

    bad = [
        "model.factory='paratrain.testing.toy:mlp'",
        "data.factory='paratrain.testing.toy:regression'",
        "loss.name='paratrain.testing.toy:sse_miscounted'",
        "run.steps=1",
        "run.progress=false",
        "batch.global_batch_size=8",
        f"run.out_dir='{tmp_path}'",
    ]
    with pytest.raises(AssertionError, match="the loss returned item count 16 but counting the targets gave 8"):
        run_ranks(train_rank, 2, bad, timeout=120)
