"""Experiment trackers behind one small interface: TensorBoard, Weights & Biases, MLflow.

Rank 0 builds them before the first step (``build_trackers``), so a tracker that cannot start
(package missing, directory not writable, bad URI) is one ConfigError line before any training,
not a crash at step 1000. Each tracker gets the resolved config once (``start``), every metrics
row (``log``) and the summary (``finish``). Lists in a row (per-rank times) are logged as one
scalar per rank, ``rank_step_time_s/1``.

A resumed run continues its tracker runs: each tracker's run id is kept in the checkpoint
(``TrainState.tracker_runs``) and handed back to ``start``, so a run restarted five times is one
curve, not five. The steps after the checkpoint are computed again with the same values (the
run is exact); TensorBoard drops its events after the checkpoint's step (``purge_step``), W&B
ignores steps it already has, MLflow records the redone steps a second time with the same values.
"""

from __future__ import annotations

import importlib
import logging
import os

from paratrain.config import ConfigError, MetricsConfig

log = logging.getLogger("paratrain")


def scalars(row: dict) -> dict[str, float]:
    """The numeric fields of a row (bools and strings left out), lists flattened per index."""
    out = {}
    for k, v in row.items():
        if k == "step" or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[k] = float(v)
        elif isinstance(v, list):
            out.update({f"{k}/{i}": float(x) for i, x in enumerate(v) if isinstance(x, (int, float))})
    return out


def _require(module: str, extra: str, key: str, off: str):
    """The optional package ``module`` a tracker needs, or one line: install the extra or turn it off."""
    try:
        return importlib.import_module(module)
    except ImportError as e:  # the extras are optional
        raise ConfigError(f"{key} needs the {extra} package ({e}); pip install 'paratrain[{extra}]' or set {off}")


