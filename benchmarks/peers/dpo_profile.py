"""Where a DPO step's time goes, paratrain against TRL's ``DPOTrainer`` (issue 58): one process each
under cProfile, on the model, pairs and micro-batch of ``vs_trl_dpo.py`` (micro 4 x accumulation 2
= 8 pairs a step, world 1, CPU, float32, one thread), and the work each computes, counted.

Prints, per tool, the seconds summed over the steps (the first one included) of: the policy's
forward with the loss, the backward, the reference's forward, data and collation, gradient
reduce/clip/optimiser, logging; and per pair over 200 micro-batches drawn as ``pair_positions``
draws them: real tokens, target tokens, positions computed (padding included) and attention
scores computed (paratrain: one packed row ``[chosen | rejected | pad]`` of width W, W^2; TRL: two
rows of the micro-batch's longest side S, 2 S^2). cProfile inflates Python-heavy code and the
machine's load moves the seconds; the shares and the counts are the result.

    python benchmarks/peers/dpo_profile.py [--steps 12]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pstats
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# paratrain's worker in this process (the launcher's exit skips cProfile's own dump).
WORKER = (
    "import cProfile, os, sys; from paratrain.launch.worker import main; p = cProfile.Profile(); p.enable(); "
    "rc = main(sys.argv[2:]); p.disable(); p.dump_stats(sys.argv[1]); os._exit(rc or 0)"
)
PHASES = {  # (file, function) patterns whose cumulative time is the phase; '-' subtracts
    "paratrain": [
        ("policy forward + loss", ["step.py:forward_backward", "-_engine_run_backward"]),
        ("backward", ["_engine_run_backward"]),
        ("reference forward", ["preference.py:before_micro_batches"]),
        ("data + collation", ["loader.py:batches"]),
        ("reduce, clip, optimiser", ["step.py:finish_step"]),
        ("whole loop", ["trainer.py:loop"]),
    ],
    "TRL": [
        ("policy + reference forwards + loss", ["dpo_trainer.py:_compute_loss"]),
        ("backward", ["_engine_run_backward"]),
        ("data + collation", ["dataloader.py:__next__"]),
        ("clip + optimiser", ["trainer.py:_clip_grad_norm", "accelerate/optimizer.py:step"]),
        ("logging", ["trainer.py:_maybe_log_save_evaluate"]),
        ("whole loop", ["trainer.py:_inner_training_loop"]),
    ],
}


def load_dpo_script():
    spec = importlib.util.spec_from_file_location("vs_trl_dpo", os.path.join(HERE, "vs_trl_dpo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def seconds(prof: str, patterns: list[str]) -> float:
    stats = pstats.Stats(prof).stats
    total = 0.0
    for pat in patterns:
        sign, pat = (-1, pat[1:]) if pat.startswith("-") else (1, pat)
        where, _, fn = pat.rpartition(":")
        hits = [v[3] for (f, _, name), v in stats.items() if name == fn and f.endswith(where or f)]
        total += sign * max(hits, default=0.0)
    return total


def counts(paths: dict, micro: int) -> dict:
    from paratrain.data.tokens import build_tokens

    pairs = build_tokens(path=paths["corpus_pairs_timing"], block_size=paths["block"], pad_to=8)
    pick, n = random.Random(0), 0
    got = dict.fromkeys(["real", "targets", "paratrain_positions", "trl_positions", "paratrain_att", "trl_att"], 0)
    for _ in range(200):
        items = [pairs[i] for i in pick.sample(range(len(pairs)), micro)]
        width = pairs.collate(items)[0].shape[-1]
        sides = [[int((t[1] == s).sum()) for s in (0, 1)] for _, t in items]
        longest = max(max(s) for s in sides) + 1  # TRL's reply holds the "\n" after <|im_end|> too
        for (c, r), (_, t) in zip(sides, items):
            n += 1
            got["real"] += c + r
            got["targets"] += int((t[0] >= 0).sum())
            got["paratrain_positions"] += width
            got["paratrain_att"] += width * width
            got["trl_positions"] += 2 * longest
            got["trl_att"] += 2 * longest * longest
    return {k: v / n for k, v in got.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="optimiser steps each tool runs")
    args = p.parse_args()
    dpo = load_dpo_script()
    ns = argparse.Namespace(
        procs=1, batch=8, micro=4, device="cpu", bf16=False, qwen_05b=False, lora=False, pairs=64, hidden=128
    )
    ns.layers, ns.lr, ns.steps = 2, 1e-4, args.steps
    env = dpo.peer_env(inherit_pythonpath=True, hub_kernels_off=True)
    one = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    with tempfile.TemporaryDirectory() as tmp:
        profs = {"paratrain": os.path.join(tmp, "paratrain.prof"), "TRL": os.path.join(tmp, "trl.prof")}

        def run(cmd: list[str], env2: dict) -> None:  # each tool's one process under cProfile, no launcher
            e = {**env2, **one, "MASTER_PORT": str(29400 + os.getpid() % 500), "OMP_NUM_THREADS": "1"}
            if "train" in cmd:  # paratrain train CONFIG --nproc-per-node 1 --set ...
                rest = cmd[cmd.index("train") + 1 :]
                i = rest.index("--nproc-per-node")
                cmd = [sys.executable, "-c", WORKER, profs["paratrain"], *rest[:i], *rest[i + 2 :]]
            else:  # torchrun ... vs_trl_dpo.py --worker ...
                script = next(k for k, a in enumerate(cmd) if a.endswith(".py"))
                cmd = [sys.executable, "-m", "cProfile", "-o", profs["TRL"], *cmd[script:]]
            subprocess.run(cmd, env=e, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        paths = dpo.build(tmp, ns, env)
        dpo.run = run
        dpo.run_paratrain(paths, paths["corpus_pairs_timing"], os.path.join(tmp, "p"), 8, 4, args.steps, ns, env)
        dpo.run_trl(paths, paths["pairs_timing"], os.path.join(tmp, "t"), 8, 4, args.steps, ns, env)
        print(f"{args.steps} steps of 8 pairs (micro 4 x accumulation 2), world 1, cProfile; seconds summed:")
        for tool, phases in PHASES.items():
            whole = seconds(profs[tool], phases[-1][1])
            cells = [
                f"{name} {seconds(profs[tool], pats):.2f} ({seconds(profs[tool], pats) / whole:.0%})"
                for name, pats in phases[:-1]
            ]
            print(f"  {tool}: loop {whole:.2f}; " + "; ".join(cells))
        c = counts(paths, 4)
        print(f"per pair: real tokens {c['real']:.1f}, target tokens {c['targets']:.1f}")
        for tool in ("paratrain", "trl"):
            print(f"  {tool}: positions {c[tool + '_positions']:.1f}, attention scores {c[tool + '_att']:.0f}")


if __name__ == "__main__":
    main()
