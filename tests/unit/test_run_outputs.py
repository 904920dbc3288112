"""Run outputs on a full or unwritable disk: one line naming the file and what to free, nothing partial."""

from __future__ import annotations

import builtins
import errno
import json
import os
import threading

import pytest

from paratrain.observability import metrics
from paratrain.observability.metrics import MetricsWriteError, MetricsWriter, truncate_metrics


def _rows(path, steps) -> None:
    with open(path, "w") as f:
        for s in steps:
            f.write(json.dumps({"step": s, "loss": 1.0}) + "\n")


def _full_disk(monkeypatch) -> None:
    """Every open that would create or grow a file fails as on a full disk (ENOSPC)."""
    real = builtins.open

    def full(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(metrics, "open", full, raising=False)


def test_resume_truncates_metrics_on_a_full_disk_in_place(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    _rows(path, range(1, 8))
    with open(path, "a") as f:
        f.write('{"step": 8, "lo')  # torn by the failure
    _full_disk(monkeypatch)
    truncate_metrics(str(tmp_path), 4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # no metrics.jsonl.tmp


def test_truncate_keeps_a_last_row_without_its_newline_and_drops_an_old_tmp(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}')
    (tmp_path / "metrics.jsonl.tmp").write_text("left by an older version")
    truncate_metrics(str(tmp_path), 5)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


def test_an_unwritable_metrics_file_is_one_line_naming_it(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    _rows(path, [1, 2, 3])

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(metrics, "open", refuse, raising=False)
    with pytest.raises(MetricsWriteError) as e:
        truncate_metrics(str(tmp_path), 2)
    line = str(e.value)
    assert "\n" not in line and str(path) in line and "free space" in line and "--resume" in line, line


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_step_row_onto_a_full_disk_is_one_line(tmp_path):
    os.symlink("/dev/full", tmp_path / "metrics.jsonl")  # every write: ENOSPC
    writer = MetricsWriter(str(tmp_path), enabled=True, total_steps=5, progress=False, start_step=2)
    with pytest.raises(MetricsWriteError) as e:
        writer.log_step({"step": 3, "loss": 1.0})
    writer.close()  # the failed flush is not raised again
    assert "writing step 3" in str(e.value) and "metrics.jsonl" in str(e.value) and "df -h" in str(e.value)


def test_the_worker_prints_one_line_and_exits_1_for_a_full_disk(tmp_path, monkeypatch, capsys):
    from paratrain.launch import worker

    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[run]\nout_dir = "{tmp_path}"\n')

    def train(cfg):
        raise MetricsWriteError(f"writing step 3 to {tmp_path}/metrics.jsonl failed (No space left on device)")

    monkeypatch.setattr(worker, "train", train)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert worker.main([str(cfg)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left" in err and "Traceback" not in err, err


def _row(step: int) -> dict:
    """A metrics row as the trainer makes it (20 keys), val_loss every 5 steps."""
    row = {
        "step": step,
        "loss": 3.0 / step,
        "lr": 1e-3,
        "grad_norm": 0.5 + step * 1e-3,
        "global_batch_size": 8,
        "micro_batch_size": 2,
        "accum_steps": 2,
        "items": 256,
        "tokens": 256 + step,
        "consumed_samples": 8 * step,
        "epoch": 0,
        "step_time_s": 0.01 + step * 1e-6,
        "tokens_per_s": 25600.0 / (1 + step * 1e-4),
        "samples_per_s": 800.0,
        "model_flops_per_s": 1.5e9,
        "memory_gib": 0.25 + step * 1e-5,
        "memory_rank": 0,
        "world_size": 2,
        "time": 1.7e9 + step,
        "trainable_tokens": 200,
    }
    if step % 5 == 0:
        row["val_loss"] = 2.5 / step
    return row


def test_the_kept_history_summarizes_as_the_rows_do_in_a_twentieth_of_the_memory():
    import tracemalloc

    from paratrain.observability.metrics import RowHistory, summarize

    rows, history = [], RowHistory()
    for step in range(1, 41):
        rows.append(_row(step))
        history.append(rows[-1])
    assert summarize(history) == summarize(rows)
    assert history[4] == {k: rows[4][k] for k in RowHistory.FIELDS}  # val_loss at step 5
    assert "val_loss" not in history[3] and history[-1]["step"] == 40 and len(history[1:3]) == 2

    def kept(make) -> float:
        """Bytes kept per step by 2000 steps of ``make``'s container."""
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        box = make()
        for step in range(1, 2001):
            box.append(_row(step))
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        return sum(s.size_diff for s in after.compare_to(before, "filename")) / 2000

    as_list, as_history = kept(list), kept(RowHistory)
    assert as_list > 500 and as_history < 100, (as_list, as_history)  # about 0.7-0.9 KiB and 60 B a step


def test_nodes_checking_one_new_out_dir_at_once_both_pass_and_leave_nothing(tmp_path):
    """Every node of a job runs check_out_dir on the same run.out_dir as it starts. A check that
    makes the missing folder and removes it again removes it under the other node's probe, and
    that node exits 2 (286 of 300 such pairs of checks failed so, as in the chaos benchmark's
    two-node job)."""
    from paratrain.cli import check_out_dir
    from paratrain.config import ConfigError, load_config

    cfg = load_config("configs/debug.toml", [])
    for i in range(50):
        cfg.run.out_dir = str(tmp_path / f"job{i}" / "run")
        errors, start = [], threading.Barrier(2)

        def node():
            start.wait()
            try:
                check_out_dir(cfg, one_node=False)
            except ConfigError as e:
                errors.append(str(e))

        nodes = [threading.Thread(target=node) for _ in range(2)]
        for t in nodes:
            t.start()
        for t in nodes:
            t.join()
        assert not errors, errors[0]
    assert os.listdir(tmp_path) == [], "a check leaves nothing behind"


def test_a_run_that_failed_before_its_first_step_does_not_block_the_same_command(tmp_path):
    """What a run leaves when it fails before step 1 (an empty metrics.jsonl, config.toml,
    events.jsonl) is not a run: the same command is not refused (issue 55). A row is one."""
    from paratrain.cli import check_out_dir
    from paratrain.config import ConfigError, load_config

    cfg = load_config("configs/debug.toml", [f"run.out_dir='{tmp_path}'"])
    for name in ("metrics.jsonl", "config.toml", "events.jsonl"):
        (tmp_path / name).write_text("")
    check_out_dir(cfg, one_node=True)
    _rows(tmp_path / "metrics.jsonl", [1])
    with pytest.raises(ConfigError, match=r"holds another run \(metrics.jsonl\)"):
        check_out_dir(cfg, one_node=True)


def test_resume_that_finds_no_checkpoint_where_metrics_record_steps_is_refused(tmp_path):
    """--resume with no checkpoint where the run's metrics.jsonl records steps: one line naming
    both and the fix, not a silent start at step 0 (issue 55, item 2b); a fresh folder starts."""
    from paratrain.checkpoint.manifest import resolve_checkpoint
    from paratrain.config import ConfigError

    root = str(tmp_path / "checkpoints")
    assert resolve_checkpoint("latest", root, out_dir=str(tmp_path)) is None  # nothing there: a fresh start
    (tmp_path / "metrics.jsonl").write_text("")
    assert resolve_checkpoint("latest", root, out_dir=str(tmp_path)) is None
    _rows(tmp_path / "metrics.jsonl", range(1, 31))
    with pytest.raises(ConfigError) as e:
        resolve_checkpoint("latest", root, out_dir=str(tmp_path))
    assert "no checkpoint in" in str(e.value) and "records 30 steps" in str(e.value) and "--overwrite" in str(e.value)
    assert "\n" not in str(e.value)
    assert resolve_checkpoint("latest", root) is None  # no out_dir: --overwrite, or a restart's own rows


def test_a_restarted_attempt_of_a_resumed_run_starts_over_instead_of_refusing_its_own_rows(tmp_path, monkeypatch):
    """--resume --max-restarts: an attempt that failed after logging rows but before its first
    checkpoint leaves metrics.jsonl rows; the restarted attempt (resume_spec: 'latest' with the
    config's resume as fallback) starts over as before, while the first attempt refuses."""
    from types import SimpleNamespace

    from paratrain.checkpoint.checkpointer import Checkpointer, resume_spec
    from paratrain.config import CheckpointConfig, ConfigError

    _rows(tmp_path / "metrics.jsonl", range(1, 4))
    cfg = CheckpointConfig(resume="latest")
    me = SimpleNamespace(
        rank=0, world_size=1, cfg=cfg, overwrite=False, out_dir=str(tmp_path), root=str(tmp_path / "c")
    )
    with pytest.raises(ConfigError, match="records 3 steps"):
        Checkpointer.resume(me, *resume_spec(cfg))  # the first attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert Checkpointer.resume(me, *resume_spec(cfg)) is None  # a restart: step 0, as before