class Tracker:
    """The interface: start once, log each row, finish with the summary."""

    name = "tracker"
    run_id: str | None = None  # what ``start`` continues after a resume (None: nothing to keep)

    def start(self, config: dict, *, resume_id: str | None = None, start_step: int = 0) -> None:
        """Start a run, or continue run ``resume_id`` from after ``start_step``; sets ``run_id``."""

    def log(self, row: dict) -> None:
        raise NotImplementedError

    def finish(self, summary: dict | None) -> None:
        pass


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, out_dir: str):
        tensorboard = _require(
            "torch.utils.tensorboard", "tensorboard", "metrics.tensorboard = true", "metrics.tensorboard = false"
        )
        self.summary_writer = tensorboard.SummaryWriter
        self.log_dir = _writable_dir(os.path.join(out_dir, "tensorboard"), "metrics.tensorboard")
        self.writer = None

    def start(self, config: dict, *, resume_id: str | None = None, start_step: int = 0) -> None:
        import json

        # The log directory is the run: after a resume from step N, TensorBoard discards the events
        # the first run wrote past N (purge_step), which are about to be logged again.
        self.writer = self.summary_writer(self.log_dir, purge_step=start_step + 1 if start_step else None)
        if not start_step:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, row: dict) -> None:
        for k, v in scalars(row).items():
            self.writer.add_scalar(f"train/{k}", v, row["step"])

    def finish(self, summary: dict | None) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, cfg: MetricsConfig, out_dir: str):
        self.wandb = _require("wandb", "wandb", "metrics.wandb = true", "metrics.wandb = false")
        mode = cfg.wandb_mode
        if mode == "auto":  # online only with a key at hand: never a login prompt or a network wait unasked
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        self.mode = mode
        self.kwargs = dict(
            project=cfg.wandb_project,
            name=cfg.wandb_run_name or os.path.basename(os.path.abspath(out_dir)),
            tags=list(cfg.wandb_tags) or None,
            dir=_writable_dir(os.environ.get("WANDB_DIR") or out_dir, "metrics.wandb"),
            mode=mode,
        )
        self.run = None

    def start(self, config: dict, *, resume_id: str | None = None, start_step: int = 0) -> None:
        try:
            # init_timeout bounds the wait on the service (and on the server when online).
            self.run = self.wandb.init(
                config=config,
                settings=self.wandb.Settings(init_timeout=60),
                # A resume continues the run of that id (or makes it, if the first never synced).
                id=resume_id,
                resume="allow" if resume_id else None,
                **self.kwargs,
            )
        except Exception as e:  # noqa: BLE001 - wandb raises many kinds; all mean "cannot start"
            raise ConfigError(
                f"metrics.wandb: wandb.init failed in mode '{self.mode}' ({type(e).__name__}: {_first_sentence(e)});"
                " set metrics.wandb_mode = 'offline' or metrics.wandb = false"
            )
        self.run_id = self.run.id
        log.info(
            "wandb: run %s %s(%s) in %s", self.run.name, "continued " if resume_id else "", self.mode, self.run.dir
        )

    def log(self, row: dict) -> None:
        self.run.log(scalars(row), step=row["step"])

    def finish(self, summary: dict | None) -> None:
        if self.run is None:
            return
        if summary:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        self.run.finish(exit_code=0 if summary is not None else 1)
        self.run = None


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, cfg: MetricsConfig, out_dir: str):
        self.mlflow = _require("mlflow", "mlflow", "metrics.mlflow", "metrics.mlflow = ''")
        uri = cfg.mlflow
        if uri.startswith("file:"):
            _writable_dir(uri.removeprefix("file://").removeprefix("file:"), "metrics.mlflow")
            # MLflow 3 refuses its file store unless opted in (it prefers sqlite:///); a `file:` URI
            # in the config is that opt-in.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri, self.experiment = uri, cfg.mlflow_experiment
        self.run_name = cfg.wandb_run_name or os.path.basename(os.path.abspath(out_dir))
        self.run = None

    def start(self, config: dict, *, resume_id: str | None = None, start_step: int = 0) -> None:
        try:
            self.mlflow.set_tracking_uri(self.uri)
            self.mlflow.set_experiment(self.experiment)
            self.run = self._continue(resume_id) if resume_id else None
            logged = dict(self.run.data.params) if self.run else {}
            self.run = self.run or self.mlflow.start_run(run_name=self.run_name)
            self.run_id = self.run.info.run_id
            flat = {f"{sec}.{k}": v for sec, sub in config.items() for k, v in sub.items()}
            # MLflow caps a param value at 6000 characters and a batch at 100 params. A param
            # cannot change value: a resumed run logs only those it lacks (checkpoint.resume, say).
            items = [(k, str(v)[:6000]) for k, v in flat.items() if k not in logged]
            if start_step:  # what changed at the resume (a param cannot): tags "resumed/STEP/KEY"
                changed = {
                    f"resumed/{start_step}/{k}": str(v)[:5000]
                    for k, v in flat.items()
                    if logged.get(k, str(v)[:6000]) != str(v)[:6000]
                }
                self.mlflow.set_tags({"resumed_from_step": start_step, **changed})
            for i in range(0, len(items), 100):
                self.mlflow.log_params(dict(items[i : i + 100]))
        except Exception as e:  # noqa: BLE001 - bad URI, server down, permissions
            raise ConfigError(
                f"metrics.mlflow = {self.uri!r} cannot start a run ({type(e).__name__}: {_first_sentence(e)});"
                " use a reachable tracking URI such as 'file:/path/mlruns', or ''"
            )

    def _continue(self, run_id: str):
        """The run ``run_id`` reopened, or None (a new run) when this store does not have it."""
        try:
            return self.mlflow.start_run(run_id=run_id)
        except Exception as e:  # noqa: BLE001 - MlflowException: no such run in this store
            log.warning("mlflow: run %s cannot be continued (%s); starting a new run", run_id, _first_sentence(e))
            return None

    def log(self, row: dict) -> None:
        # synchronous=False: MLflow queues the write on its own thread (a file store writes one
        # file per metric); end_run waits for the queue.
        self.mlflow.log_metrics(scalars(row), step=row["step"], synchronous=False)

    def finish(self, summary: dict | None) -> None:
        if self.run is None:
            return
        if summary:
            self.mlflow.log_metrics(
                {
                    f"final/{k}": float(v)
                    for k, v in summary.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)
                }
            )
        self.mlflow.end_run(status="FINISHED" if summary is not None else "FAILED")
        self.run = None


def _first_sentence(e: Exception) -> str:
    """Libraries raise paragraphs; the error line keeps the first sentence."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text.split(". ")[0]


def _writable_dir(path: str, key: str) -> str:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".paratrain-write-test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{key}: cannot write to '{path}' ({e.strerror}); point it at a writable directory")
    return path


def check_trackers(cfg: MetricsConfig, *, out_dir: str) -> list[Tracker]:
    """The configured trackers, created but not started: packages importable, directories writable.

    The CLI calls this before any process starts; creating starts no run and writes only the
    directories the trackers will write to.
    """
    trackers: list[Tracker] = []
    if cfg.tensorboard:
        trackers.append(TensorBoardTracker(out_dir))
    if cfg.wandb:
        trackers.append(WandbTracker(cfg, out_dir))
    if cfg.mlflow:
        trackers.append(MlflowTracker(cfg, out_dir))
    return trackers


def build_trackers(
    cfg: MetricsConfig, *, out_dir: str, config: dict, resume: dict | None = None, start_step: int = 0
) -> list[Tracker]:
    """Create and start every configured tracker (rank 0 only), or raise ConfigError naming the one that failed.

    ``resume``: tracker name -> run id of the run being resumed (``TrainState.tracker_runs``),
    ``start_step`` its step: those runs are continued.
    """
    trackers = check_trackers(cfg, out_dir=out_dir)
    try:
        for t in trackers:
            t.start(config, resume_id=(resume or {}).get(t.name), start_step=start_step)
    except ConfigError:
        for t in trackers:
            try:
                t.finish(None)
            except Exception:  # noqa: BLE001 - already failing; report the first cause
                pass
        raise
    return trackers
