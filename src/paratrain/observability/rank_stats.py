"""Memory and time per rank, and the straggler: the fields every metrics row gains.

Every step each row carries rank 0's own memory (no collective). Every
``metrics.rank_stats_every`` steps one all-gather of a few floats per rank brings every rank's
memory, step time, data time and local compute time to all ranks; the row then holds the
maximum memory and which rank holds it, the per-rank times, the slowest rank and its ratio to
the median. The collective is a tensor of 5 float64 per rank on the host (gloo) or the device
(NCCL only), so its cost is one latency-bound all-gather (measured in benchmarks/overhead/observe_overhead.py).

Why ``local_time_s`` and not only the step time: in synchronous data parallelism every rank
waits for the slowest one inside the gradient all-reduce, so the wall time of a step is the
same on every rank and cannot name the straggler. The time a rank spends before it can wait for
anyone, loading its batch (``data_time_s``) and running its forwards (forward hooks, summed over
micro-batches), differs; that is the time compared with the median. Under FSDP2/TP the forward
itself contains collectives, so there the comparison is coarser (documented in
docs/observability.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import MetricsConfig

log = logging.getLogger("paratrain")

GIB = 1024**3


def local_memory(device: torch.device) -> tuple[float, float]:
    """(used, reserved) GiB of this rank since the previous call.

    CUDA: the peaks of ``max_memory_allocated``/``max_memory_reserved`` since the last call (the
    peak counter is reset). CPU: the process resident set size, twice.
    """
    if device.type == "cuda":
        used, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        return used / GIB, reserved / GIB
    rss = _rss_bytes() / GIB
    return rss, rss


def _rss_bytes() -> int:
    try:  # Linux: the current RSS, one small read
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # elsewhere: the peak RSS (kilobytes on Linux, bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class ForwardTimer:
    """Sums the wall time of the model's forwards (hooks on the outermost module)."""

    def __init__(self, model: nn.Module):
        self.total = 0.0
        self._t0 = 0.0
        self._handles = [
            model.register_forward_pre_hook(self._start),
            model.register_forward_hook(self._stop),
        ]

    def _start(self, module, args) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, module, args, output) -> None:
        self.total += time.perf_counter() - self._t0

    def take(self) -> float:
        t, self.total = self.total, 0.0
        return t

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class RankStats:
    """Per-step memory fields, and every ``rank_stats_every`` steps the gathered per-rank times."""

    def __init__(self, cfg: MetricsConfig, *, rank: int, world_size: int, device: torch.device, model: nn.Module):
        self.every, self.ratio = cfg.rank_stats_every, cfg.straggler_ratio
        self.rank, self.world_size, self.device = rank, world_size, device
        # NCCL-only groups cannot carry host tensors; 'auto' on CUDA adds gloo for them.
        backend = dist.get_backend() if dist.is_initialized() else "gloo"
        self.gather_device = torch.device("cpu") if "gloo" in str(backend) else device
        # (a pipeline model's schedule calls the stages, not this module: no forward time there)
        self.timer = ForwardTimer(model) if self.every and isinstance(model, nn.Module) else None

    @contextlib.contextmanager
    def excluded(self):
        """Forwards inside (the validation loss) are not the step's: their time is dropped."""
        kept = self.timer.total if self.timer else 0.0
        try:
            yield
        finally:
            if self.timer:
                self.timer.total = kept

    def row(self, *, step: int, step_time_s: float, data_time_s: float) -> dict:
        used, reserved = local_memory(self.device)
        forward_s = self.timer.take() if self.timer else 0.0
        out = {"memory_gib": used, "memory_rank": self.rank}
        if self.device.type == "cuda":
            out["memory_reserved_gib"] = reserved
        if not (self.every and step % self.every == 0 and dist.is_initialized()):
            return out
        mine = torch.tensor(
            [used, reserved, step_time_s, data_time_s, data_time_s + forward_s],
            dtype=torch.float64,
            device=self.gather_device,
        )
        table = torch.empty(self.world_size * mine.numel(), dtype=torch.float64, device=self.gather_device)
        dist.all_gather_single(table, mine)  # (gloo wants a flat output)
        used_r, reserved_r, step_r, data_r, local_r = table.view(self.world_size, -1).cpu().t().tolist()
        top = max(range(self.world_size), key=used_r.__getitem__)
        slowest = max(range(self.world_size), key=local_r.__getitem__)
        median = statistics.median(local_r)
        straggle = local_r[slowest] / median if median > 0 else 1.0
        out.update(
            memory_gib=used_r[top],
            memory_rank=top,
            rank_memory_gib=used_r,
            rank_step_time_s=step_r,
            rank_data_time_s=data_r,
            rank_local_time_s=local_r,
            slowest_rank=slowest,
            straggle_ratio=straggle,
        )
        if self.device.type == "cuda":
            out["memory_reserved_gib"] = max(reserved_r)
        if straggle > self.ratio and self.world_size > 1:  # every rank marks the row; rank 0 logs
            out["straggler"] = slowest
            (log.warning if self.rank == 0 else log.debug)(
                "step %d: rank %d is a straggler: local time %.3fs is %.2fx the median over ranks (%.3fs;"
                " data %.3fs); see rank_local_time_s in metrics.jsonl",
                step,
                slowest,
                local_r[slowest],
                straggle,
                median,
                data_r[slowest],
            )
        return out

    def close(self) -> None:
        if self.timer:
            self.timer.close()


def build_rank_stats(
    cfg: MetricsConfig, *, rank: int, world_size: int, device: torch.device, model: nn.Module
) -> RankStats:
    return RankStats(cfg, rank=rank, world_size=world_size, device=device, model=model)
