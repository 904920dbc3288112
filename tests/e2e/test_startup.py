"""Start-up: ``paratrain train``'s launcher imports none of the parallelisms before it starts the workers.

The launcher parses the config, runs the preflight and starts torchrun's agent; the workers
import what training needs. torch.distributed's checkpoint (DCP), FSDP2, DTensor, pipelining
and dynamo took about 1.8 s of the launcher's start (benchmarks/peers/startup_vs_trl.py, docs/sft.md
"Start-up against TRL"): the preflight's checks now live in light modules
(distributed/layout_checks.py, checkpoint/manifest.py) and the modules the preflight reads
through the models import DTensor and FSDP2 in the functions that use them. No timing here: the
test names the modules, so an import that brings one back fails it, whatever the machine's load.
A job of one process trains in the launcher's own process (launch/agent.py, run_here): the
worker's imports are then the launcher's, paid once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from paratrain.testing.dist_utils import REPO
from paratrain.testing.hf_models import save_tiny

# What the launcher must not import (each costs 0.1 to 1.5 s on a 2-core CPU; the workers import them).
HEAVY = (
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "torch._dynamo",
)
# `paratrain train ...` as a user runs it, up to the start of the workers: the launch itself is
# replaced by a report of the heavy modules loaded by then (the preflight, the trackers' and the
# out_dir's checks have run).
LAUNCHER = """
import json, sys
import paratrain.launch.agent as agent
from paratrain.cli import main

def launch(spec, module, module_args, *, job=None):
    loaded = [m for m in HEAVY if m in sys.modules]
    print(json.dumps({"module": module, "loaded": loaded, "modules": sorted(sys.modules)}))
    return 0

agent.launch = launch
HEAVY = json.loads(sys.argv[1])
sys.exit(main(sys.argv[2:]))
"""


def launcher_imports(*argv: str) -> tuple[list[str], list[str]]:
    """(the HEAVY modules loaded when the launcher starts the workers, every module loaded then)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO]), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", LAUNCHER, json.dumps(HEAVY), *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["module"] == "paratrain.launch.worker"
    return report["loaded"], report["modules"]


def test_the_launcher_of_a_gpt_run_imports_no_parallelism(tmp_path):
    argv = ("train", "configs/debug.toml", "--nproc-per-node", "2", "--set", f"run.out_dir='{tmp_path}'")
    loaded, modules = launcher_imports(*argv)
    assert "paratrain.preflight" in modules and "torch" in modules  # the preflight ran; torchrun's agent needs torch
    assert loaded == [], f"paratrain train's launcher imported {loaded}; keep them in the workers (module docstring)"


def test_the_launcher_of_an_hf_run_imports_no_parallelism(tmp_path):
    # The preflight reads the model's config.json through transformers' AutoConfig (which
    # imports none of them either) and the built-in models' specs.
    model = save_tiny("qwen2", str(tmp_path / "qwen2"), weights=False)
    loaded, modules = launcher_imports(
        "train",
        "configs/debug.toml",
        "--set",
        "model.name=''",
        "--set",
        f"model.hf='{model}'",
        "--set",
        "model.args={}",
        "--set",
        f"run.out_dir='{tmp_path / 'run'}'",
    )
    assert "transformers.models.qwen2.configuration_qwen2" in modules  # the preflight read the model's config
    assert loaded == [], f"paratrain train's launcher imported {loaded}; keep them in the workers (module docstring)"


def test_a_one_process_job_trains_in_the_launchers_own_process(tmp_path, monkeypatch):
    """One process on one node: the worker's main runs in the launcher (no second interpreter
    importing torch and transformers again), as rank 0 of a world of one with no MASTER_ADDR (a
    shell's or a scheduler's never reaches it: the lone process needs no port), and the launcher's
    environment is as it was afterwards."""
    import paratrain.launch.worker as worker
    from paratrain.cli import main

    seen = []

    def train(cfg):
        seen.append((os.getpid(), {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}))
        return {}

    monkeypatch.setattr(worker, "train", train)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    before = dict(os.environ)
    config = os.path.join(REPO, "configs", "debug.toml")
    assert main(["train", config, "--set", f"run.out_dir='{tmp_path}'"]) == 0
    assert seen == [(os.getpid(), {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": None})]
    assert dict(os.environ) == before
    # Restarts are the agent's: with --max-restarts the worker is a process of its own again.
    monkeypatch.setattr("paratrain.launch.agent._launch", lambda *a, **k: seen.append("agent") or 0)
    assert main(["train", config, "--max-restarts", "1", "--set", f"run.out_dir='{tmp_path}'"]) == 0
    assert seen[-1] == "agent"


@pytest.mark.slow  # two runs of the debug config
def test_the_launchers_own_process_trains_what_a_worker_process_trains(tmp_path):
    """The same 3 steps in the launcher's process and in a worker started by torchrun's agent
    (--max-restarts 1 keeps the agent): the same losses and grad_norms, bitwise."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO])}
    rows = []
    for name, extra in (("here", []), ("agent", ["--max-restarts", "1"])):
        out = tmp_path / name
        cmd = [sys.executable, "-m", "paratrain", "train", "configs/debug.toml", *extra]
        cmd += ["--set", "run.steps=3", "--set", "metrics.plot=false", "--set", f"run.out_dir='{out}'"]
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        with open(out / "metrics.jsonl") as f:
            rows.append([(r["loss"], r["grad_norm"]) for r in map(json.loads, f)])
    assert len(rows[0]) == 3 and rows[0] == rows[1], rows
