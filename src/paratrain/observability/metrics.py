"""Run outputs on rank 0: metrics.jsonl, the progress bar, TensorBoard, summary.json and plots."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import math
import os
import statistics
import sys
import time
from array import array
from collections.abc import Sequence

from paratrain.observability.trackers import Tracker

log = logging.getLogger("paratrain")


def setup_logging(*, rank: int, all_ranks: bool) -> None:
    """One logger; rank 0 prints unless every rank was asked for."""
    handler = logging.StreamHandler(sys.stderr)
    prefix = f"[rank {rank}] " if all_ranks else ""
    handler.setFormatter(logging.Formatter(f"{prefix}%(message)s"))
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO if (rank == 0 or all_ranks) else logging.WARNING)


class MetricsWriter:
    """Writes one JSON object per optimiser step and hands it to the trackers; a no-op on ranks other than 0."""

    def __init__(
        self,
        out_dir: str,
        *,
        enabled: bool,
        total_steps: int,
        progress: bool,
        trackers: Sequence[Tracker] = (),
        start_step: int = 0,
        watched: Sequence[str] = (),
    ):
        self.enabled = enabled
        self.watched = tuple(watched)  # the objectives' values for the console (Objective.watched)
        self.trackers = list(trackers)
        self._file = self._bar = None
        self._line_every = 0
        if not enabled:
            return
        self.path = os.path.join(out_dir, "metrics.jsonl")
        try:
            os.makedirs(out_dir, exist_ok=True)
            self._file = open(self.path, "a" if start_step else "w")
        except OSError as e:
            raise _write_error(self.path, "opening", e) from None
        self.total_steps = total_steps
        self._t_start, self._start_step = time.perf_counter(), start_step
        # A bar on a terminal; in a log file (CI, batch jobs) about twenty plain lines instead of
        # thousands of carriage-return updates.
        self._line_every = max(1, total_steps // 20) if progress and not sys.stderr.isatty() else 0
        if progress and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                mininterval=1.0,
                file=sys.stderr,
            )

    def log_step(self, row: dict) -> None:
        if not self.enabled:
            return
        try:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        except OSError as e:  # a torn row is dropped by truncate_metrics when the run resumes
            raise _write_error(self.path, f"writing step {row['step']} to", e) from None
        if self._bar is not None:  # tqdm shows the ETA itself
            self._bar.set_postfix(progress_fields(row, self.watched), refresh=False)
            self._bar.update(1)
            if "val_loss" in row:  # kept above the bar, not only until the next step's postfix
                self._bar.write(validation_line(row, self.total_steps), file=sys.stderr)
        elif self._line_every and (row["step"] % self._line_every == 0 or row["step"] == self.total_steps):
            done = row["step"] - self._start_step
            eta = (time.perf_counter() - self._t_start) / max(done, 1) * (self.total_steps - row["step"])
            fields = "  ".join(f"{k} {v}" for k, v in progress_fields(row, self.watched).items())
            log.info(
                "step %d/%d  %s  lr %.2e  grad_norm %.3f  ETA %s",
                row["step"],
                self.total_steps,
                fields,
                row["lr"],
                row["grad_norm"],
                format_eta(eta),
            )
        elif self._line_every and "val_loss" in row:  # every validation result, not only on a progress line's step
            log.info("%s", validation_line(row, self.total_steps))
        for t in self.trackers:
            t.log(row)

    def finish(self, summary: dict | None) -> None:
        """Send the summary to the trackers and end their runs; None marks the run failed there."""
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            t.finish(summary)

    def close(self) -> None:
        for h in (self._bar, self._file):
            if h is not None:
                with contextlib.suppress(OSError):  # a full disk was reported by log_step
                    h.close()
        self._bar = self._file = None


def progress_fields(row: dict, watched: Sequence[str] = ()) -> dict[str, str]:
    """Loss, the objectives' watched values (``watched``: patterns of row keys, e.g. GRPO's
    rewards, a preference loss's accuracy and margin), tokens/s, the validation values when
    computed, MFU when known and memory: what the bar and the log lines show."""
    out = {"loss": f"{row['loss']:.4f}"}
    out.update((k, _value(row[k])) for k in row if any(fnmatch.fnmatchcase(k, p) for p in watched))
    out["tok/s"] = f"{row['tokens_per_s']:.0f}"
    out.update(validation_fields(row))
    if "mfu" in row:
        out["mfu"] = f"{100 * row['mfu']:.1f}%"
    if "memory_gib" in row:
        out["mem"] = f"{row['memory_gib']:.2f}GiB"
    return out


def validation_fields(row: dict) -> dict[str, str]:
    """The row's validation values (val_loss and the objectives' val_*), without their bookkeeping."""
    return {k: _value(v) for k, v in row.items() if k.startswith("val_") and k not in ("val_items", "val_time_s")}


def validation_line(row: dict, total_steps: int) -> str:
    fields = "  ".join(f"{k} {v}" for k, v in validation_fields(row).items())
    return f"step {row['step']}/{total_steps}  validation: {fields}"


def _value(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def format_eta(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class RowHistory(Sequence):
    """The per-step rows a run keeps for its summary and plot: only the fields those read, in
    float arrays (48 bytes a step, and 8 per reward column of a preference or GRPO run), where a
    list of the rows kept every row's ~20-key dict (about 0.9 MiB per 1000 steps on every rank,
    as measured over a 12,000-step run).

    A sequence of small dicts (``summarize`` and ``plot_metrics`` take it as they take a list of
    rows); a field a row lacks (``val_loss`` between evaluations) is absent from its dict.
    """

    FIELDS = ("step", "loss", "tokens", "step_time_s", "tokens_per_s", "val_loss", "memory_gib")
    # The plot's panels of preference and GRPO runs: their reward columns, kept from first seen.
    PLOTTED = ("completion_length", "val_reward_accuracy")

    def __init__(self) -> None:
        self._columns = {k: array("d") for k in self.FIELDS}

    def append(self, row: dict) -> None:
        n = len(self)
        for k in row:
            if k not in self._columns and (k.startswith("reward") or k in self.PLOTTED):
                self._columns[k] = array("d", [math.nan] * n)
        for k, column in self._columns.items():
            column.append(float(row[k]) if row.get(k) is not None else math.nan)

    def __len__(self) -> int:
        return len(self._columns["step"])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row = {k: column[i] for k, column in self._columns.items() if not math.isnan(column[i])}
        for k in ("step", "tokens"):
            if k in row:
                row[k] = int(row[k])
        return row


def summarize(rows: Sequence[dict]) -> dict:
    if not rows:
        return {"steps": 0}
    # A diverged step's loss (NaN) is not stored (the columns hold NaN for "absent"): it reads as NaN.
    losses = [r.get("loss", math.nan) for r in rows]
    finite = [x for x in losses if math.isfinite(x)]
    # The first steps include warm-up effects (allocator, caches): leave them out of speed.
    steady = rows[min(2, len(rows) - 1) :]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    return {
        "steps": rows[-1]["step"],
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "min_loss": min(finite, default=math.nan),
        "losses": losses,
        "tokens": sum(r["tokens"] for r in rows),
        "train_time_s": sum(r["step_time_s"] for r in rows),
        "median_step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        **({"final_val_loss": vals[-1], "best_val_loss": min(vals)} if vals else {}),
        **(
            {"max_memory_gib": max(r["memory_gib"] for r in rows if "memory_gib" in r)}
            if "memory_gib" in rows[-1]
            else {}
        ),
    }


def plot_metrics(rows: list[dict], path: str) -> None:
    """Loss (and validation loss, when evaluated) and throughput against step, one PNG; a
    preference or reward run adds how often the chosen reply's reward is the higher, a GRPO run
    its rewards."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    rewards = any("reward_accuracy" in r for r in rows)
    rl = any("completion_length" in r for r in rows)  # reinforcement learning (objectives/rl/rollout.py)
    fig, axes = plt.subplots(1, 3 if rewards or rl else 2, figsize=(15 if rewards or rl else 10, 3.6))
    ax1, ax2 = axes[:2]
    if rl:  # the mean reward of the step's completions, and each reward function's
        ax3 = axes[2]
        names = sorted({k for r in rows for k in r if k.startswith("reward_") and k != "reward_std"})
        ax3.plot(steps, [r.get("reward") for r in rows], lw=1.6, color="black", label="reward (weighted sum)")
        for name in names:
            ax3.plot(steps, [r.get(name) for r in rows], lw=1.0, label=name.removeprefix("reward_"))
        ax3.set(xlabel="step", ylabel="mean over the completions", title="rewards")
        ax3.legend(fontsize=8)
        ax3.grid(alpha=0.3)
    if rewards:
        ax3 = axes[2]
        ax3.plot(steps, [r.get("reward_accuracy") for r in rows], lw=1.2, label="training")
        val = [(r["step"], r["val_reward_accuracy"]) for r in rows if "val_reward_accuracy" in r]
        if val:
            ax3.plot(*zip(*val), "o-", ms=3, lw=1.2, color="tab:red", label="validation")
        ax3.set(xlabel="step", ylabel="pairs ranked right", title="reward accuracy", ylim=(0, 1))
        ax3.legend()
        ax3.grid(alpha=0.3)
    ax1.plot(steps, [r["loss"] for r in rows], lw=1.2, label="training")
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if val:
        ax1.plot(*zip(*val), "o-", ms=3, lw=1.2, color="tab:red", label="validation")
        ax1.legend()
    ax1.set(xlabel="step", ylabel="loss", title="loss")
    ax1.grid(alpha=0.3)
    ax2.plot(steps, [r["tokens_per_s"] for r in rows], lw=1.2, color="tab:green")
    ax2.set(xlabel="step", ylabel="tokens/s", title="throughput")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class MetricsWriteError(RuntimeError):
    """metrics.jsonl could not be written (a full or read-only disk): one line naming the file and
    what to free, exit code 1, as a checkpoint that cannot be written (CheckpointSaveError)."""


