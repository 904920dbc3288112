"""A multi-node job needs one run.out_dir that every node sees (preflight/shared.py, issue 55 item
2): two ranks whose folders differ, as two nodes with node-local disks, are both refused with the
same one line; one shared folder passes, and the check leaves nothing in it. And a resume that
finds no checkpoint where the run's metrics record steps is refused, not started over."""

from __future__ import annotations

import json
import os

from paratrain.testing.dist_utils import run_ranks, train_rank
from paratrain.testing.resilience import TOY


def _check(folders: list[str]) -> str | None:
    """One "node" per rank: the check on this rank's own folder; its refusal line or None."""
    from paratrain.config import ConfigError, DistConfig
    from paratrain.distributed.process_group import init_distributed
    from paratrain.preflight.shared import check_shared_folders

    ctx = init_distributed(DistConfig())
    os.environ["GROUP_RANK"] = str(ctx.rank)  # one process per node, as torchrun would number them
    try:
        check_shared_folders({"run.out_dir": folders[ctx.rank]}, rank=ctx.rank, world_size=2, device=ctx.device)
    except ConfigError as e:
        return str(e)
    return None


def test_nodes_that_do_not_share_run_out_dir_are_refused_on_every_rank(tmp_path):
    local = [str(tmp_path / "node0" / "run"), str(tmp_path / "node1" / "run")]
    os.makedirs(local[1])
    lines = run_ranks(_check, 2, local, timeout=120)
    for rank, line in enumerate(lines):
        assert line is not None and "\n" not in line, lines
        assert line.startswith(f"run.out_dir = '{local[rank]}' is not shared between the nodes (node 1 "), line
        assert "does not see rank 0's files" in line and "docs/checkpoints.md" in line
    assert not os.path.exists(tmp_path / "node0"), "rank 0's folder, made for the check, is removed"
    assert os.listdir(local[1]) == []


def test_one_shared_folder_passes_and_keeps_nothing(tmp_path):
    shared = str(tmp_path / "run")
    assert run_ranks(_check, 2, [shared, shared], timeout=120) == [None, None]
    assert os.listdir(shared) == []


def _refusal(overrides: list[str]) -> str | None:
    from paratrain.config import ConfigError

    try:
        train_rank(overrides)
    except ConfigError as e:
        return str(e)
    return None


def test_resume_without_checkpoints_over_recorded_steps_is_refused_on_every_rank(tmp_path):
    """The issue's (b): the node that got rank 0 found no checkpoint and trained 30 steps again,
    exit 0. Both ranks refuse with rank 0's line; nothing is trained or written."""
    rows = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 31))
    (tmp_path / "metrics.jsonl").write_text(rows)
    sets = [*TOY, f"run.out_dir='{tmp_path}'", "checkpoint.resume='latest'"]
    lines = run_ranks(_refusal, 2, sets, timeout=180)
    assert lines[0] == lines[1] and "records 30 steps" in lines[0] and "--overwrite" in lines[0], lines
    assert (tmp_path / "metrics.jsonl").read_text() == rows
