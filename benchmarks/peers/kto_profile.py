"""Where a KTO step's time goes (issue 58): one process on one rank's share of ``vs_trl_kto.py``'s
step (its model, examples and reference; micro-batch 4 x accumulation 2 = 8 examples, CPU, float32,
one thread), wall-clock timers around the step's parts, averaged over the steps (the first one
included): the reference's forward, the policy's no-graph KL pass, the training forward with the
loss, the backward, clip and optimiser. The machine's load moves the milliseconds; the shares are
the result.

    PYTHONPATH=src python benchmarks/peers/kto_profile.py [--steps 12]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="optimiser steps")
    args = p.parse_args()
    spec = importlib.util.spec_from_file_location("vs_trl_kto", os.path.join(HERE, "vs_trl_kto.py"))
    kto = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kto)
    import torch

    from paratrain import step
    from paratrain.objectives.preference import PreferenceLoss

    took = collections.Counter()

    def timed(owner, name: str, label: str) -> None:
        f = getattr(owner, name)

        def g(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                took[label] += time.perf_counter() - t

        setattr(owner, name, g)

    timed(PreferenceLoss, "before_micro_batches", "reference + KL pass")
    # _kl_terms: the KL pass's forwards since micro-batch 0's KL terms come from its training forward
    kl = "_kl_terms" if hasattr(PreferenceLoss, "_kl_terms") else "_kl"
    timed(PreferenceLoss, kl, "KL pass (policy, no graph)")
    timed(step, "forward_backward", "forward + loss + backward")
    timed(torch.Tensor, "backward", "backward")
    timed(step, "finish_step", "clip + optimiser")
    timed(step, "train_step", "step")
    torch.set_num_threads(1)
    from paratrain.launch.worker import main as worker  # after the timers: the trainer imports train_step by name

    ns = argparse.Namespace(examples=64, hidden=128, layers=2, policy_seed=0, ref_seed=1, steps=args.steps, batch=8)
    with tempfile.TemporaryDirectory() as tmp:
        paths = kto.build(tmp, ns, kto.peer_env(inherit_pythonpath=True))
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(29400 + os.getpid() % 500)
        out = os.path.join(tmp, "run")
        sets = kto.optim_sets(1e-4) + [
            f"model.hf='{paths['policy']}'",
            "data.name='tokens'",
            f"data.args={{path = '{paths['corpus_pairs_timing']}', block_size = {paths['block']}}}",
            "loss.name='preference'",
            "preference.loss_type='kto'",
            f"preference.beta={kto.BETA}",
            f"preference.reference='{paths['ref']}'",
            "batch.global_batch_size=8",
            "batch.micro_batch_size=4",
            f"run.steps={args.steps}",
            "run.progress=false",
            "run.save_model=false",
            "metrics.plot=false",
            f"run.out_dir='{out}'",
        ]
        config = os.path.join(tmp, "empty.toml")
        open(config, "w").close()
        worker([config] + [a for s in sets for a in ("--set", s)])
        with open(os.path.join(out, "metrics.jsonl")) as f:
            steps = len(f.readlines())
    per = {k: v / steps * 1e3 for k, v in took.items()}
    parts = {
        "reference forward": per["reference + KL pass"] - per.get("KL pass (policy, no graph)", 0.0),
        "KL pass (policy, no graph)": per.get("KL pass (policy, no graph)", 0.0),
        "training forward + loss": per["forward + loss + backward"] - per["backward"],
        "backward": per["backward"],
        "clip + optimiser": per["clip + optimiser"],
    }
    print(f"{steps} steps of 8 examples (micro 4 x accumulation 2), world 1; ms per step (share of the step):")
    for name, ms in parts.items():
        print(f"  {name:28s} {ms:7.1f}  {ms / per['step']:4.0%}")
    print(f"  {'step':28s} {per['step']:7.1f}")
    print(json.dumps({k: round(v, 1) for k, v in parts.items()}))


if __name__ == "__main__":
    main()
