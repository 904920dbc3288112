"""DPO's reference model run at every step against ``preference.precompute = true``: step time,
the one-off precompute, memory per rank, and the store's reuse; world 2 on CPU (gloo).

Both arms: ``paratrain train --nproc-per-node 2`` with ``parallel.dp_replicate = 2``, DPO
``sigmoid`` (beta 0.1), a random Qwen2 policy (seed 0) and a random Qwen2 reference of the same
shape in another directory (seed 1, ``preference.reference = DIR``; ``src/paratrain/testing/hf_models.py``),
hidden ``--hidden`` (4x in the MLP), ``--layers`` layers; the conversational pairs of
``src/paratrain/testing/sft_data.py: preference_pairs`` (distinct pairs, as many as 1.2 x the run's steps x
global batch, so one epoch holds every step: the precompute runs a forward per row of the
corpus, repeats included), one pair per row of ``block_size`` (the longest pair rounded up to
64), global batch ``--batch`` pairs (``--micro`` per micro-batch per process, accumulation filling
the rest), AdamW (lr ``--lr``, betas (0.9, 0.95), eps 1e-8, no decay, no warmup, constant,
clipped to 1.0), float32, ``metrics.rank_stats_every = 1`` (every row then carries each rank's
memory; at the default 50 a short run's rows carry rank 0's alone). The arms differ in one thing:

- per-step: the reference runs a forward over the step's pairs at every step, before the
  micro-batch loop, and stays in memory;
- precomputed: ``preference.precompute = true`` with a fresh ``preference.store`` per run, so every
  run computes every pair once before the first step, then drops the reference model and looks
  its numbers up.

Measured per run: the step time (the median difference of consecutive metrics rows' ``time``
after the first ``WARMUP`` steps, ``vs_trl_dpo.py``'s ``steady``); the whole run's wall time
(launch to exit, loading and the precompute included) and the time from the workers' ``train``
call to the end of the first step (``events.jsonl``); the precompute's own time from rank 0's line
``preference: reference of N pair(s) computed in X s, M found in PATH``; memory per rank three
ways: paratrain's ``memory_gib`` (on CPU: the process's resident set at the end of each step, not
a peak; its max, and its median after the warm-up), and the kernel's peak resident set of each
rank's process over its whole life (``VmHWM`` in ``/proc/PID/status``, polled every 0.1 s; the
rank's pid from ``events.jsonl``) and of the whole process tree (``wait4``'s ``ru_maxrss``).
Runs alternate (per-step, precomputed, precomputed, per-step, ...); each round's ratio
precomputed/per-step is the observation, summarised by ``paired.summary_line`` (median ratio, 95%
CI of the geometric mean). Fairness: both arms must log the same losses and ``grad_norm`` at every
step (1e-6 relative; checked, the maximum printed). Last, a run with the last round's store
again: it must compute 0 pairs and log the same losses. Results: ``preference_reference.json``.

Measured (transformers 5.25, torch 2.13 CPU; defaults: 58 pairs, longest 325 tokens, rows of 384,
policy and reference hidden 512 x 4 layers, 61.1 MiB of float32 weights each, global batch 8 = 2 x
2 x 2, 6 rounds of 6 steps, 10.8 minutes; this 2-core machine shared with another job's tests,
load 4.9 to 5.9):

- step time: per-step reference 4931 ms, precomputed 3753 ms (medians); ratio precomputed/per-step
  median 0.846, geometric mean 0.835, 95% CI [0.714, 0.977]: precomputing saves about 1.2 s, 15%
  of the step (CI 2% to 29%; by FLOPs the reference's forward is a quarter of the per-step arm's
  work, against the policy's forward and backward).
- the precompute of the 58 pairs: median 11.5 s (9.3 to 14.0), about 10 steps' saving; worker
  start to the end of the first step 8.6 s per-step, 21.1 s precomputed (medians); whole 6-step
  runs 45.1 s and 53.2 s, ratio median 1.220, 95% CI [1.071, 1.365]: for a run this short the
  precompute costs more than it saves; it pays back after about 10 steps (1.4 epochs here), or at
  once when the store is reused.
- memory per rank (rank 0 / rank 1, medians over the rounds), per-step then precomputed:
  ``memory_gib`` max 1056/1054 and 980/993 MiB, after the warm-up 1021/1017 and 960/973 MiB; peak
  resident set (VmHWM) 1081/1096 and 1016/1019 MiB (65/77 MiB less: about the reference's 61 MiB of
  weights; VmHWM covers the precompute's phase too, when both models are loaded); the tree's
  largest process 1095 and 1023 MiB.
- same losses: per-step and precomputed losses and ``grad_norm`` equal bitwise (relative
  difference 0) at every step of every round.
- reuse: ``0 pair(s) computed in 0.0 s, 58 found`` (the line said "reused" then); whole run 41.3 s; losses equal to the run
  that filled the store.

    python benchmarks/memory/preference_reference.py           # 6 rounds of 6 steps, then the reuse run
    python benchmarks/memory/preference_reference.py --quick   # 1 round of 4 steps and the reuse run, no JSON
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from paratrain.testing.paired import ratio_ci, summary_line
from paratrain.testing.peers import BETA, WARMUP, longest_pair, optim_sets, run, script_parser, steady

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preference_reference.json")
MIB = 1024**2
# rank 0's line after the precompute (build.py precompute_reference)
PRECOMPUTED = re.compile(
    r"preference: reference of (\d+) (?:pair|row)\(s\) computed in ([\d.]+) s, (\d+) found in (\S+)"
)


# ----------------------------------------------------------------------------- one run, watched


def proc_status(pid: int) -> dict[str, int]:
    """VmHWM (peak resident set) and VmRSS of a live process, in bytes ({} once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmHWM", "VmRSS")))
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, v in fields.items()}


