"""Mixtures of experts with context parallel and with ``train.compile`` (docs/moe.md, issue 24).

``model.hf`` MoE at cp = 2: each cp rank holds half of every sequence, so the router hook's
sequence-wise balance loss sums the expert counts over the cp ranks and each rank differentiates
its own tokens' share (models/hf/moe.py ``_router_stats``, as models/gpt/moe.py does). Whole runs
against one process under plain SGD: loss, aux_loss, grad_norm, tokens per expert, final weights
(tests/distributed/test_moe_hf.py's comparison).

``train.compile = true``: the built-in GPT's MoE at ep = 2 and the ``model.hf`` MoE at ep = 1,
compiled per block with the token dispatch / the experts kept eager (distributed/expert_parallel.py
``dispatch``, models/hf/moe.py ``keep_experts_eager``), against eager one process: loss,
aux_loss, grad_norm (and tokens per expert, final weights) within 1e-5, and no graph compiled
after the first step (dynamo's ``unique_graphs`` counter read after each step), so nothing
recompiles per step on the routing's data-dependent sizes.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from paratrain.testing.dist_utils import plain_sgd, read_metrics, run_ranks
from paratrain.testing.hf_models import save_tiny
from paratrain.testing.moe_utils import HF_MOE_BASE, MOE_GPT, assert_same_moe_run, hf_moe_runs
from paratrain.testing.moe_utils import moe_runs as gpt_moe_runs

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """Tiny Qwen3-MoE (one sparse layer of two) and one process's run of it (micro-batch 8)."""
    tmp = tmp_path_factory.mktemp("moe_cp_qwen3")
    src = save_tiny("qwen3_moe", str(tmp / "src"))
    return src, hf_moe_runs(tmp, 1, src, {"ref": ["batch.micro_batch_size=8"]})["ref"]


@pytest.mark.slow
@pytest.mark.timeout(540)  # the fixture's run_ranks (240 s) and this one's (240 s)
def test_hf_moe_at_cp2_equals_one_process(tmp_path, qwen3_moe):
    """cp = 2 at world 2 (ring and all-to-all attention), causal rows: the same three SGD steps."""
    src, ref = qwen3_moe
    assert ref["aux_loss"][0] > 0 and ref["tokens"][0][0] != ref["tokens"][0][1]
    runs = hf_moe_runs(
        tmp_path,
        2,
        src,
        {
            "cp2_ring": ["parallel.cp=2", "parallel.cp_attention='ring'", "batch.micro_batch_size=4"],
            "cp2_alltoall": ["parallel.cp=2", "parallel.cp_attention='alltoall'", "batch.micro_batch_size=8"],
        },
    )
    for name, got in runs.items():
        try:
            assert_same_moe_run(got, ref, rtol=1e-5, atol_params=1e-6)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.slow
@pytest.mark.timeout(540)  # two run_ranks of 240 s
def test_packed_hf_moe_at_cp2_equals_one_process(tmp_path, sft):
    """Packed conversations (tests/distributed/test_sft.py's corpus, documents restarting their positions in
    each row: the ring's document masks) through a tiny Qwen3-MoE at cp = 2: two SGD steps equal
    one process. A packed row counts as one sequence of the balance loss, split over the cp ranks."""
    from paratrain.data.tokens import build_tokens
    from paratrain.testing.moe_utils import train_runs
    from paratrain.testing.sft import sft_config
    from paratrain.testing.sft_data import VOCAB

    model = save_tiny("qwen3_moe", str(tmp_path / "moe"), vocab_size=VOCAB, max_position_embeddings=512)
    rows = len(build_tokens(sft["train"], block_size=512))
    common = [f"batch.global_batch_size={rows}", f"batch.micro_batch_size={rows}", "run.steps=2"]

    def config(name: str, *extra: str) -> list[str]:
        return [*sft_config(sft, sft["train"], name, *common, *extra), f"model.hf='{model}'"]

    run_ranks(train_runs, 1, [config("packed_ref")])
    run_ranks(train_runs, 2, [config("packed_cp2", "parallel.cp=2")])
    ref, got = (read_metrics(f"{sft['root']}/{n}") for n in ("packed_ref", "packed_cp2"))
    assert ref[0]["aux_loss"] > 0
    for key in ("aux_loss", "loss", "grad_norm", "expert_tokens_min", "expert_tokens_max"):
        torch.testing.assert_close(
            torch.tensor([r[key] for r in got]),
            torch.tensor([r[key] for r in ref]),
            rtol=1e-5,
            atol=0,
            msg=lambda m, k=key: f"{k}: {m}",
        )


# ----------------------------------------------------------------------------- train.compile


def train_counting_graphs(runs: list[list[str]]) -> list[list[int]]:
    """Train each run on this gloo rank; per run, dynamo's count of graphs compiled so far after
    each step (the trainer's ``train_step`` wrapped in this spawned process only)."""
    import torch._dynamo
    import torch.distributed as dist

    import paratrain
    import paratrain.trainer as trainer

    step, graphs = trainer.train_step, []

    def counted(*args, **kwargs):
        out = step(*args, **kwargs)
        graphs[-1].append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        return out

    trainer.train_step = counted
    dist.init_process_group("gloo")
    try:
        for overrides in runs:
            graphs.append([])
            paratrain.train(paratrain.load_config(None, overrides))
    finally:
        dist.destroy_process_group()
    return graphs


