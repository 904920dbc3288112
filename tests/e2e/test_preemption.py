"""Preemption's agreement rides the step's own reduce: a SIGTERM that reaches one rank only (one
node, or one tensor-parallel peer) stops every rank after the same step, with the same losses as
the uninterrupted run up to it; and the exit code every launcher of a preempted job returns."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from paratrain.checkpoint import verify_checkpoint
from paratrain.distributed.process_group import free_port
from paratrain.testing.dist_utils import REPO, read_metrics, run_ranks, train_rank
from paratrain.testing.resilience import SGD, SLOW, TOY, column, wait_for_rows

BASE = [*TOY, *SGD, "checkpoint.interval=0", "checkpoint.at_end=false", "dist.timeout_s=60"]


@pytest.mark.parametrize(
    "layout,accum",
    [("parallel.tp=2", 2), pytest.param("parallel.dp_replicate=-1", 1, marks=pytest.mark.slow)],
)
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, layout, accum):
    """Rank 1 alone gets SIGTERM in its 3rd forward (tp = 2: a tensor-parallel peer; dp = 2: one
    "node"): both ranks stop after the step of that forward, save it, and the losses and grad
    norms up to it equal the single-process run's."""
    want = read_metrics(_run(str(tmp_path / "ref"), 1, []))
    out = str(tmp_path / "run")
    summaries = run_ranks(sigterm_rank, 2, [*BASE, f"run.out_dir='{out}'", layout], at_forward=3, rank=1)
    stop = math.ceil(3 / accum)  # the step whose forwards include the 3rd
    assert [s["preempted_at_step"] for s in summaries] == [stop, stop]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, stop + 1))
    verify_checkpoint(os.path.join(out, "checkpoints", f"step-{stop}"))
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(column(rows, key), column(want[:stop], key), rtol=1e-5, atol=0)


def sigterm_rank(overrides: list[str], *, at_forward: int, rank: int) -> dict:
    """One rank of a run whose rank ``rank`` sends itself SIGTERM in its forward ``at_forward``.

    The model is passed in (not model.factory), so it keeps the built-in GPT's spec and with it
    its tensor-parallel plan; seeded as the trainer seeds, it starts from the same weights.
    """
    import paratrain
    from paratrain.testing.toy import gpt_sigterm_at

    cfg = paratrain.load_config(None, overrides)
    torch.manual_seed(cfg.run.seed)
    model = gpt_sigterm_at(sigterm_at_forward=at_forward, sigterm_rank=rank, **cfg.model.args)
    return paratrain.train(cfg, model=model)


def _run(out: str, world: int, extra: list[str]) -> str:
    run_ranks(train_rank, world, [*BASE, f"run.out_dir='{out}'", *extra])
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["preempted_at_step"] is None
    return out


def start_node(out: str, port: int, extra: list[str]) -> subprocess.Popen:
    """One "node" of a two-node job: `paratrain train --nproc-per-node 1 --nnodes 2` on loopback."""
    sets = [*[a for a in TOY if not a.startswith("model.")], *SLOW, *SGD, f"run.out_dir='{out}'", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")]), "OMP_NUM_THREADS": "1"}
    env["PARATRAIN_JOB_SECRET"] = "two-node-test-secret"  # one secret shared by the nodes
    cmd = [sys.executable, "-m", "paratrain", "train", "configs/debug.toml", "--nproc-per-node", "1", "--nnodes", "2"]
    cmd += ["--rdzv-endpoint", f"127.0.0.1:{port}", *[x for s in sets for x in ("--set", s)]]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_to_one_node_every_launcher_returns_exit_code_on_preempt(tmp_path):
    """Two one-process nodes; only the second node's launcher gets SIGTERM. Every rank stops after
    the same step with a checkpoint, and BOTH launchers return checkpoint.exit_code_on_preempt
    (a scheduler requeues on it: a 0 from the node that got no signal would say "done"). The
    nodes share run.out_dir and checkpoint.dir (a multi-node job needs one folder every node sees,
    docs/checkpoints.md), but each launcher learns of the preemption from its own workers, not
    from rank 0's summary, which may lie on another node's launcher's side of the job."""
    ckpts, port = str(tmp_path / "checkpoints"), free_port()
    extra = ["checkpoint.interval=0", "checkpoint.at_end=false", "checkpoint.exit_code_on_preempt=3"]
    extra += [f"checkpoint.dir='{ckpts}'"]
    outs = [str(tmp_path / "run")] * 2
    first = start_node(outs[0], port, extra)
    time.sleep(1.0)  # the first node hosts the rendezvous store
    second = start_node(outs[1], port, extra)
    wait_for_rows(outs[0], 2, first)
    second.send_signal(signal.SIGTERM)
    _, err2 = second.communicate(timeout=180)
    _, err1 = first.communicate(timeout=180)
    assert (first.returncode, second.returncode) == (3, 3), (err1[-2000:], err2[-2000:])
    with open(os.path.join(outs[0], "summary.json")) as f:
        stopped = json.load(f)["preempted_at_step"]
    assert stopped is not None and [r["step"] for r in read_metrics(outs[0])] == list(range(1, stopped + 1))
    verify_checkpoint(os.path.join(ckpts, f"step-{stopped}"))