def watched(cmd: list[str], env: dict, every: float = 0.1) -> dict:
    """Run ``cmd`` to its end: its wall time, its output, each descendant's last-seen peak
    resident set (``VmHWM``, polled every ``every`` s: it only grows, so the last reading before
    the process ends is its peak up to then) and the largest peak of the whole tree from the
    kernel (``wait4``'s ``ru_maxrss``: the process and every descendant it waited for)."""
    from paratrain.testing.dist_utils import descendants  # the process tree, from /proc

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        hwm: dict[int, int] = {}
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            for p in descendants(proc.pid):
                seen = proc_status(p).get("VmHWM")
                if seen:
                    hwm[p] = max(hwm.get(p, 0), seen)
            time.sleep(every)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n{stderr[-3000:]}")
    return {"wall_s": wall, "stdout": stdout, "stderr": stderr, "hwm": hwm, "tree_maxrss": usage.ru_maxrss * 1024}


def run_paratrain(paths: dict, out: str, args, env: dict, *, store: str | None) -> dict:
    """One DPO run: the reference at every step (``store`` None) or precomputed into ``store``."""
    sets = [
        f"model.hf='{paths['policy']}'",
        "data.name='tokens'",
        f"data.args={{path = '{paths['corpus']}', block_size = {paths['block']}}}",
        "loss.name='preference'",
        "preference.loss_type='sigmoid'",
        f"preference.beta={BETA}",
        f"preference.reference='{paths['ref']}'",
        "parallel.dp_replicate=2",
        f"batch.global_batch_size={args.batch}",
        f"batch.micro_batch_size={args.micro}",
        f"run.steps={args.steps}",
        "run.progress=false",
        "run.save_model=false",
        "metrics.plot=false",
        "metrics.rank_stats_every=1",  # every row: each rank's memory (else rank 0's alone)
        *optim_sets(args.lr),
        f"run.out_dir='{out}'",
    ]
    if store is not None:
        sets += ["preference.precompute=true", f"preference.store='{store}'"]
    config = os.path.join(os.path.dirname(out), "empty.toml")  # every key comes from --set
    open(config, "w").close()
    cmd = [sys.executable, "-m", "paratrain", "train", config, "--nproc-per-node", "2"]
    got = watched(cmd + [arg for item in sets for arg in ("--set", item)], env)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(out, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    accum = args.batch // (2 * args.micro)
    bad = [
        r
        for r in rows
        if (r["world_size"], r["global_batch_size"], r["micro_batch_size"], r["accum_steps"], r["items"])
        != (2, args.batch, args.micro, accum, args.batch)
    ]
    if len(rows) != args.steps or bad or any(len(r.get("rank_memory_gib", [])) != 2 for r in rows):
        raise SystemExit(f"paratrain logged {len(rows)} steps, not {args.steps}, or other world/batch: {bad[:1]}")
    lines = PRECOMPUTED.findall(got["stdout"] + got["stderr"])
    if (store is None) != (not lines) or len(lines) > 1:
        raise SystemExit(f"precompute lines {lines} in a run with store {store!r}")
    ranks = {e["pid"]: e["rank"] for e in events if e["event"] == "worker_start"}
    if sorted(ranks.values()) != [0, 1] or any(p not in got["hwm"] for p in ranks):
        raise SystemExit(f"workers {ranks}, watched {sorted(got['hwm'])}")
    start = min(e["time"] for e in events if e["event"] == "train_called")
    first = max(e["time"] for e in events if e["event"] == "first_step_done")
    per_rank = [[r["rank_memory_gib"][k] for r in rows] for k in (0, 1)]
    return {
        "step_s": steady([r["time"] for r in rows]),
        "losses": [r["loss"] for r in rows],
        "grad_norms": [r["grad_norm"] for r in rows],
        "wall_s": got["wall_s"],
        "train_called_to_first_step_s": first - start,
        "precompute": (
            {"computed": int(lines[0][0]), "seconds": float(lines[0][1]), "reused": int(lines[0][2])} if lines else None
        ),
        # paratrain's memory_gib on CPU: each rank's resident set at the end of each step
        "memory_gib_max": [max(m) for m in per_rank],
        "memory_gib_steady": [statistics.median(m[WARMUP:]) for m in per_rank],
        # the kernel's peak resident set of each rank's process over its whole life (polled VmHWM)
        "peak_rss_mib": [got["hwm"][p] / MIB for p, _ in sorted(ranks.items(), key=lambda kv: kv[1])],
        "tree_maxrss_mib": got["tree_maxrss"] / MIB,
    }


# ----------------------------------------------------------------------------- data


def build(tmp: str, args, env: dict) -> dict:
    """Tokenizer, distinct pairs (one epoch holds every step), the policy and reference, the corpus."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    from paratrain.testing.hf_models import save_tiny
    from paratrain.testing.sft_data import VOCAB, preference_pairs, save_chat_tokenizer, write_jsonl

    logging.disable_progress_bar()
    paths = {"tok": save_chat_tokenizer(os.path.join(tmp, "tok"))}
    # Distinct pairs, not repeats: the precompute runs a forward per row of the corpus.
    rows = preference_pairs(math.ceil(1.2 * args.steps * args.batch))
    h = args.hidden
    shape = dict(vocab_size=VOCAB, hidden_size=h, intermediate_size=4 * h, num_hidden_layers=args.layers)
    for name, seed in (("policy", 0), ("ref", 1)):
        paths[name] = save_tiny("qwen2", os.path.join(tmp, name), max_position_embeddings=1024, seed=seed, **shape)
    paths["model_mib"] = (
        sum(
            os.path.getsize(os.path.join(paths["ref"], f))
            for f in os.listdir(paths["ref"])
            if f.endswith(".safetensors")
        )
        / MIB
    )
    tok = AutoTokenizer.from_pretrained(paths["tok"])
    longest = longest_pair(tok, rows)
    paths["block"] = 64 * math.ceil(longest / 64)
    paths["longest"], paths["pairs"] = longest, len(rows)
    data = write_jsonl(os.path.join(tmp, "pairs.jsonl"), rows)
    paths["corpus"] = os.path.join(tmp, "corpus")
    cmd = [sys.executable, "-m", "paratrain", "prepare", data, "--format", "preference", "--tokenizer", paths["tok"]]
    run(cmd + ["--out", paths["corpus"], "--val-fraction", "0"], env)
    return paths


def relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--rounds", type=int, default=6, help="paired rounds (per-step and precompute once each)")
    p.add_argument("--steps", type=int, default=6, help=f"optimiser steps per run; the first {WARMUP} are warm-up")
    p.add_argument("--batch", type=int, default=8, help="global batch, in pairs")
    p.add_argument("--micro", type=int, default=2, help="pairs per micro-batch per process")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (constant, no warmup)")
    p.add_argument("--hidden", type=int, default=512, help="the Qwen2s' hidden size (4x in the MLP)")
    p.add_argument("--layers", type=int, default=4, help="the Qwen2s' decoder layers")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round of 4 steps and the reuse run, no JSON")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, WARMUP + 2
    if args.steps <= WARMUP + 1:
        raise SystemExit(f"--steps must exceed {WARMUP + 1} (the first {WARMUP} are warm-up)")
    if args.batch % (2 * args.micro):
        raise SystemExit(f"--batch {args.batch} is not a multiple of 2 x --micro {args.micro}")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")]),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(tmp, args, env)
        accum = args.batch // (2 * args.micro)
        setup = (
            f"{paths['pairs']} distinct pairs (longest {paths['longest']} tokens, rows of {paths['block']}),"
            f" policy and reference Qwen2 hidden {args.hidden} x {args.layers} layers"
            f" ({paths['model_mib']:.1f} MiB of float32 weights each); global batch {args.batch} pairs ="
            f" 2 processes x micro {args.micro} x accumulation {accum}, {args.steps} steps per run"
        )
        print(setup, flush=True)
        got = {"step": [], "pre": []}
        for r in range(args.rounds):
            order = ("step", "pre") if r % 2 == 0 else ("pre", "step")
            for arm in order:
                out = os.path.join(tmp, f"{arm}{r}")
                store = os.path.join(tmp, f"store{r}") if arm == "pre" else None  # a fresh store: all computed
                got[arm].append(run_paratrain(paths, out, args, env, store=store))
            a, b = got["pre"][-1], got["step"][-1]
            print(
                f"round {r}: per-step reference {b['step_s'] * 1e3:.0f} ms/step, precomputed {a['step_s'] * 1e3:.0f}"
                f" (ratio {a['step_s'] / b['step_s']:.3f}); precompute of {a['precompute']['computed']} pairs"
                f" {a['precompute']['seconds']:.1f} s; whole runs {b['wall_s']:.1f} s and {a['wall_s']:.1f} s;"
                f" peak RSS per rank {'/'.join(f'{x:.0f}' for x in b['peak_rss_mib'])} and"
                f" {'/'.join(f'{x:.0f}' for x in a['peak_rss_mib'])} MiB; load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        # The store of the last round again: every pair is found, none computed.
        store = os.path.join(tmp, f"store{args.rounds - 1}")
        reuse = run_paratrain(paths, os.path.join(tmp, "reuse"), args, env, store=store)
    step, pre = got["step"], got["pre"]
    ratios = [a["step_s"] / b["step_s"] for a, b in zip(pre, step)]
    wall_ratios = [a["wall_s"] / b["wall_s"] for a, b in zip(pre, step)]
    loss_rel = max(relative(a["losses"], b["losses"]) for a, b in zip(pre, step))
    norm_rel = max(relative(a["grad_norms"], b["grad_norms"]) for a, b in zip(pre, step))
    reuse_rel = relative(reuse["losses"], pre[-1]["losses"])

    def med(arm: list[dict], key: str, k: int | None = None) -> float:
        return statistics.median(x[key] if k is None else x[key][k] for x in arm)

    print(
        f"step time: per-step reference {med(step, 'step_s') * 1e3:.0f} ms, precomputed {med(pre, 'step_s') * 1e3:.0f} ms"
    )
    print(summary_line("step time precomputed/per-step", ratios))
    print(
        f"precompute of {pre[0]['precompute']['computed']} pairs: median"
        f" {statistics.median(a['precompute']['seconds'] for a in pre):.1f} s"
        f" (per run: {', '.join(format(a['precompute']['seconds'], '.1f') for a in pre)})"
    )
    print(
        f"whole run (launch to exit): per-step {med(step, 'wall_s'):.1f} s, precomputed {med(pre, 'wall_s'):.1f} s;"
        f" worker start to first step done: {med(step, 'train_called_to_first_step_s'):.1f} s and"
        f" {med(pre, 'train_called_to_first_step_s'):.1f} s"
    )
    print(summary_line("whole run precomputed/per-step", wall_ratios))
    for name, key in (
        ("paratrain memory_gib at step ends, max (MiB)", "memory_gib_max"),
        ("paratrain memory_gib at step ends, steady median (MiB)", "memory_gib_steady"),
        ("peak RSS (VmHWM) of the process's life (MiB)", "peak_rss_mib"),
    ):
        scale = 1024 if "gib" in key else 1
        print(
            f"{name}: per-step rank 0/1 {med(step, key, 0) * scale:.0f}/{med(step, key, 1) * scale:.0f},"
            f" precomputed {med(pre, key, 0) * scale:.0f}/{med(pre, key, 1) * scale:.0f}"
        )
    print(
        f"largest process of the tree (wait4 ru_maxrss): {med(step, 'tree_maxrss_mib'):.0f} and {med(pre, 'tree_maxrss_mib'):.0f} MiB"
    )
    print(
        f"same losses: max relative difference per-step vs precomputed, every step of every round: loss {loss_rel:.1e},"
        f" grad_norm {norm_rel:.1e}"
    )
    print(
        f"reuse: {reuse['precompute']['computed']} pair(s) computed, {reuse['precompute']['reused']} reused in"
        f" {reuse['precompute']['seconds']:.1f} s; whole run {reuse['wall_s']:.1f} s; losses vs the run that filled"
        f" the store: {reuse_rel:.1e}"
    )
    if max(loss_rel, norm_rel, reuse_rel) > 1e-6 or reuse["precompute"]["computed"]:
        raise SystemExit("the arms' losses differ, or the reuse run computed pairs: the comparison is void")
    if args.quick:
        print("--quick: results not written")
        return
    gmean, lo, hi = ratio_ci(ratios)
    wg, wlo, whi = ratio_ci(wall_ratios)
    import torch
    import transformers

    result = {
        "command": " ".join(["python", "benchmarks/memory/preference_reference.py", *sys.argv[1:]]),
        "setup": setup,
        "args": {k: v for k, v in vars(args).items() if k != "quick"},
        "block_size": paths["block"],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "per_step": step,
        "precomputed": pre,
        "reuse": reuse,
        "step_ratios": ratios,
        "step_ratio_median": statistics.median(ratios),
        "step_ratio_geometric_mean": gmean,
        "step_ratio_ci95": [lo, hi],
        "wall_ratios": wall_ratios,
        "wall_ratio_median": statistics.median(wall_ratios),
        "wall_ratio_ci95": [wlo, whi],
        "loss_max_relative": loss_rel,
        "grad_norm_max_relative": norm_rel,
        "reuse_loss_relative": reuse_rel,
    }
    with open(RESULT, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {os.path.relpath(RESULT, REPO)}")


if __name__ == "__main__":
    main()
