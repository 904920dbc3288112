"""The combination sweep: every pair of the features of ``paratrain.preflight.support.FEATURES``, each
either run against one process (plain SGD, per-step loss and grad_norm) or refused by the
preflight in one line, never silently different.

A layout picks one level of some features (the rest off) on a tiny GPT over a byte-level corpus
with documents, on at most 4 ranks. The layouts form a covering design built greedily (the AETG
method of Cohen et al. 1997, "The AETG system: an approach to testing based on combinatorial
design"): among random candidates that the preflight accepts, take the one that covers the most
pairs of (feature, level) not yet covered, until no candidate adds one; a pair that no accepted
layout can hold is shown refused with the preflight's line. A seed fixes the candidates, so a
design (and a failure) reproduces. A feature declared in FEATURES joins the sweep by itself.

``python -m paratrain.testing.sweep`` runs the whole sweep and writes ``docs/combinations.md``;
tests/distributed/test_sweep.py runs a seeded sample of it (fast tier) and all of it (slow tier).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from paratrain.config import ConfigError, load_config
from paratrain.preflight.support import FEATURES, Feature

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
GLOBAL_BATCH = 8
# Two steps: the first step's loss and grad_norm check the forward and backward of the layout, the
# second's check that the first update (through the layout's sharded parameters) equals one
# process's; a third step repeats the second with nothing new to check (plain SGD keeps no state).
STEPS = 2
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp")  # each level is a degree of 2
# A feature that only makes sense with another one on: the sweep turns the other on with it.
COMPANIONS = {"ep": ("moe",), "loss_parallel": ("tp",)}


def base_overrides(corpus: str) -> list[str]:
    """The one model and data every layout trains: a 4-block GPT (4 heads, so that all-to-all
    context parallel splits them over cp x tp) on a byte-level corpus with document boundaries."""
    return [
        "model.name='gpt'",
        "model.args={n_layer = 4, n_head = 4, d_model = 32, block_size = 32}",
        "data.name='tokens'",
        f"data.args={{path = '{corpus}', block_size = 32}}",
        f"batch.global_batch_size={GLOBAL_BATCH}",
        f"run.steps={STEPS}",
        "optim.name='sgd'",
        "optim.lr=0.5",
        "optim.beta1=0",
        "optim.weight_decay=0",
        "optim.grad_clip=0",
        "optim.warmup_steps=0",
        "optim.schedule='constant'",
        "run.progress=false",
        "metrics.plot=false",
        "run.save_model=false",
    ]


def make_corpus(out_dir: str) -> str:
    """A byte-level corpus of 96 documents of 8 to 80 bytes cut from a standard-library file (no
    download): rows then hold several documents (packing) or one (padding)."""
    import sysconfig

    from paratrain.data.prepare import prepare

    with open(os.path.join(sysconfig.get_paths()["stdlib"], "bisect.py")) as f:
        text = f.read()
    rng, docs, at = random.Random(0), [], 0
    for _ in range(96):
        n = rng.randint(8, 80)
        docs.append(text[at : at + n])
        at += n
    os.makedirs(out_dir, exist_ok=True)
    rows = os.path.join(out_dir, "docs.jsonl")
    with open(rows, "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    prepare([rows], out_dir=os.path.join(out_dir, "corpus"), tokenizer="bytes", val_fraction=0, progress=False)
    return os.path.join(out_dir, "corpus")


@dataclass(frozen=True)
class Layout:
    """One level of each feature it turns on (feature -> level name). ``features``: the table its
    levels are read from (another sweep's, e.g. testing/vision_sweep.py; not part of its identity)."""

    levels: tuple[tuple[str, str], ...]
    features: Mapping[str, Feature] = field(default_factory=lambda: FEATURES, compare=False, repr=False)

    @property
    def name(self) -> str:
        return "-".join(f"{f}_{lv}".replace("+", "") for f, lv in self.levels) or "reference"

    @property
    def world(self) -> int:
        """The product of the degrees its overrides set (a level may set two: HSDP's 2 x 2)."""
        world = 1
        for o in self.overrides():
            if m := re.fullmatch(rf"parallel\.({'|'.join(DEGREES)})=(\d+)", o):
                world *= int(m[2])
        return world

    def overrides(self) -> list[str]:
        return [o for f, lv in self.levels for o in self.features[f].levels[lv]]

    def reference(self) -> Layout:
        """The one-process layout that computes the same math: its model and data features only."""
        return Layout(tuple((f, lv) for f, lv in self.levels if self.features[f].math), self.features)

    def tolerance(self) -> float:
        return max([1e-5, *(self.features[f].tolerance for f, _ in self.levels)])

    def targets(self) -> set[tuple]:
        """The pairs of its levels, and the triples of its levels of features marked ``triples``."""
        marked = [kv for kv in self.levels if self.features[kv[0]].triples]
        return set(itertools.combinations(self.levels, 2)) | set(itertools.combinations(marked, 3))


def _complete(on: dict[str, str], dp: str = "dp_shard", features: Mapping[str, Feature] = FEATURES) -> Layout:
    """``on`` with the companions its features need; ``dp``: the data-parallel dimension that
    expert parallel and gradient compression take when the layout has none."""
    on = dict(on)
    for feature, needs in COMPANIONS.items():
        if feature in on:
            for other in needs:
                on.setdefault(other, next(iter(features[other].levels)))
    if {"ep", "compression"} & set(on) and not {"dp_replicate", "dp_shard"} & set(on):
        on[dp] = "2"
    return Layout(tuple(sorted(on.items(), key=lambda kv: list(features).index(kv[0]))), features)


# A sweep's whole config of a layout: (data folder, layout) -> --set overrides. The text sweep's is
# its GPT and corpus with the layout's levels; another sweep's may pick its model and data by level.
Configure = Callable[[str, Layout], list[str]]


def text_config(corpus: str, layout: Layout) -> list[str]:
    return [*base_overrides(corpus), *layout.overrides()]


def refusal(layout: Layout, corpus: str, configure: Configure = text_config) -> str | None:
    """The preflight's one line for ``layout`` (None: accepted)."""
    from paratrain.preflight import check_run

    if layout.world > 4:
        return f"needs {layout.world} ranks (the sweep runs at most 4)"
    try:
        check_run(load_config(None, configure(corpus, layout)), layout.world)
    except ConfigError as e:
        return str(e)
    return None


def all_targets(features: Mapping[str, Feature] = FEATURES) -> set[tuple]:
    """Every pair of (feature, level) values of two features, and every triple of three
    features marked ``triples``, except those that need more than 4 ranks (three degrees)."""
    values = [(f, lv) for f in features for lv in features[f].levels]
    pairs = {(a, b) for a, b in itertools.combinations(values, 2) if a[0] != b[0]}
    marked = [v for v in values if features[v[0]].triples]
    triples = {
        t
        for t in itertools.combinations(marked, 3)
        if len({f for f, _ in t}) == 3 and sum(f in DEGREES for f, _ in t) < 3
    }
    return pairs | triples


@dataclass
class Design:
    layouts: list[Layout] = field(default_factory=list)
    refused: dict[tuple, str] = field(default_factory=dict)  # pair or triple -> the preflight's line
    features: Mapping[str, Feature] = field(default_factory=lambda: FEATURES)


def held(design: Design) -> set[tuple]:
    """The targets the design's layouts hold."""
    return set().union(*(lay.targets() for lay in design.layouts)) & all_targets(design.features)


def unaccounted(design: Design) -> set[tuple]:
    """Targets neither held by a layout nor refused (alone or through one of their pairs)."""
    return {
        t
        for t in all_targets(design.features) - held(design) - set(design.refused)
        if not any(sub in design.refused for sub in itertools.combinations(t, 2))
    }


def build_design(
    corpus: str,
    *,
    seed: int = 0,
    candidates: int = 40,
    table: Mapping[str, Feature] = FEATURES,
    configure: Configure = text_config,
) -> Design:
    """The covering design (module docstring): accepted layouts that hold every pair that can be
    held; ``table`` and ``configure``: another sweep's features and configs (the text sweep's by default)."""
    rng = random.Random(seed)
    cache: dict[Layout, str | None] = {}

    def refused(layout: Layout) -> str | None:
        if layout not in cache:
            cache[layout] = refusal(layout, corpus, configure)
        return cache[layout]

    todo, design = all_targets(table), Design(features=table)
    features = list(table)
    # A target refused alone (with its companions) is refused in every layout: shown, not run;
    # a triple is only tried once none of its pairs is refused.
    for target in sorted(todo, key=len):
        if any(sub in design.refused for sub in itertools.combinations(target, 2)) and len(target) == 3:
            continue
        whys = [refused(_complete(dict(target), dp, table)) for dp in ("dp_shard", "dp_replicate")]
        if all(whys):
            design.refused[target] = whys[0]
    todo -= set(design.refused)
    todo = {t for t in todo if not any(sub in design.refused for sub in itertools.combinations(t, 2))}
    while todo:
        best, gain = None, 0.0
        # Each candidate starts from an uncovered target and adds features at random, so that
        # every target is reached and the targets it adds are packed into few layouts.
        for start in rng.choices(sorted(todo), k=candidates):
            on = dict(start)
            for f in rng.sample(features, len(features)):
                if f not in on and rng.random() < 0.3:
                    on[f] = rng.choice(list(table[f].levels))
            layout = _complete(on, rng.choice(("dp_shard", "dp_replicate")), table)
            if layout.world > 4 or refused(layout):
                continue
            # Targets per unit of cost: a compiled layout costs about three plain ones (inductor
            # builds each block's kernels on every rank), so compile is packed into few layouts.
            g = len(layout.targets() & todo) / (3 if "compile" in on else 1)
            if g > gain:
                best, gain = layout, g
        if best is None:  # every candidate refused: the first uncovered target alone is accepted
            target = min(todo)
            best = next(
                lay for dp in ("dp_shard", "dp_replicate") if not refused(lay := _complete(dict(target), dp, table))
            )
        design.layouts.append(best)
        todo -= best.targets()
    return design


def train_each(runs: dict[str, list[str]], root: str) -> dict:
    """On each rank: train every run in turn in one process group; (losses, grad_norms) by run.
    Rank 0 also records each finished run in ``root/finished.jsonl``, so that after a failure the
    runs before it are kept and the one that failed is known."""
    import torch.distributed as dist

    import paratrain

    dist.init_process_group("gloo")
    out = {}
    try:
        for name, overrides in runs.items():
            out_dir = os.path.join(root, name)
            paratrain.train(paratrain.load_config(None, [*overrides, f"run.out_dir='{out_dir}'"]))
            if dist.get_rank() == 0:  # the one writer of metrics.jsonl
                with open(os.path.join(out_dir, "metrics.jsonl")) as f:
                    rows = [json.loads(line) for line in f]
                out[name] = ([r["loss"] for r in rows], [r["grad_norm"] for r in rows])
                with open(os.path.join(root, "finished.jsonl"), "a") as f:
                    f.write(json.dumps({name: out[name]}) + "\n")
    finally:
        dist.destroy_process_group()
    return out


def _first_error(message: str) -> str:
    """The line of a failed group's message that names the error (the last ``...Error:`` line)."""
    lines = [ln.strip() for ln in message.splitlines() if "Error" in ln and ":" in ln and "File " not in ln]
    return (lines[-1] if lines else message.strip().splitlines()[-1])[:300]


def _run_world(world: int, runs: dict[str, list[str]], root: str, timeout: float) -> dict:
    """Every run of one world size in one process group. When one fails, the runs that finished
    before it are kept, it stands with its error, and the group starts again after it."""
    from paratrain.testing.dist_utils import run_ranks

    out: dict = {}
    todo = dict(runs)
    while todo:
        finished = os.path.join(root, "finished.jsonl")
        if os.path.exists(finished):
            os.remove(finished)
        try:
            out.update(run_ranks(train_each, world, todo, root, timeout=timeout)[0])
            return out
        except AssertionError as e:
            done = {}
            if os.path.exists(finished):
                with open(finished) as f:
                    for line in f:
                        done.update(json.loads(line))
            out.update(done)
            failed = next(name for name in todo if name not in done)
            out[failed] = _first_error(str(e))
            print(f"world {world}: {failed} failed: {out[failed]}", flush=True)
            todo = {k: v for k, v in todo.items() if k not in out}
    return out


def run_layouts(
    layouts: list[Layout],
    corpus: str,
    root: str,
    *,
    timeout: float = 1800,
    configure: Configure = text_config,
    global_batch: int = GLOBAL_BATCH,
    loss_tolerance: float | None = None,
) -> dict[Layout, dict]:
    """Each layout and its one-process reference; per layout the largest relative differences
    of loss and grad_norm from the reference, and whether they are within its tolerance (or the
    error it ended with). ``timeout``: per process group, below the calling test's own, so that a
    hang reports the stacks of every rank instead of pytest's bare timeout. ``configure``,
    ``global_batch``: another sweep's configs; ``loss_tolerance``: the loss's own bound (by
    default the layout's tolerance, as grad_norm's)."""
    references = sorted({lay.reference() for lay in layouts}, key=lambda lay: lay.name)
    one = {f"ref-{r.name}": [*configure(corpus, r), f"batch.micro_batch_size={global_batch}"] for r in references}
    results = _run_world(1, one, root, timeout)
    by_world: dict[int, dict[str, list[str]]] = {}
    for lay in layouts:
        by_world.setdefault(lay.world, {})[lay.name] = configure(corpus, lay)
    for world, runs in sorted(by_world.items()):
        results.update(_run_world(world, runs, root, timeout))
    out = {}
    for lay in layouts:
        got, ref = results[lay.name], results[f"ref-{lay.reference().name}"]
        if isinstance(got, str):
            out[lay] = {"loss": float("nan"), "grad_norm": float("nan"), "ok": False, "error": got}
            continue
        d_loss = max(abs(a - b) / abs(b) for a, b in zip(got[0], ref[0]))
        d_norm = max(abs(a - b) / abs(b) for a, b in zip(got[1], ref[1]))
        ok = max(d_loss, d_norm) <= lay.tolerance()
        if loss_tolerance is not None:
            ok = d_loss <= loss_tolerance and d_norm <= lay.tolerance()
        out[lay] = {"loss": d_loss, "grad_norm": d_norm, "ok": ok}
    return out


def render(design: Design, results: dict[Layout, dict], *, seed: int, seconds: float) -> str:
    """docs/combinations.md: the layouts run, their differences from one process, the refused pairs."""
    wrong = [lay for lay, r in results.items() if not r["ok"]]
    lines = [
        "# The combination sweep",
        "",
        "<!-- Written by `python -m paratrain.testing.sweep` (src/paratrain/testing/sweep.py); do not edit by hand. -->",
        "",
        f"Every pair of the features of [support.md](support.md) at every level, on a 4-block GPT,"
        f" {STEPS} plain-SGD steps of a global batch of {GLOBAL_BATCH} sequences, at most 4 gloo ranks"
        f" on CPU: {len(design.layouts)} layouts hold {len(held(design))} pairs and triples; {len(design.refused)}"
        f" are refused by the preflight (and the triples that hold a refused pair with them); {len(wrong)}"
        f" layouts found wrong. Seed {seed}, {seconds:.0f} s on a 2-core machine.",
        "",
        "Pairs: every two features, at every level. Triples: every three of the features marked for"
        " them in support.md (parallel degrees, loss options, objectives), but for three parallel"
        " degrees together, which need 8 ranks.",
        "",
        "Each layout is compared with one process training the same model and data (the features",
        "marked *math* in support.md), one micro-batch of the whole global batch: the largest",
        "relative difference over the steps, of the loss and of `grad_norm`.",
        "",
        "| layout | ranks | loss | grad_norm | tolerance | |",
        "|---|---|---|---|---|---|",
    ]
    for lay, r in results.items():
        levels = ", ".join(f"{f}={lv}" for f, lv in lay.levels)
        mark = "ok" if r["ok"] else f"**wrong** {r.get('error', '')}".strip()
        lines.append(
            f"| {levels} | {lay.world} | {r['loss']:.1e} | {r['grad_norm']:.1e} | {lay.tolerance():g} | {mark} |"
        )
    lines += ["", "| refused together | the preflight's line |", "|---|---|"]
    for target, why in design.refused.items():
        lines.append(f"| {' + '.join(f'{f}={lv}' for f, lv in target)} | {why} |")
    return "\n".join(lines) + "\n"


DESIGN_FILE = os.path.join(ROOT, "tests", "distributed", "sweep_design.json")


def save_design(design: Design, path: str = DESIGN_FILE, *, seed: int) -> None:
    data = {
        "seed": seed,
        "layouts": [[list(kv) for kv in lay.levels] for lay in design.layouts],
        "refused": [[[list(kv) for kv in target], why] for target, why in design.refused.items()],
    }
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def load_design(path: str = DESIGN_FILE, table: Mapping[str, Feature] = FEATURES) -> Design:
    with open(path) as f:
        data = json.load(f)
    return Design(
        layouts=[Layout(tuple(tuple(kv) for kv in lay), table) for lay in data["layouts"]],
        refused={tuple(tuple(kv) for kv in target): why for target, why in data["refused"]},
        features=table,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paratrain.testing.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="the seed of the design's candidates")
    p.add_argument("--design-only", action="store_true", help="write tests/distributed/sweep_design.json and stop")
    p.add_argument(
        "--stored",
        action="store_true",
        help="run tests/distributed/sweep_design.json as stored (what the slow tier runs), no rebuild",
    )
    p.add_argument("--write", default=os.path.join(ROOT, "docs", "combinations.md"), help="the table's path")
    args = p.parse_args(argv)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = make_corpus(os.path.join(tmp, "corpus"))
        if args.stored:
            with open(DESIGN_FILE) as f:
                args.seed = json.load(f)["seed"]
            design = load_design()
        else:
            design = build_design(corpus, seed=args.seed)
            save_design(design, seed=args.seed)
        print(f"{len(design.layouts)} layouts, {len(design.refused)} refused combinations: {DESIGN_FILE}", flush=True)
        if args.design_only:
            return 0
        results = run_layouts(design.layouts, corpus, tmp)
    with open(args.write, "w") as f:
        f.write(render(design, results, seed=args.seed, seconds=time.monotonic() - start))
    print(f"wrote {args.write}")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