def _write_error(path: str, what: str, e: OSError) -> MetricsWriteError:
    folder = os.path.dirname(os.path.abspath(path))
    return MetricsWriteError(
        f"{what} {path} failed ({e.strerror or e}); free space on the disk of {folder} (df -h {folder})"
        " or fix its permissions, then resume (--resume)"
    )


def truncate_metrics(out_dir: str, step: int) -> None:
    """Drop metrics.jsonl rows after ``step`` (written after the checkpoint, before a failure).

    In place: the file is cut at the end of the last row kept, which takes no new space, so a
    resume onto a full disk gets this far (no temporary copy to write and leave behind).
    """
    path = os.path.join(out_dir, "metrics.jsonl")
    with contextlib.suppress(OSError):
        os.remove(path + ".tmp")  # left by paratrain versions that rewrote the file through a copy
    if not os.path.isfile(path):
        return
    try:
        with open(path, "r+b") as f:
            end, newline = 0, True
            for line in f:
                try:
                    if json.loads(line)["step"] > step:
                        break
                except (ValueError, KeyError, TypeError):
                    break  # a torn last line
                end, newline = end + len(line), line.endswith(b"\n")
            f.truncate(end)
            if not newline:  # the last row kept was complete but its newline was not written
                f.seek(end)
                f.write(b"\n")
    except OSError as e:
        raise _write_error(path, f"cutting the rows after step {step} from", e) from None
