"""Trackers (W&B offline, MLflow file store, TensorBoard) read back through their own APIs; memory
and per-rank times with a straggler; profiler traces; `paratrain report` (issue 13)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import struct
import subprocess

import pytest

from paratrain.testing.dist_utils import paratrain_cli, read_metrics, run_ranks, train_rank

GPT_ARGS = "n_layer = 2, n_head = 2, d_model = 32, block_size = 16, vocab_size = 32"
TOY = [
    f"model.args={{{GPT_ARGS}}}",
    "data.factory='paratrain.testing.toy:toy_lm'",
    "data.args={n = 64, seq_len = 16, vocab = 32}",
    "batch.global_batch_size=8",
    "run.steps=4",
    "run.progress=false",
    "run.save_model=false",
    "metrics.plot=false",
]


def wandb_records(path: str):
    """The records of a W&B offline run file (``run-ID.wandb``): W&B's own protobuf ``Record``s in
    the LevelDB log framing wandb writes them with (7-byte header ':W&B' + magic + version, then
    32 KiB blocks of chunks with a 7-byte header: crc32c, length, type FULL/FIRST/MIDDLE/LAST).
    wandb 0.31 ships no Python reader of its own (its Go core reads them for `wandb sync`)."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:7]
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """World 2 with a rank that sleeps in each forward, every tracker on, rank stats every 2 steps,
    steps 2-3 profiled (one run for several tests: CPU is scarce)."""
    tmp = tmp_path_factory.mktemp("tracked")
    out = str(tmp / "run")
    os.environ["WANDB_DIR"] = str(tmp / "wandb")  # spawned ranks inherit it
    os.environ["WANDB_SILENT"] = "true"
    overrides = [
        *TOY,
        "model.factory='paratrain.testing.toy:gpt_slow_rank'",
        f"model.args={{{GPT_ARGS}, slow_rank = 1, sleep_s = 0.1}}",
        f"run.out_dir='{out}'",
        "metrics.wandb=true",
        "metrics.wandb_mode='offline'",
        "metrics.wandb_tags=['t1']",
        f"metrics.mlflow='file:{tmp / 'mlruns'}'",
        "metrics.tensorboard=true",
        "metrics.rank_stats_every=2",
        "profile.steps='2-3'",
    ]
    try:
        summaries = run_ranks(train_rank, 2, overrides)
    finally:
        os.environ.pop("WANDB_DIR")
    return {"tmp": tmp, "out": out, "rows": read_metrics(out), "summary": summaries[0]}


def test_trackers_log_every_row_read_back(tracked_run, monkeypatch):
    rows, tmp = tracked_run["rows"], tracked_run["tmp"]
    losses = {r["step"]: r["loss"] for r in rows}
    assert sorted(losses) == [1, 2, 3, 4]

    # W&B offline run file: the config once, one history record per step with the row's values.
    (run_file,) = glob.glob(str(tmp / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, config, tags = {}, {}, []
    for rec in wandb_records(run_file):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history[items["_step"]] = items
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in rec.config.update})
        elif kind == "run":  # the run record carries the config given to wandb.init
            tags = list(rec.run.tags)
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
    assert sorted(history) == [1, 2, 3, 4]
    for step, loss in losses.items():
        assert history[step]["loss"] == pytest.approx(loss, rel=1e-12)
        assert "memory_gib" in history[step]
    assert history[2]["slowest_rank"] == 1 and history[2]["rank_local_time_s/1"] > 0
    assert config["batch"]["global_batch_size"] == 8 and config["metrics"]["rank_stats_every"] == 2
    assert tags == ["t1"]

    # MLflow file store, through MlflowClient.
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when asked

    client = MlflowClient(tracking_uri=f"file:{tmp / 'mlruns'}")
    (run,) = client.search_runs([client.get_experiment_by_name("paratrain").experiment_id])
    assert run.info.status == "FINISHED"
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")} == pytest.approx(losses)
    assert run.data.params["batch.global_batch_size"] == "8"
    assert run.data.metrics["final/final_loss"] == pytest.approx(losses[4])

    # TensorBoard, through its event reader.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(tracked_run["out"], "tensorboard"))
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars("train/loss")} == pytest.approx(losses, rel=1e-6)


