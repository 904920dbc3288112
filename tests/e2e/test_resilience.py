"""Resilience: checkpoints under pipeline parallel (resharded to other layouts and back, exported),
preemption by SIGTERM, resume safety and save failures. Each run is checked against an
uninterrupted single-process run of the same config."""

from __future__ import annotations

import contextlib
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

from paratrain.checkpoint import (
    export_safetensors,
    list_checkpoints,
    load_metadata,
    resolve_checkpoint,
    verify_checkpoint,
)
from paratrain.config import ConfigError
from paratrain.testing.dist_utils import (
    REPO,
    kill_tree,
    paratrain_cli,
    read_metrics,
    run_ranks,
    train_rank,
    wait_listening,
    worker_pids,
)
from paratrain.testing.resilience import (
    GPT_ARGS,
    SGD,
    SLOW,
    TOY,
    checkpoint_tensors,
    column,
    metric_lines,
    run,
    start_job,
    start_node,
    wait_for,
    wait_for_rows,
)


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


def start_train(out: str, extra: list[str], *args: str) -> subprocess.Popen:
    """`paratrain train` on 2 processes in the background (the whole TOY config, slowed)."""
    sets = [*[a for a in TOY if not a.startswith("model.")], *SLOW, f"run.out_dir='{out}'", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "paratrain", "train", "configs/debug.toml", "--nproc-per-node", "2", *args]
    cmd += [x for s in sets for x in ("--set", s)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def ref2(tmp_path_factory):
    """The uninterrupted run on 2 ranks (the same config as the CLI runs below)."""
    out = str(tmp_path_factory.mktemp("ref2") / "w2")
    return run(out, 2, [])


@pytest.mark.slow  # > 12 s: make test stays under 10 minutes
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


@pytest.mark.slow  # > 10 s: make test keeps a margin under 10 minutes
def test_sigterm_to_one_worker_stops_every_rank_at_the_same_step(tmp_path):
    """Only one worker is signalled (one node preempted): the job exits 0 (the default exit code)
    and the checkpoint of the step rank 0 stopped after is complete, which needs every rank's
    shard of that step's save. (tests/e2e/test_preemption.py compares both ranks' losses with the
    single-process run.)"""
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


@pytest.mark.slow
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


# ----------------------------------------------------------------------------- resume safety


def damage(path: str) -> None:
    """Flip one byte of a checkpoint's first shard file: its checksum no longer matches."""
    shard = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    with open(os.path.join(path, shard), "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))


def test_resume_when_no_checkpoint_verifies_names_each_and_stops(tmp_path, ref):
    root = str(tmp_path / "checkpoints")
    shutil.copytree(os.path.join(ref["one"][0], "checkpoints"), root)
    damage(os.path.join(root, "step-6"))
    os.remove(os.path.join(root, "step-3", "manifest.json"))
    with pytest.raises(ConfigError) as e:
        resolve_checkpoint("latest", root)
    msg = str(e.value)
    assert "no checkpoint in" in msg and "step-6: is damaged" in msg and "step-3: is incomplete" in msg
    assert "\n" not in msg
    shutil.rmtree(os.path.join(root, "step-6"))  # only an incomplete folder left: a fresh start is right
    assert resolve_checkpoint("latest", root) is None


def test_resume_with_other_model_shapes_is_one_line_before_loading(tmp_path, ref):
    src = os.path.join(ref["one"][0], "checkpoints", "step-3")
    wider = f"model.args={GPT_ARGS.replace('d_model = 32', 'd_model = 64')}"
    with pytest.raises(AssertionError) as e:
        run(str(tmp_path / "r"), 1, [wider, f"checkpoint.resume='{src}'"])
    assert "has shape [32, 32] there but [32, 64] in this config's model" in str(e.value)
    assert "Size mismatch between" not in str(e.value)  # DCP's own error never came


def test_prune_never_deletes_another_runs_checkpoint(tmp_path, ref):
    """A complete checkpoint of another run in checkpoint.dir survives keep = 1; this run's own older ones go."""
    out = str(tmp_path / "run")
    foreign = os.path.join(out, "checkpoints", "step-1")
    shutil.copytree(os.path.join(ref["one"][0], "checkpoints", "step-3"), foreign)
    run(out, 1, ["checkpoint.keep=1"])
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step-1", "step-6"]
    verify_checkpoint(foreign)


# ----------------------------------------------------------------------------- save failures


def train_with_full_disk(overrides: list[str], *, fail_step: int, fail_rank: int) -> dict:
    """train_rank, with the shard writes of step ``fail_step`` on rank ``fail_rank`` failing with ENOSPC."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def full(self, plan, planner):
        if str(self.path).endswith(f"step-{fail_step}") and int(os.environ["RANK"]) == fail_rank:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = full
    return train_rank(overrides)


def test_full_disk_stops_with_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    """ENOSPC on rank 1 only: both ranks stop with the same line; step 3 stays complete."""
    out = str(tmp_path / "run")
    with pytest.raises(AssertionError) as e:
        run_ranks(train_with_full_disk, 2, [*TOY, f"run.out_dir='{out}'"], fail_step=6, fail_rank=1)
    msg = str(e.value)
    assert "CheckpointSaveError: the checkpoint of step 6 could not be written to" in msg
    assert "No space left on device" in msg and "previous complete checkpoints: step-3" in msg
    assert os.listdir(os.path.join(out, "checkpoints")) == ["step-3"]  # the partial step-6 is removed
    verify_checkpoint(os.path.join(out, "checkpoints", "step-3"))


def test_full_disk_with_on_error_warn_trains_on(tmp_path, caplog):
    out = str(tmp_path / "run")
    [summary] = run_ranks(
        train_with_full_disk, 1, [*TOY, f"run.out_dir='{out}'", "checkpoint.on_error='warn'"], fail_step=3, fail_rank=0
    )
    assert summary["steps"] == 6
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step-6"]
    verify_checkpoint(os.path.join(out, "checkpoints", "step-6"))


# ----------------------------------------------------------------------------- PowerSGD


@pytest.mark.slow
def test_powersgd_state_survives_resume(tmp_path):
    """Error feedback, warm-start Q and the iteration count are checkpointed: resumed at step 3
    (PowerSGD running since step 2), the run equals the uninterrupted one bitwise."""
    psgd = ["comm.compression='powersgd'", "comm.powersgd_start_step=2", "comm.powersgd_rank=1"]
    full = run(str(tmp_path / "full"), 2, psgd)
    src = os.path.join(str(tmp_path / "full"), "checkpoints", "step-3")
    keys = load_metadata(src).state_dict_metadata.keys()
    assert any(k.startswith("powersgd_rank1.error.") for k in keys) and "powersgd_rank0.iter" in keys
    resumed = run(str(tmp_path / "r"), 2, [*psgd, f"checkpoint.resume='{src}'"])
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full[3:]]


# ----------------------------------------------------------------------------- elastic node count


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_elastic_node_loss_continues_alone_with_the_same_losses(tmp_path):
    """Two one-process nodes; the second node's whole process tree is SIGKILLed after step 3. The
    first restarts its worker, resumes the newest complete checkpoint at world 1 (global batch
    kept: accumulation 1 -> 2) and its losses equal the uninterrupted single-process run's."""
    from paratrain.distributed.process_group import free_port

    want = run(str(tmp_path / "ref"), 1, ["run.steps=8"])
    out, port = str(tmp_path / "run"), free_port()
    first = start_node(out, port, [])
    wait_listening(port, first)  # the first node hosts the rendezvous store (it must survive)
    second = start_node(out, port, [])
    wait_for_rows(out, 3, first, timeout=240)
    t_kill = time.time()
    kill_tree(second.pid)
    second.communicate()
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-4000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[0]["world_size"] == 2 and rows[-1]["world_size"] == 1 and rows[-1]["accum_steps"] == 2
    torch.testing.assert_close(column(rows, "loss"), column(want, "loss"), rtol=1e-5, atol=0)
    torch.testing.assert_close(column(rows, "grad_norm"), column(want, "grad_norm"), rtol=1e-5, atol=0)
    with open(os.path.join(out, "summary.json")) as f:
        changes = json.load(f)["world_size_changes"]
    assert changes[0] == {"step": 0, "world_size": 2} and changes[-1]["world_size"] == 1
    print(f"node death -> job done alone: {time.time() - t_kill:.1f} s")


# ----------------------------------------------------------------------------- hang


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hung_worker_is_found_and_the_restarted_job_finishes(tmp_path, ref2):
    """Rank 1 sleeps "forever" in step 4 (first attempt only): rank 0's collective times out after
    dist.timeout_s = 5, the hang report names rank 1, torchrun restarts both workers and the run
    resumes from step 2 to the end, equal to the uninterrupted run bitwise."""
    out = str(tmp_path / "run")
    hang = [
        "model.factory='paratrain.testing.toy:gpt_stalled_at'",
        f"model.args={GPT_ARGS[:-1]}, stall_at_step = 4, stall_rank = 1, stall_s = 3600, first_attempt_only = true}}",
    ]
    sets = [*[a for a in TOY if not a.startswith("model.")], *SGD, *hang, f"run.out_dir='{out}'"]
    sets += ["dist.timeout_s=5", "checkpoint.interval=2"]
    t0 = time.monotonic()
    res = paratrain_cli(
        "train", "configs/debug.toml", "--nproc-per-node", "2", "--max-restarts", "1",
        *[x for s in sets for x in ("--set", s)], timeout=400,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    assert "ranks that did not arrive: [1]" in res.stderr and "resumed from" in res.stderr
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in ref2]
    print(f"hang -> restarted job done: {time.monotonic() - t0:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_elastic_node_joining_grows_the_job_with_the_same_losses(tmp_path):
    """A one-node job (--nnodes 1:2) runs alone; a second node joins after step 1: the workers
    restart at world 2 from the newest complete checkpoint (accumulation 2 -> 1) and the
    losses still equal the uninterrupted single-process run's."""
    from paratrain.distributed.process_group import free_port

    want = run(str(tmp_path / "ref"), 1, ["run.steps=8"])
    out, port = str(tmp_path / "run"), free_port()
    # Slow steps, so the second node starts in time; a checkpoint each step, so the grown job
    # resumes after the steps done alone.
    slower = [f"model.args={GPT_ARGS[:-1]}, forward_sleep_s = 2.0}}", "checkpoint.interval=1"]
    first = start_node(out, port, slower)
    wait_for_rows(out, 1, first, timeout=240)
    second = start_node(out, port, slower)
    _, err = first.communicate(timeout=300)
    second.communicate(timeout=60)
    assert first.returncode == 0, err[-4000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[0]["world_size"] == 1 and rows[-1]["world_size"] == 2 and rows[-1]["accum_steps"] == 1
    torch.testing.assert_close(column(rows, "loss"), column(want, "loss"), rtol=1e-5, atol=0)
    torch.testing.assert_close(column(rows, "grad_norm"), column(want, "grad_norm"), rtol=1e-5, atol=0)
    with open(os.path.join(out, "summary.json")) as f:
        changes = json.load(f)["world_size_changes"]
    assert changes[0] == {"step": 0, "world_size": 1} and changes[-1]["world_size"] == 2


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "args,message",
    [
        (["--set", "run.out_dir='{file}'"], "run.out_dir = '{file}' is a file, not a folder"),
        (["--set", "run.out_dir='{file}/run'"], "lies under the file '{file}'"),
        (["--set", "checkpoint.dir='{file}/ckpt'"], "checkpoint.dir = '{file}/ckpt' lies under the file"),
        (  # it stopped the precompute in a FileExistsError traceback
            ["--set", "preference.precompute=true", "--set", "preference.store='{file}'"],
            "preference.store = '{file}' is a file, not a folder",
        ),
        (["--nnodes", "2", "--rdzv-endpoint", "nohost:99999"], "expected HOST:PORT with a port within 0..65535"),
        (["--nnodes", "2:1"], "--nnodes 2:1: expected N or MIN:MAX"),
        (["--nnodes", "1:2"], "--nnodes > 1 needs --rdzv-endpoint"),
        (["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1"], "needs --max-restarts >= 1"),
        (["--rdzv-conf", "last_call=3"], "'last_call=3' is not KEY=VALUE"),
        (
            ["--nnodes", "1:2", "--max-restarts", "1", "--rdzv-endpoint", "127.0.0.1:1", "--set", "parallel.tp=2"],
            "--nnodes 1:2 at 1 node(s): world size 1 is not divisible",
        ),
        (["--set", "checkpoint.on_error='ignore'"], "checkpoint.on_error"),
        (["--set", "checkpoint.exit_code_on_preempt=300"], "must be within 0 .. 255"),
        (["--set", "parallel.dp_shard=-2"], "parallel.dp_shard = -2 must be >= 1, or -1"),
    ],
)
def test_bad_launch_input_exits_2_with_one_line(tmp_path, capsys, args, message):
    from paratrain.cli import main

    file = str(tmp_path / "a-file")
    open(file, "w").close()
    assert main(["train", "configs/debug.toml", *[a.replace("{file}", file) for a in args]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("paratrain: error: "), err
    assert message.replace("{file}", file) in err


# ----------------------------------------------------------------------------- orphaned workers


def _alive(pid: int) -> bool:
    """Running (a zombie that no one reaped yet has stopped: it holds no device, no memory)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def test_a_worker_stops_when_its_launcher_is_killed(tmp_path):
    """launch/worker.py ``stop_with_launcher``: a process whose parent is SIGKILLed ends within
    seconds (the parent-death signal; the pid watch behind it)."""
    pid_file = tmp_path / "child.pid"
    child = (
        "import os, time; from paratrain.launch.worker import stop_with_launcher; stop_with_launcher(0.1);"
        f" open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}]).wait()"],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        assert _alive(worker)
        os.kill(parent.pid, signal.SIGKILL)
        assert _gone_within([worker], 5) == [], "the worker outlived its launcher"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_no_process_of_the_job_outlives_a_killed_launcher(tmp_path):
    """`kill -9` of a `paratrain train --nproc-per-node 2` launcher's process group: torch elastic's
    workers live in sessions of their own, yet none is left 10 s later."""
    from paratrain.testing.dist_utils import descendants

    out = tmp_path / "run"
    job = start_job(out, 100_000, "--nproc-per-node", "2")
    tree = [job.pid]
    try:
        wait_for(lambda: metric_lines(out) >= 2, 120, "the job's first steps")
        tree = descendants(job.pid)
        assert len(tree) >= 3, tree  # the launcher and its two workers
        os.killpg(job.pid, signal.SIGKILL)
        left = _gone_within(tree, 10)
        assert left == [], f"processes of the job still running 10 s after the launcher died: {left}"
    finally:
        for p in tree if not _alive(job.pid) else descendants(job.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        job.wait()
