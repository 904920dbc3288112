"""The search: enumerate layouts, price each, estimate memory fastest first, rank.

Step time is cheap (a formula), memory is not (a fake-tensor run of the step), so layouts are
sorted by predicted step time and their memory is estimated in that order until ``top`` of
them fit; the rest are counted as not estimated. Two shortcuts skip a run, both counted as
refusals: a lower bound (fp32 parameters, gradients and optimiser state split as far as the
layout splits them) over the budget, and that bound plus the activations measured on a
sibling layout (:data:`SIBLING_MARGIN`). The first ``top`` fitting layouts are then
exactly the ``top`` fastest that fit. When none fits, every layout has been estimated and the
smallest peak is known.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from paratrain.config import Config, ConfigError
from paratrain.plan.cost import TERMS, Cost, ModelStats, step_cost
from paratrain.plan.enumerate import Layout, count_blocks, enumerate_layouts, meta_build
from paratrain.plan.memory import MemoryModel, RankMemory
from paratrain.plan.profile import GIB, Profile

# A layout whose exact states plus the activations measured on a sibling (same tp,
# checkpointing and resharding; other data-parallel degrees, accumulation) exceed the budget by this factor is refused
# without its own fake-tensor run: the margin covers what the sibling's activations may differ by.
SIBLING_MARGIN = 1.1


@dataclass
class Planned:
    layout: Layout
    cost: Cost
    memory: RankMemory | None = None

    def to_json(self, usable: int) -> dict:
        peak = self.memory.peak_bytes if self.memory else None
        return {
            "set": self.layout.set_lines(),
            "step_time_s": self.cost.step_time_s,
            "tokens_per_s": self.cost.tokens_per_s,
            "mfu": self.cost.mfu,
            "peak_bytes": peak,
            "headroom_bytes": None if peak is None else usable - peak,
            "dominant": self.cost.dominant,
            "terms": self.cost.terms,
            "micro_batches_per_step": self.cost.n_micro,
        }


@dataclass
class PlanResult:
    world_size: int
    nproc_per_node: int
    profile: Profile
    budget_bytes: int
    usable_bytes: int
    layouts: list[Planned]  # fitting, best first
    refused: Counter
    examined: list[Planned] = field(default_factory=list)  # every layout whose memory was estimated
    not_estimated: int = 0
    estimates: int = 0
    seconds: float = 0.0
    smallest_bound: int | None = None  # the least lower bound of layouts refused without an estimate

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "nproc_per_node": self.nproc_per_node,
            "hardware": self.profile.name,
            "calibrated_from": list(self.profile.calibrated_from),
            "budget_bytes": self.budget_bytes,
            "usable_bytes": self.usable_bytes,
            "layouts": [p.to_json(self.usable_bytes) for p in self.layouts],
            "refused": dict(self.refused),
            "not_estimated": self.not_estimated,
            "memory_estimates": self.estimates,
            "seconds": self.seconds,
        }

    def table(self) -> str:
        lines = [
            self.profile.describe(),
            f"plan: world {self.world_size} ({self.nproc_per_node} per node), budget"
            f" {self.budget_bytes / GIB:.2f} GiB per rank, usable {self.usable_bytes / GIB:.2f} GiB;"
            f" {sum(self.refused.values())} layouts refused, {len(self.examined)} estimated"
            f" ({self.estimates} fake-tensor runs), {self.not_estimated} slower ones not estimated;"
            f" {self.seconds:.1f} s",
            f"  {'#':>3} {'step_s':>10} {'tokens/s':>11} {'MFU':>6} {'peak_GiB':>9} {'headroom':>9}  {'dominant':<15} layout",
        ]
        for i, p in enumerate(self.layouts, 1):
            peak = p.memory.peak_bytes
            lines.append(
                f"  {i:>3} {p.cost.step_time_s:>10.4g} {p.cost.tokens_per_s:>11.4g} {p.cost.mfu:>6.1%}"
                f" {peak / GIB:>9.3f} {(self.usable_bytes - peak) / GIB:>9.3f}  {p.cost.dominant:<15} {p.layout.short()}"
            )
        if self.layouts:
            best = self.layouts[0]
            lines.append("  cost terms of the best (s): " + ", ".join(f"{k} {best.cost.terms[k]:.4g}" for k in TERMS))
            lines.append("  best layout: " + " ".join(f"--set {s}" for s in best.layout.set_lines()))
        if self.refused:
            lines.append("  refused by the preflight checks:")
            lines += [f"    {n:>6}  {reason}" for reason, n in self.refused.most_common()]
        return "\n".join(lines)


def nothing_fits_error(result: PlanResult) -> ConfigError:
    if not result.examined and result.smallest_bound is None:
        reasons = "; ".join(f"{n} x {r}" for r, n in result.refused.most_common(3))
        return ConfigError(f"no layout of this config passes the preflight at world {result.world_size} ({reasons})")
    if result.examined:
        small = min(result.examined, key=lambda p: p.memory.peak_bytes)
        need, what = (
            small.memory.peak_bytes,
            f"the smallest needs {small.memory.peak_bytes / GIB:.2f} GiB ({small.layout.short()})",
        )
    else:
        need = result.smallest_bound
        what = f"even the parameters, gradients and optimiser state need at least {need / GIB:.2f} GiB"
    return ConfigError(
        f"no layout fits {result.usable_bytes / GIB:.2f} GiB usable per rank; {what}; give each rank at least"
        f" {need / GIB / (result.usable_bytes / result.budget_bytes):.2f} GiB (--memory-gib), more GPUs"
        " (--nnodes), or a smaller batch.global_batch_size, context or model"
    )


def plan(
    cfg: Config,
    *,
    world_size: int,
    nproc_per_node: int,
    profile: Profile,
    memory_gib: float = 0.0,
    top: int = 10,
    memory: MemoryModel | None = None,
    progress: bool = True,
) -> PlanResult:
    """Rank the layouts of ``cfg`` at ``world_size``; ``top`` <= 0 estimates every layout."""
    start = time.perf_counter()
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    model, spec = meta_build(cfg)
    n_blocks = count_blocks(model, spec)
    layouts, refused = enumerate_layouts(
        cfg, world_size=world_size, nproc_per_node=nproc_per_node, model=model, spec=spec
    )
    stats = ModelStats.of(model, cfg, spec=spec)
    ranks_per_node = min(nproc_per_node, world_size)
    priced = [
        Planned(lay, step_cost(lay, cfg=cfg, stats=stats, hw=profile, ranks_per_node=ranks_per_node)) for lay in layouts
    ]
    priced.sort(key=lambda p: p.cost.step_time_s)
    budget = int((memory_gib or profile.memory_gib) * GIB)
    usable = int(budget * (1 - cfg.batch.memory_margin))
    say(
        f"plan: {len(layouts)} layouts pass the preflight ({sum(refused.values())} refused);"
        " estimating memory fastest first"
    )
    memory = memory or MemoryModel(cfg, model=model, n_blocks=n_blocks, spec=spec)
    fitting, examined, looked, bounded, guessed = [], [], 0, 0, 0
    smallest_bound = None
    last_note = time.perf_counter()
    for p in priced:
        if top > 0 and len(fitting) >= top:
            break
        looked += 1
        bound = memory.lower_bound(p.layout)
        if bound > usable:
            bounded += 1
            smallest_bound = bound if smallest_bound is None else min(smallest_bound, bound)
            continue
        if memory.sibling_guess(p.layout) > SIBLING_MARGIN * usable:
            guessed += 1
            continue
        p.memory = memory.peak(p.layout)
        examined.append(p)
        if p.memory.peak_bytes <= usable:
            fitting.append(p)
        if time.perf_counter() - last_note > 5:
            last_note = time.perf_counter()
            say(
                f"  {looked}/{len(priced)} layouts looked at ({memory.estimates} fake-tensor runs),"
                f" {len(fitting)} fit, {time.perf_counter() - start:.0f} s"
            )
    if bounded:
        refused["parameters, gradients and optimiser state alone exceed the usable memory"] += bounded
    if guessed:
        refused[
            f"states + what an estimated sibling layout holds beyond them exceed {SIBLING_MARGIN:g} x the usable memory"
        ] += guessed
    for p in examined:
        if p.memory.peak_bytes > usable:
            refused["peak memory exceeds the usable memory per rank"] += 1
    return PlanResult(
        world_size,
        nproc_per_node,
        profile,
        budget,
        usable,
        fitting,
        refused,
        examined,
        len(priced) - looked,
        memory.estimates,
        time.perf_counter() - start,
        smallest_bound,
    )
