"""The end of a run cannot stall: paratrain.train's own teardown, 50 times in a row at world 2.

The stall it guards against (pytorch#56297): a gloo group whose last reference goes away with the
GIL held (DDP's Reducer, freed when train's frame was) joins its worker threads while one of
them, freeing the last collective's work, waits for the GIL. Each iteration runs the real
``trainer.train`` (process group, heartbeat, teardown) around a DDP step and an all-reduce, the
run's last collective, right before the end; only the model, data and loop are replaced.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from paratrain.distributed.process_group import free_port
from paratrain.testing.dist_utils import run_ranks


class _Closable:
    def close(self):
        pass

    def finish(self, summary):
        pass

    def on_error(self, error, step):
        pass


def _tiny_run(cfg, ctx, *, model, dataset, loss, events):
    import torch
    from torch import nn

    ddp = nn.parallel.DistributedDataParallel(nn.Linear(8, 8))
    part = _Closable()
    return SimpleNamespace(
        ctx=ctx, model=ddp, state=SimpleNamespace(step=0), writer=part, loader=part, ckpt=part, preemption=part,
        profiler=part, rank_stats=part, batch=torch.randn(4, 8),
    )  # fmt: skip


def _tiny_loop(cfg, run):
    import torch
    import torch.distributed as dist

    run.model(run.batch).sum().backward()  # DDP's bucket all-reduce
    loss = torch.ones(1)
    dist.all_reduce(loss)  # a metric summed over ranks: the last collective, as in a real run
    return [{"loss": loss.item()}]


def _gloo_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return [n for n in names if "gloo" in n]


def _train_times(n: int, out_dir: str, fence_port: int) -> dict:
    import datetime

    import torch.distributed as dist

    from paratrain import trainer
    from paratrain.config import load_config

    trainer.build_run, trainer.loop = _tiny_run, _tiny_loop  # a disposable process (run_ranks)
    trainer.finish = lambda cfg, run, history: {"loss": history[-1]["loss"]}
    # The stub run has no loader or plan: no start-of-run probe nor draw detection.
    cfg = load_config(
        None, [f"run.out_dir='{out_dir}'", "dist.timeout_s=60", "run.probe=false", "run.keyed_random=false"]
    )
    rank = int(os.environ["RANK"])
    # Runs one after another, like separate jobs: none starts before every rank has ended the
    # previous one (else a rank could join the previous run's store, on the same MASTER_PORT).
    fence = dist.TCPStore("127.0.0.1", fence_port, 2, rank == 0, datetime.timedelta(seconds=60))
    t0 = time.perf_counter()
    losses = []
    for i in range(n):
        losses.append(trainer.train(cfg)["loss"])
        fence.set(f"ended/{i}/{rank}", "")
        fence.wait([f"ended/{i}/0", f"ended/{i}/1"])
    fence.set(f"left/{rank}", "")
    if rank == 0:  # the fence's host leaves last
        fence.wait(["left/1"])
    # Every group destroyed, its threads joined, in this process: nothing left to a later destructor.
    return {
        "losses": losses,
        "initialized": dist.is_initialized(),
        "threads": _gloo_threads(),
        "s": time.perf_counter() - t0,
    }


# 8 run ends in the fast tier, 100 in the slow one (a rare stall has more chances there).
@pytest.mark.parametrize("n", [8, pytest.param(100, marks=pytest.mark.slow)])
def test_run_end_never_stalls(tmp_path, n):
    t0 = time.perf_counter()
    results = run_ranks(_train_times, 2, n, str(tmp_path), free_port(), timeout=120)
    for r in results:
        assert r["losses"] == [2.0] * n
        assert not r["initialized"] and r["threads"] == []
    print(f"{n} run ends at world 2: {results[0]['s']:.1f} s in the ranks, {time.perf_counter() - t0:.1f} s in all")


def _rank_1_sleeps():
    if os.environ["RANK"] == "1":
        time.sleep(600)
    return "done"


@pytest.mark.slow  # half a minute of waiting for the timeout
def test_run_ranks_timeout_explains_itself():
    """A rank that never returns: the error shows its stack and every rank's exit code."""
    with pytest.raises(AssertionError) as e:
        run_ranks(_rank_1_sleeps, 2, timeout=20)  # the ranks start (import torch) well within it
    text = str(e.value)
    assert "waiting for ranks [1]" in text
    assert "Python stacks of rank 1" in text and "_rank_1_sleeps" in text
    assert "rank 0: 0, rank 1: -9" in text  # rank 0 exited on its own, rank 1 was killed