def compiled_runs(tmp_path, world: int, base: list[str], runs: dict[str, list[str]], timeout: float) -> dict:
    """Each run's metrics and final weights (tests/distributed/test_moe_hf.py's ``moe_runs`` form) and every
    rank's per-step graph counts."""
    dirs = {name: tmp_path / name for name in runs}
    graphs = run_ranks(
        train_counting_graphs,
        world,
        [[*base, *extra, f"run.out_dir='{dirs[name]}'"] for name, extra in runs.items()],
        timeout=timeout,
    )
    out = {}
    for i, name in enumerate(runs):
        rows = read_metrics(str(dirs[name]))
        out[name] = {k: [r[k] for r in rows] for k in ("loss", "aux_loss", "grad_norm")}
        out[name]["tokens"] = [(r["expert_tokens_min"], r["expert_tokens_max"]) for r in rows]
        out[name]["params"] = load_file(str(dirs[name] / "model.safetensors"))
        out[name]["graphs"] = [per_rank[i] for per_rank in graphs]
    return out


def assert_compiled_once(graphs: list[list[int]], *, until_step: int = 1) -> None:
    """Graphs were compiled in the first step and none after step ``until_step`` (every rank)."""
    for rank, counts in enumerate(graphs):
        assert len(counts) > until_step, counts
        assert counts[0] > 0 and counts[-1] == counts[until_step - 1], f"rank {rank}: graphs after each step {counts}"


@pytest.mark.slow
@pytest.mark.timeout(840)  # run_ranks: the eager reference 240 s, the compiled run 540 s
def test_compiled_gpt_moe_at_ep2_equals_eager_one_process(tmp_path):
    """The GPT's MoE (two MoE blocks, a shared expert) compiled at ep = 2 borrowed from DDP 2:
    the all_to_all dispatch runs eagerly between the compiled parts of each block."""
    ref = gpt_moe_runs(tmp_path / "eager", 1, {"ref": ["batch.micro_batch_size=8"]})["ref"]
    got = compiled_runs(
        tmp_path,
        2,
        MOE_GPT,
        {"ep2": ["train.compile=true", "parallel.dp_replicate=2", "parallel.ep=2", "batch.micro_batch_size=4"]},
        timeout=540,
    )["ep2"]
    assert_same_moe_run(got, ref)
    assert_compiled_once(got["graphs"])


@pytest.mark.slow
@pytest.mark.timeout(840)  # run_ranks: the fixture's 240 s, then 270 s twice
def test_compiled_hf_moe_equals_eager_one_process(tmp_path, qwen3_moe):
    """Qwen3-MoE with train.compile = true at ep = 1, one process and DDP 2 (accumulation 2): the
    blocks compiled, transformers' experts eager inside them."""
    src, ref = qwen3_moe
    base = [*HF_MOE_BASE, f"model.hf='{src}'", "run.steps=3", *plain_sgd(0.5), "train.compile=true"]
    one = compiled_runs(tmp_path / "w1", 1, base, {"w1": ["batch.micro_batch_size=8"]}, timeout=270)["w1"]
    ddp = compiled_runs(
        tmp_path / "w2", 2, base, {"ddp": ["parallel.dp_replicate=2", "batch.micro_batch_size=2"]}, timeout=270
    )["ddp"]
    for name, got in (("one process", one), ("ddp", ddp)):
        try:
            assert_same_moe_run(got, ref, rtol=1e-5, atol_params=1e-6)
            # Graphs after each step [10, 11, 11]: one more graph at step 2, then none. Not a
            # recompile (TORCH_LOGS=recompiles names two, both in step 1: the decoder layer's
            # code seen again with a dense, then a sparse mlp), nor one per step.
            assert_compiled_once(got["graphs"], until_step=2)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_hf_experts_kept_eager_survive_a_deepcopy(tmp_path):
    """The experts' eager forward (``keep_experts_eager``) is bound to its module: a deepcopy (the
    pipeline split copies the model) runs the copy's weights, not the original's."""
    import copy

    from transformers import AutoConfig

    from paratrain.models.hf import causal_lm_from_config
    from paratrain.models.hf.model import HFCausalLM

    config = AutoConfig.from_pretrained(save_tiny("qwen3_moe", str(tmp_path / "moe"), weights=False))
    model = HFCausalLM(causal_lm_from_config(config))
    twin = copy.deepcopy(model)
    block = next(m for m in twin.modules() if hasattr(m, "gate") and hasattr(m, "experts"))
    x, index = torch.randn(3, config.hidden_size), torch.tensor([[0, 1], [2, 3], [1, 2]])
    weights = torch.full((3, 2), 0.5)
    with torch.no_grad():
        before = block.experts(x, index, weights)
        block.experts.down_proj.mul_(2)  # the copy's weights only
        assert torch.allclose(block.experts(x, index, weights), 2 * before)