def test_trackers_continue_the_run_they_are_given(tmp_path, monkeypatch):
    """The trackers alone (no training): MLflow reopens the run id, TensorBoard purges the steps
    after the resume step, so steps 1-4, a resume at 3 and step 4 again make one curve."""
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from paratrain.config import MetricsConfig
    from paratrain.observability.trackers import build_trackers

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    cfg = MetricsConfig(mlflow=f"file:{tmp_path / 'mlruns'}", tensorboard=True)
    config = {"run": {"steps": 4}}
    first = build_trackers(cfg, out_dir=str(tmp_path), config=config)
    for step in (1, 2, 3, 4):
        for t in first:
            t.log({"step": step, "loss": 1.0 / step})
    for t in first:
        t.finish(None)  # a crash: no summary
    ids = {t.name: t.run_id for t in first if t.run_id}
    assert set(ids) == {"mlflow"}
    second = build_trackers(cfg, out_dir=str(tmp_path), config={"run": {"steps": 5}}, resume=ids, start_step=3)
    for t in second:
        t.log({"step": 4, "loss": 0.25})
        t.finish({"final_loss": 0.25})

    client = MlflowClient(tracking_uri=cfg.mlflow)
    (run,) = client.search_runs([client.get_experiment_by_name("paratrain").experiment_id])
    assert run.info.run_id == ids["mlflow"] and run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [1, 2, 3, 4, 4]
    assert run.data.params["run.steps"] == "4" and run.data.tags["resumed/3/run.steps"] == "5"
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (1, 1.0),
        (2, 0.5),
        (3, pytest.approx(1 / 3)),
        (4, 0.25),
    ]


