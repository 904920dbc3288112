"""torch.profiler traces of a few steps, and CUDA memory snapshots ([profile] in the config).

``maybe_profile(cfg, step=..., rank=..., out_dir=...)`` wraps one optimiser step; it does nothing
unless the step lies in ``profile.steps``. The trace of the whole range is one Chrome trace JSON
per rank (``out_dir/profile/rank{R}.steps{A}-{B}.json``), which Perfetto (ui.perfetto.dev) and
chrome://tracing open. The profiler is started at the first step of the range and stopped after
the last, so steps outside it pay nothing.

On CUDA, ``memory_snapshot = true`` records the caching allocator's history
(``torch.cuda.memory._record_memory_history``, see pytorch.org/docs/stable/torch_cuda_memory.html)
and writes ``torch.cuda.memory._snapshot()`` after the step whose peak is the highest so far, and
when a step runs out of memory; https://pytorch.org/memory_viz opens the pickles.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle

import torch
from torch.profiler import ProfilerActivity, profile

from paratrain.config import ProfileConfig, parse_steps

log = logging.getLogger("paratrain")


class Profiler:
    """Holds the profiler across the steps of the range; one per rank."""

    def __init__(self, cfg: ProfileConfig, *, rank: int, out_dir: str, device: torch.device):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.range = parse_steps(cfg.steps) if cfg.steps else None
        self.dir = os.path.join(out_dir, "profile")
        self._prof = None
        self._peak = 0
        self.snapshot_enabled = cfg.memory_snapshot and device.type == "cuda"
        if cfg.memory_snapshot and device.type != "cuda":
            log.warning("profile.memory_snapshot needs CUDA; no snapshot on %s", device.type)
        if self.range or self.snapshot_enabled:
            os.makedirs(self.dir, exist_ok=True)
        if self.snapshot_enabled:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    @contextlib.contextmanager
    def maybe_profile(self, step: int):
        """Context around optimiser step ``step`` (1-based); traces it when it lies in profile.steps."""
        self.begin(step)
        try:
            yield
        except BaseException as e:
            self.on_error(e, step)
            raise
        self.end(step)

    def begin(self, step: int) -> None:
        if self.range and step == self.range[0]:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._prof = profile(
                activities=activities,
                record_shapes=self.cfg.record_shapes,
                profile_memory=self.cfg.profile_memory,
                with_stack=self.cfg.with_stack,
            )
            self._prof.__enter__()

    def end(self, step: int) -> None:
        if self._prof is not None and step == self.range[1]:
            self._prof.__exit__(None, None, None)
            path = os.path.join(self.dir, f"rank{self.rank}.steps{self.range[0]}-{self.range[1]}.json")
            self._prof.export_chrome_trace(path)
            self._prof = None
            log.info("profile: steps %d-%d traced to %s (open in ui.perfetto.dev)", *self.range, path)
        if self.snapshot_enabled:
            peak = torch.cuda.max_memory_allocated(self.device)
            if peak > self._peak:  # keep one snapshot: the step with the highest peak so far
                self._peak = peak
                self._snapshot(f"rank{self.rank}.peak.pickle")

    def on_error(self, error: BaseException, step: int) -> None:
        if self.snapshot_enabled and isinstance(error, torch.OutOfMemoryError):
            self._snapshot(f"rank{self.rank}.oom.step{step}.pickle")
            log.error("out of memory at step %d: allocator snapshot in %s", step, self.dir)

    def _snapshot(self, name: str) -> None:
        with open(os.path.join(self.dir, name), "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)

    def close(self) -> None:
        if self._prof is not None:  # the run ended inside the range
            self._prof.__exit__(None, None, None)
            self._prof = None
        if self.snapshot_enabled:
            torch.cuda.memory._record_memory_history(enabled=None)


def build_profiler(cfg: ProfileConfig, *, rank: int, out_dir: str, device: torch.device) -> Profiler:
    return Profiler(cfg, rank=rank, out_dir=out_dir, device=device)
