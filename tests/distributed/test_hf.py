"""transformers causal LMs (``[model] hf = DIR``) on every layout against the one-process run.

Three architectures (src/paratrain/testing/hf_models.py): Llama, Qwen2 (grouped-query attention, q/k/v biases) and
Qwen3 (tied embeddings, per-head q/k norms). Each run loads the directory's sharded safetensors
weights after the parallelisms (every rank its own shards) and trains 3 steps of plain SGD, so
the losses, the logged grad_norm and the final weights must match the reference to 1e-4.
Layouts of one world size share one set of spawned processes.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from paratrain.testing.dist_utils import plain_sgd, read_metrics, run_ranks, train_layouts
from paratrain.testing.hf_models import ARCHS, save_tiny

pytest.importorskip("transformers")
# The module's fixture trains 21 runs in three process groups before the first assertion.
pytestmark = pytest.mark.timeout(1200)

BASE = [
    "data.factory='paratrain.testing.toy:toy_lm'",
    "data.args={n = 64, seq_len = 16, vocab = 128}",
    "batch.global_batch_size=8",
    "run.steps=3",
    "run.progress=false",
    "metrics.plot=false",
    *plain_sgd(0.5),
]


def arch_runs(arch: str, root: str) -> tuple[dict, dict, dict]:
    model = [*BASE, f"model.hf='{root}/{arch}'"]
    world1 = {f"{arch}_ref": [*model, "batch.micro_batch_size=2"]}
    world2 = {
        f"{arch}_ddp": [*model, "parallel.dp_replicate=2", "batch.micro_batch_size=2"],
        f"{arch}_fsdp": [*model, "parallel.dp_shard=2", "batch.micro_batch_size=2"],
        f"{arch}_tp": [*model, "parallel.tp=2", "batch.micro_batch_size=2"],
    }
    if not ARCHS[arch].get("tie_word_embeddings"):  # tied embeddings cannot be split across stages
        world2[f"{arch}_pp_gpipe"] = [
            *model,
            "parallel.pp=2",
            "parallel.pp_schedule='gpipe'",
            "batch.micro_batch_size=4",
        ]
        world2[f"{arch}_pp_1f1b"] = [*model, "parallel.pp=2", "parallel.pp_schedule='1f1b'", "batch.micro_batch_size=4"]
    world4 = {
        f"{arch}_fsdp_tp_ac": [
            *model,
            "parallel.dp_shard=2",
            "parallel.tp=2",
            "parallel.activation_checkpointing='full'",
            "batch.micro_batch_size=2",
        ]
    }
    if not ARCHS[arch].get("tie_word_embeddings"):
        world4[f"{arch}_pp_tp"] = [*model, "parallel.pp=2", "parallel.tp=2", "batch.micro_batch_size=4"]
    return world1, world2, world4


def run_world(world: int, runs: dict, root: str) -> dict:
    per_rank = run_ranks(train_layouts, world, runs, root, timeout=900)
    for other in per_rank[1:]:
        assert other == per_rank[0]
    return {
        name: (
            per_rank[0][name],
            load_file(os.path.join(root, name, "model.safetensors")),
            [row["grad_norm"] for row in read_metrics(os.path.join(root, name))],
        )
        for name in runs
    }


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for arch in ARCHS:
        save_tiny(arch, str(root / arch))
    return str(root)


@pytest.fixture(scope="module")
def layouts(hf_root):
    worlds = {1: {}, 2: {}, 4: {}}
    for arch in ARCHS:
        for world, runs in zip((1, 2, 4), arch_runs(arch, hf_root)):
            worlds[world].update(runs)
    out = {}
    for world, runs in worlds.items():
        out.update(run_world(world, runs, os.path.join(hf_root, f"world{world}")))
    return out


def assert_matches(got, ref):
    losses, params, grad_norms = got
    ref_losses, ref_params, ref_grad_norms = ref
    assert len(losses) == len(ref_losses) == 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor(grad_norms), torch.tensor(ref_grad_norms), rtol=1e-4, atol=0)
    assert params.keys() == ref_params.keys()
    for k in ref_params:
        torch.testing.assert_close(params[k], ref_params[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")


LAYOUTS = [name for arch in ARCHS for runs in arch_runs(arch, "")[1:] for name in runs]


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_process(layouts, name):
    assert_matches(layouts[name], layouts[name.split("_")[0] + "_ref"])
