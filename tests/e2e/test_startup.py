"""Start-up: ``paratrain train``'s launcher imports none of the parallelisms before it starts the workers.

The launcher parses the config, runs the preflight and starts torchrun's agent; the workers
import what training needs. torch.distributed's checkpoint (DCP), FSDP2, DTensor, pipelining
and dynamo took about 1.8 s of the launcher's start (benchmarks/peers/startup_vs_trl.py, docs/sft.md
"Start-up against TRL"): the preflight's checks now live in light modules
(distributed/layout_checks.py, checkpoint/manifest.py) and the modules the preflight reads
through the models import DTensor and FSDP2 in the functions that use them. No timing here: the
test names the modules, so an import that brings one back fails it, whatever the machine's load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
