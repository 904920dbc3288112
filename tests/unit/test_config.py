"""Config: defaults, TOML, --set precedence, and every bad input giving exit 2 with one line."""

from __future__ import annotations

import pytest

from paratrain.cli import main as cli_main
from paratrain.config import Config, ConfigError, describe_keys, load_config, to_toml
from paratrain.testing.dist_utils import paratrain_cli


def test_defaults_and_docs():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.loss.ignore_index == -100 and cfg.optim.name == "adamw"
    # Every field of every section has a docstring, and `paratrain config --keys` shows it.
    import dataclasses

    text = describe_keys()
    for section in dataclasses.fields(cfg):
        assert f"[{section.name}]" in text
        for f in dataclasses.fields(getattr(cfg, section.name)):
            doc = f.metadata.get("doc", "")
            assert len(doc) > 10, f"{section.name}.{f.name} has no docstring"
            assert doc in text


def test_toml_and_set_precedence(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[run]\nsteps = 7\nseed = 3\n[optim]\nlr = 1\n[model.args]\nn_layer = 3\n")
    cfg = load_config(path, ["run.steps=9", "model.args.d_model=16", "run.out_dir=runs/x"])
    assert cfg.run.steps == 9  # --set wins over the file
    assert cfg.run.seed == 3  # the file wins over the default
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)  # int accepted for float
    assert cfg.model.args == {"n_layer": 3, "d_model": 16}  # table keys merge
    assert cfg.run.out_dir == "runs/x"  # a bare word is a string
    # Later --set wins over an earlier one; the resolved config round-trips through TOML.
    assert load_config(path, ["run.steps=1", "run.steps=2"]).run.steps == 2
    out = tmp_path / "resolved.toml"
    out.write_text(to_toml(cfg))
    assert load_config(out) == cfg


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["run.stpes=3"], "unknown config key 'run.stpes' in --set; did you mean 'steps'?"),
        (["rnu.steps=3"], "unknown config section 'rnu'"),
        (["run.steps='ten'"], "run.steps = 'ten' has the wrong type"),
        (["run.steps=true"], "run.steps = True has the wrong type"),
        (["run.steps=0"], "run.steps = 0 must be > 0"),
        (["optim.schedule='wavy'"], "optim.schedule = 'wavy' is not allowed; use one of"),
        (["optim.min_lr_ratio=2"], "optim.min_lr_ratio = 2.0 must be within [0, 1]"),
        (["model.factory='nope.nothing:build'"], "cannot import module 'nope.nothing'"),
        (["model.factory='paratrain.testing.toy:missing'"], "has no attribute 'missing'"),
        (["model.factory='paratrain.testing.toy'"], "is malformed; write 'package.module:function'"),
        (["parallel.dp_replicate=0"], "parallel.dp_replicate = 0 must be >= 1, or -1"),
        (["steps=3"], "--set 'steps=3' is malformed"),
    ],
)
def test_bad_values(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nsteps=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    typo = tmp_path / "typo.toml"
    typo.write_text("[batch]\nglobal_bach_size = 4\n")
    with pytest.raises(ConfigError, match="did you mean 'global_batch_size'"):
        load_config(typo)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            [
                "train",
                "configs/debug.toml",
                "--set",
                "batch.global_batch_size=10",
                "--set",
                "batch.micro_batch_size=4",
                "--nproc-per-node",
                "2",
            ],
            "not divisible by micro_batch_size 4 x dp 2 = 8",
        ),
        (
            ["train", "configs/debug.toml", "--set", "batch.global_batch_size=7", "--nproc-per-node", "2"],
            "not divisible by dp = 2",
        ),
        (
            ["train", "configs/debug.toml", "--set", "parallel.dp_replicate=3", "--nproc-per-node", "2"],
            "dp_replicate 3 x dp_shard 1 x tp 1 x pp 1 = 3 != world size 2",
        ),
        (["train", "missing.toml"], "config file 'missing.toml' not found"),
        (["train", "configs/debug.toml", "--set", "model.args.n_layr=2"], "model.args.n_layr is not accepted"),
        (  # debug.toml sets model.args for its GPT; this factory takes none (it listed an empty "accepted: ")
            ["train", "configs/debug.toml", "--set", "model.factory='tests.unit.test_config:model_of_no_arguments'"],
            "model.args.n_layer is set, but model.factory takes no arguments; remove [model.args] (or --set 'model.args={}')",
        ),
        (["train", "configs/debug.toml", "--nnodes", "2"], "--nnodes > 1 needs --rdzv-endpoint"),
        (  # the flag's line came last and won: the newest checkpoint was resumed without a word
            # (an out_dir that cannot be written: without the refusal nothing starts either)
            [
                "train",
                "configs/debug.toml",
                "--resume",
                "--set",
                "checkpoint.resume='/missing'",
                "--set",
                "run.out_dir='/dev/null/x'",
            ],
            "--resume and --set checkpoint.resume='/missing' name different checkpoints; keep one of them",
        ),
        (["generate", "/nonexistent"], "not found; pass the run.out_dir"),
        # Checked before the run is read (a negative --top-k was torch's traceback).
        (["generate", "/nonexistent", "--top-k", "-3"], "generate --top-k -3: must be >= 0"),
        (["generate", "/nonexistent", "--max-new-tokens", "0"], "generate --max-new-tokens 0: must be >= 1"),
        (["generate", "/nonexistent", "--temperature", "-1"], "generate --temperature -1.0: must be >= 0"),
    ],
)
def test_cli_bad_input_exit_2_one_line(argv, needle, capsys):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def model_of_no_arguments():
    """A model.factory that takes no arguments."""
    import torch

    return torch.nn.Linear(4, 4)


def test_cli_subprocess_exit_code_and_no_traceback():
    res = paratrain_cli("train", "configs/debug.toml", "--set", "run.stepz=2")
    assert res.returncode == 2
    assert res.stderr.strip() == "paratrain: error: unknown config key 'run.stepz' in --set; did you mean 'steps'?"
