"""Resilience: checkpoints under pipeline parallel (resharded to other layouts and back, exported),
preemption by SIGTERM, resume safety and save failures. Each run is checked against an
uninterrupted single-process run of the same config."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from paratrain.checkpoint import export_safetensors, list_checkpoints, load_metadata, verify_checkpoint
from tests.dist_utils import REPO, read_metrics, run_ranks, train_rank
from tests.test_checkpoint import GPT_ARGS, TOY, checkpoint_tensors

# Plain SGD: a gradient off by a constant factor changes the losses (AdamW would hide it).
SGD = ["optim.name='sgd'", "optim.beta1=0.0", "optim.lr=0.5", "optim.weight_decay=0.0", "optim.grad_clip=0.0"]


def run(out: str, world: int, extra: list[str] = ()) -> list[dict]:
    """Train on `world` gloo ranks; returns metrics.jsonl's rows."""
    run_ranks(train_rank, world, [*TOY, *SGD, f"run.out_dir='{out}'", *extra])
    return read_metrics(out)


def column(rows: list[dict], key: str) -> torch.Tensor:
    return torch.tensor([r[key] for r in rows], dtype=torch.float64)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The uninterrupted single-process run, and the same run at pp = 2 (checkpoints at 3 and 6)."""
    root = tmp_path_factory.mktemp("ref")
    one, pp2 = str(root / "one"), str(root / "pp2")
    return {"one": (one, run(one, 1, ["run.save_model=true"])), "pp2": (pp2, run(pp2, 2, ["parallel.pp=2"]))}


def assert_same_run(rows: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in want]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(column(rows, key), column(want, key), rtol=1e-4, atol=0)


def test_pipeline_run_saves_under_the_models_own_names(ref):
    one, pp2 = ref["one"], ref["pp2"]
    assert_same_run(pp2[1], one[1])
    mine, theirs = (checkpoint_tensors(os.path.join(d, "checkpoints", "step-6")) for d in (pp2[0], one[0]))
    assert mine.keys() == theirs.keys()  # model.layers.1.* and optim.state.layers.1.*, no stage prefix
    assert any(k.startswith("model.layers.1.") for k in mine)
    # The optimiser's values are keyed by parameter name too (plain SGD keeps no state tensors).
    keys = load_metadata(os.path.join(pp2[0], "checkpoints", "step-6")).state_dict_metadata.keys()
    assert any(k.startswith("optim.param_groups.layers.1.") for k in keys)
    assert not any(".parts." in k for k in keys)
    for k in mine:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize(
    "src,dst,world",
    [("pp2", [], 1), ("pp2", ["parallel.dp_shard=2"], 2), ("one", ["parallel.pp=2"], 2)],
    ids=["pp2-to-one-process", "pp2-to-fsdp2", "one-process-to-pp2"],
)
def test_pipeline_checkpoint_resumes_at_other_layouts(tmp_path, ref, src, dst, world):
    src_dir = os.path.join(ref[src][0], "checkpoints", "step-3")
    out = str(tmp_path / "r")
    rows = run(out, world, [*dst, f"checkpoint.resume='{src_dir}'"])
    assert_same_run(rows, ref["one"][1][3:])


def test_pipeline_checkpoint_exports_the_whole_model(tmp_path, ref):
    info = export_safetensors(os.path.join(ref["pp2"][0], "checkpoints", "step-6"), str(tmp_path / "w.safetensors"))
    mine = load_file(str(tmp_path / "w.safetensors"))
    theirs = load_file(os.path.join(ref["one"][0], "model.safetensors"))
    assert info["step"] == 6 and mine.keys() == theirs.keys()
    for k in mine:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-4, atol=1e-6, msg=k)


def test_pipeline_same_layout_resume_is_bitwise(tmp_path, ref):
    out = str(tmp_path / "r")
    shutil.copytree(os.path.join(ref["pp2"][0], "checkpoints", "step-3"), os.path.join(out, "checkpoints", "step-3"))
    rows = run(out, 2, ["parallel.pp=2", "checkpoint.resume='latest'"])
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref["pp2"][1][3:]]


# ----------------------------------------------------------------------------- preemption

SLOW = [
    "model.factory='tests.toy:gpt_slow'",
    f"model.args={GPT_ARGS[:-1]}, forward_sleep_s = 0.3}}",
]


def start_train(out: str, extra: list[str], *args: str) -> subprocess.Popen:
    """`paratrain train` on 2 processes in the background (the whole TOY config, slowed)."""
    sets = [*[a for a in TOY if not a.startswith("model.")], *SLOW, f"run.out_dir='{out}'", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "paratrain", "train", "configs/debug.toml", "--nproc-per-node", "2", *args]
    cmd += [x for s in sets for x in ("--set", s)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_rows(out: str, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    path = os.path.join(out, "metrics.jsonl")
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(path) and len(read_metrics(out)) >= n:
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {n} metrics rows within {timeout} s: {proc.communicate()[1][-2000:]}")


@pytest.fixture(scope="module")
def ref2(tmp_path_factory):
    """The uninterrupted run on 2 ranks (the same config as the CLI runs below)."""
    out = str(tmp_path_factory.mktemp("ref2") / "w2")
    return run(out, 2, [])


def test_sigterm_to_the_launcher_saves_and_resume_continues_bitwise(tmp_path, ref2):
    out = str(tmp_path / "run")
    proc = start_train(
        out, [*SGD, "checkpoint.interval=0", "checkpoint.at_end=false", "checkpoint.exit_code_on_preempt=3"]
    )
    wait_for_rows(out, 2, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    exit_s = time.monotonic() - t0
    assert proc.returncode == 3, err[-3000:]  # checkpoint.exit_code_on_preempt
    with open(os.path.join(out, "summary.json")) as f:
        stopped = json.load(f)["preempted_at_step"]
    rows = read_metrics(out)
    assert 2 <= stopped < 6 and [r["step"] for r in rows] == list(range(1, stopped + 1)), err[-2000:]
    assert os.listdir(os.path.join(out, "checkpoints")) == [f"step-{stopped}"]
    verify_checkpoint(os.path.join(out, "checkpoints", f"step-{stopped}"))
    assert not os.path.exists(os.path.join(out, "model.safetensors"))  # a preempted run is not done
    print(f"SIGTERM -> exit with a checkpoint: {exit_s:.2f} s")

    proc = start_train(out, [*SGD, "checkpoint.interval=0", "checkpoint.at_end=false"], "--resume")
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in ref2]  # bitwise, same layout
    assert [r["grad_norm"] for r in read_metrics(out)] == [r["grad_norm"] for r in ref2]


def worker_pids(launcher: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == launcher:
                    pids.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def test_sigterm_to_one_worker_stops_every_rank_at_the_same_step(tmp_path):
    """Only one worker is signalled (one node preempted): the ranks agree through the all_reduce,
    all save the same step, and the job exits 0 (the default exit code)."""
    out = str(tmp_path / "run")
    proc = start_train(out, ["checkpoint.interval=0", "checkpoint.at_end=false"])
    wait_for_rows(out, 2, proc)
    workers = worker_pids(proc.pid)
    assert len(workers) == 2
    os.kill(max(workers), signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    with open(os.path.join(out, "summary.json")) as f:
        stopped = json.load(f)["preempted_at_step"]
    assert stopped is not None and len(read_metrics(out)) == stopped
    verify_checkpoint(os.path.join(out, "checkpoints", f"step-{stopped}"))


def test_grace_running_out_exits_at_once_and_keeps_the_previous_checkpoint(tmp_path):
    """The step outlasts checkpoint.preempt_grace_s: exit 143 without a new checkpoint; the one of
    step 3 stays complete and intact, and --resume starts from it."""
    out = str(tmp_path / "run")
    slow_step = [f"model.args={GPT_ARGS[:-1]}, forward_sleep_s = 1.5}}"]
    proc = start_train(out, ["checkpoint.at_end=false", "checkpoint.preempt_grace_s=0.5", *slow_step])
    wait_for_rows(out, 3, proc, timeout=180)
    wait_for_checkpoint = time.monotonic() + 30
    while not os.path.exists(os.path.join(out, "checkpoints", "step-3", "manifest.json")):
        assert time.monotonic() < wait_for_checkpoint
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    assert "checkpoint.preempt_grace_s ran out" in err
    complete = [p for _, p in list_checkpoints(os.path.join(out, "checkpoints")) if is_complete(p)]
    assert [os.path.basename(p) for p in complete] == ["step-3"]
    verify_checkpoint(complete[0])


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "manifest.json"))