@pytest.mark.slow
def test_a_resumed_run_continues_its_tracker_runs(tmp_path, monkeypatch):
    """Four steps with a checkpoint at 3, then a resume at world 2 that redoes step 4: one W&B run
    id, one MLflow run, TensorBoard's step 4 once (the first run's was purged); the values are
    those of metrics.jsonl (the redone step is exact)."""
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))  # spawned ranks inherit it
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = str(tmp_path / "run")
    common = [
        *TOY,
        f"run.out_dir='{out}'",
        "metrics.wandb=true",
        "metrics.wandb_mode='offline'",
        f"metrics.mlflow='file:{tmp_path / 'mlruns'}'",
        "metrics.tensorboard=true",
        "checkpoint.interval=3",
        "checkpoint.at_end=false",
    ]
    run_ranks(train_rank, 1, common)
    run_ranks(train_rank, 2, [*common, "checkpoint.resume='latest'"])
    losses = {r["step"]: r["loss"] for r in read_metrics(out)}
    assert sorted(losses) == [1, 2, 3, 4]

    runs = sorted(glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(runs) == 2 and len({os.path.basename(r) for r in runs}) == 1, runs  # run-ID.wandb twice
    steps = []
    for run_file in runs:
        for rec in wandb_records(run_file):
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                steps.append(items["_step"])
                assert items["loss"] == pytest.approx(losses[items["_step"]], rel=1e-6)
    assert steps == [1, 2, 3, 4, 4]

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    (run,) = client.search_runs([client.get_experiment_by_name("paratrain").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["checkpoint.resume"] == ""  # a param cannot change
    assert run.data.tags["resumed/3/checkpoint.resume"] == "latest" and run.data.tags["resumed_from_step"] == "3"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 4]
    assert all(m.value == pytest.approx(losses[m.step], rel=1e-6) for m in history)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(out, "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]


def test_memory_and_straggler_in_rows(tracked_run):
    rows = tracked_run["rows"]
    assert all(r["memory_gib"] > 0.05 for r in rows)  # a Python process with torch: > 50 MiB RSS
    plain, gathered = [r for r in rows if r["step"] % 2], [r for r in rows if r["step"] % 2 == 0]
    assert all("rank_step_time_s" not in r and r["memory_rank"] == 0 for r in plain)  # no collective
    for r in gathered:
        assert len(r["rank_step_time_s"]) == len(r["rank_data_time_s"]) == len(r["rank_memory_gib"]) == 2
        assert r["memory_gib"] == max(r["rank_memory_gib"]) and r["memory_rank"] in (0, 1)
        # rank 1 sleeps 0.1 s per forward; the toy model's forward takes milliseconds.
        assert r["slowest_rank"] == 1 and r["straggler"] == 1 and r["straggle_ratio"] > 1.2
    assert tracked_run["summary"]["max_memory_gib"] == max(r["memory_gib"] for r in rows)


def test_profile_traces_per_rank(tracked_run):
    for rank in (0, 1):
        path = os.path.join(tracked_run["out"], "profile", f"rank{rank}.steps2-3.json")
        with open(path) as f:
            trace = json.load(f)
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any(n.startswith("aten::") for n in names)  # operators were recorded
        assert any(e.get("args", {}).get("Input Dims") for e in trace["traceEvents"])  # record_shapes
        assert "[memory]" in names  # profile_memory


def test_no_straggler_without_a_slow_rank(tmp_path):
    """The fault-free twin of the straggler test: equal ranks name no straggler."""
    out = str(tmp_path / "run")
    run_ranks(
        train_rank, 2, [*TOY, f"run.out_dir='{out}'", "metrics.rank_stats_every=1", "metrics.straggler_ratio=1.8"]
    )
    rows = read_metrics(out)
    assert all(len(r["rank_local_time_s"]) == 2 for r in rows)
    # (per-row timing of millisecond forwards on a loaded machine can spike: judge the run, not a row)
    assert sorted(r["straggle_ratio"] for r in rows)[len(rows) // 2] < 1.8
    assert sum("straggler" in r for r in rows) < len(rows) / 2


@pytest.mark.slow
def test_tracker_that_cannot_start_is_one_line_before_launch(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = tmp_path / "run"
    for bad, key in (
        (f"metrics.mlflow='file:{blocker}/mlruns'", "metrics.mlflow"),
        ("metrics.wandb=true", "metrics.wandb"),
    ):
        env = {"WANDB_DIR": str(blocker / "sub")}
        args = [a for o in [*TOY, f"run.out_dir='{out}'", bad] for a in ("--set", o)]
        cfg = tmp_path / "c.toml"
        cfg.write_text("")
        p = paratrain_cli("train", str(cfg), *args, env=env, timeout=120)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and key in lines[0] and "Traceback" not in p.stderr, p.stderr
        assert not os.path.exists(out / "metrics.jsonl")  # refused before any process started


def test_tracker_not_installed_is_config_error(monkeypatch, tmp_path):
    import sys

    from paratrain.config import ConfigError, MetricsConfig
    from paratrain.observability.trackers import check_trackers

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"metrics.wandb = true needs the wandb package .*paratrain\[wandb\]"):
        check_trackers(MetricsConfig(wandb=True), out_dir=str(tmp_path))
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ConfigError, match="metrics.mlflow needs the mlflow package"):
        check_trackers(MetricsConfig(mlflow="file:/tmp/x"), out_dir=str(tmp_path))


def test_bad_profile_steps_is_config_error():
    import paratrain

    with pytest.raises(paratrain.ConfigError, match="profile.steps"):
        paratrain.load_config(None, ["profile.steps='3-1'"])


@pytest.mark.slow
def test_report_compares_runs(tracked_run, tmp_path):
    other = str(tmp_path / "other")
    run_ranks(train_rank, 1, [*TOY, f"run.out_dir='{other}'", "optim.lr=1e-3"])
    page, png = tmp_path / "report.html", tmp_path / "plots.png"
    p = paratrain_cli("report", tracked_run["out"], other, "--out", str(page), "--png", str(png), timeout=120)
    assert p.returncode == 0, p.stderr
    text = page.read_text()
    assert "data:image/png;base64," in text and 'src="http' not in text  # self-contained
    assert "optim.lr" in text and "0.001" in text  # the differing key, with both values
    assert "model.factory" in text and "metrics.wandb" in text
    assert "dp_replicate=2" in text and "dp_replicate=1" in text  # layouts in the table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    not_a_run = tmp_path / "empty"
    not_a_run.mkdir()
    p = paratrain_cli("report", str(not_a_run), "--out", str(tmp_path / "x.html"), timeout=60)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "not a paratrain run" in p.stderr
    assert not (tmp_path / "x.html").exists()

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium): the page was not rendered in a browser")
    shot = tmp_path / "shot.png"
    r = subprocess.run(
        [
            chromium,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--enable-logging=stderr",
            "--v=0",
            "--window-size=1200,2400",
            f"--screenshot={shot}",
            f"file://{page}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists(), r.stderr
    console = [line for line in r.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    dom = subprocess.run(
        [chromium, "--headless", "--disable-gpu", "--no-sandbox", "--dump-dom", f"file://{page}"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "<table>" in dom and 'data-loaded="1"' in dom  # the embedded image decoded
