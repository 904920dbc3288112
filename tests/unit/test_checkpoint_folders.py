"""Checkpoint folders on one rank, no process group: what a damaged manifest is called, what
``checkpoint.keep`` prunes of the folders moved aside (step-N.replaced-*), and a resume with
another optimiser."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest
import torch

from paratrain.checkpoint.checkpointer import Checkpointer
from paratrain.checkpoint.manifest import MANIFEST, find_latest
from paratrain.checkpoint.state import DataclassState, ModelState, OptimizerState
from paratrain.config import CheckpointConfig, ConfigError


@dataclasses.dataclass
class _State:
    step: int = 0


def _checkpointer(root, *, keep: int = 2, optimizer=None) -> Checkpointer:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    state = _State()
    stateful = {"model": ModelState(model), "train_state": DataclassState(state)}
    if optimizer is not None:
        opt = optimizer(model.parameters())
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        stateful["optim"] = OptimizerState(model, opt)
    return Checkpointer(
        CheckpointConfig(dir=str(root), keep=keep),
        out_dir=str(root),
        config_toml="",
        stateful=stateful,
        train_state=state,
        layout={},
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        timeout_s=30,
    )


def _save(ck: Checkpointer, step: int) -> None:
    ck.state.step = step
    ck.save(step)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_emptied_manifest_is_called_damaged_and_pruned_by_keep(tmp_path, caplog):
    ck = _checkpointer(tmp_path, keep=2)
    _save(ck, 1)
    _save(ck, 2)
    open(tmp_path / "step-2" / MANIFEST, "w").close()  # emptied (a full disk, a bad copy)
    caplog.set_level(logging.WARNING, logger="paratrain")
    assert find_latest(str(tmp_path)) == str(tmp_path / "step-1")  # skipped on resume, with a line
    _save(ck, 2)  # the run reaches step 2 again
    moved = [r.getMessage() for r in caplog.records if "moved it to" in r.getMessage()]
    assert len(moved) == 1 and "is damaged" in moved[0] and "another run" not in moved[0], moved
    aside = [n for n in os.listdir(tmp_path) if n.startswith("step-2.replaced-")]
    assert len(aside) == 1
    _save(ck, 3)
    _save(ck, 4)  # keep = 2: step-3 and step-4 stay; step-2 and what was moved aside from it go
    assert sorted(os.listdir(tmp_path)) == ["step-3", "step-4"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_another_runs_checkpoint_is_moved_aside_and_never_pruned(tmp_path, caplog):
    other = _checkpointer(tmp_path, keep=2)
    _save(other, 2)
    ck = _checkpointer(tmp_path, keep=1)
    caplog.set_level(logging.WARNING, logger="paratrain")
    _save(ck, 2)
    moved = [r.getMessage() for r in caplog.records if "moved it to" in r.getMessage()]
    assert len(moved) == 1 and f"another run (run_id {other.run_id})" in moved[0], moved
    _save(ck, 3)
    names = sorted(os.listdir(tmp_path))
    assert names[0].startswith("step-2.replaced-") and names[1:] == ["step-3"], names
    with open(tmp_path / names[0] / MANIFEST) as f:
        assert json.load(f)["run_id"] == other.run_id


def test_a_failure_after_a_checkpoint_never_leaves_it_without_its_metrics_row(tmp_path, monkeypatch):
    """Nothing that can fail sits between step N's checkpoint and its metrics row: a collective
    there (the per-rank stats' all-gather) fails when a peer is lost after the save, and the
    resumed run would hold checkpoint step-N without row N (an elastic job lost row 4 that way).
    Here the stats fail at step 2, whose checkpoint (interval 2) must then not exist without row 2."""
    import paratrain
    from paratrain.config import load_config
    from paratrain.observability.rank_stats import RankStats

    row = RankStats.row

    def lost_peer(self, *, step, **kw):
        if step == 2:
            raise RuntimeError("a peer was lost")
        return row(self, step=step, **kw)

    monkeypatch.setattr(RankStats, "row", lost_peer)
    out = tmp_path / "run"
    tiny = ["model.args={n_layer = 1, n_head = 2, d_model = 16, block_size = 32}", "data.args.max_bytes=20000"]
    sets = [*tiny, f"run.out_dir='{out}'", "run.steps=4", "run.progress=false", "metrics.plot=false"]
    with pytest.raises(RuntimeError, match="a peer was lost"):
        paratrain.train(load_config("configs/debug.toml", [*sets, "checkpoint.interval=2"]))
    rows = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    folders = os.listdir(out / "checkpoints") if (out / "checkpoints").exists() else []
    saved = [int(d.split("-")[1]) for d in folders if (out / "checkpoints" / d / MANIFEST).exists()]
    assert all(step in rows for step in saved), (saved, rows)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_resume_with_another_optimiser_is_one_line(tmp_path):
    """AdamW's checkpoint resumed with SGD's momentum (optim.name changed): DCP stopped every rank
    with a 'Missing key in checkpoint state_dict: optim.state...momentum_buffer' traceback."""
    _save(_checkpointer(tmp_path, optimizer=lambda p: torch.optim.AdamW(p, lr=0.1)), 1)
    sgd = _checkpointer(tmp_path, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    with pytest.raises(ConfigError, match="holds no optimiser state 'momentum_buffer' of weight"):
        sgd.load(str(tmp_path / "step-1"))
    _checkpointer(tmp_path, optimizer=lambda p: torch.optim.AdamW(p, lr=0.1)).load(str(tmp_path / "step-1"))
