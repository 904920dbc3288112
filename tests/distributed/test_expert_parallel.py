"""Expert parallelism (``parallel.ep``; distributed/expert_parallel.py, docs/moe.md).

The block alone at ep = 2 against the ep = 1 block on the same tokens (outputs, input, router and
expert gradients), whose own anchor is tests/distributed/test_moe.py's per-token float64 loop. Then whole runs
under plain SGD at ep = 2 and 4, with DDP, FSDP2 and HSDP, against one process (loss, aux_loss,
grad_norm, tokens per expert, final weights), and a checkpoint of ep = 2 resumed at ep = 1 and 4.
"""

from __future__ import annotations

import re

import pytest
import torch

from paratrain.config import ConfigError
from paratrain.testing.dist_utils import run_ranks
from paratrain.testing.moe_utils import MOE_GPT, assert_same_moe_run, make_moe, moe_runs


def _block_at_ep(n_seq: int, seq: int, seed: int) -> dict:
    """One rank of the MoE block at ep = world size on its share of the sequences."""
    import torch.distributed as dist

    from paratrain.distributed.expert_parallel import ExpertGroup

    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        moe = make_moe(n_experts=4, n_shared_experts=1)
        names = [n for n, _ in moe.named_parameters()]
        local = moe.enable_expert_parallel(ExpertGroup(dist.group.WORLD, rank, world, None, 1))
        x, cot = _inputs(n_seq, seq, seed)
        mine = slice(rank * n_seq // world, (rank + 1) * n_seq // world)
        x = x[mine].clone().requires_grad_(True)
        out = moe(x)
        ((out * cot[mine]).sum() + moe.router_stats.aux_sum).backward()
        local_ids = {id(p) for p in local}
        grads = {}
        for n, p in moe.named_parameters():
            g = p.grad.clone()
            if id(p) not in local_ids:  # replicated weights: their gradient is a sum over the ranks
                dist.all_reduce(g)
            grads[n] = g.numpy()  # numpy: a tensor would cross the queue as shared memory the rank frees
        assert set(grads) < set(names) and len(local) < len(names)
        return {
            "out": out.detach().numpy(),
            "x_grad": x.grad.numpy(),
            "grads": grads,
            "aux": float(moe.router_stats.aux_sum.detach()),
        }
    finally:
        dist.destroy_process_group()


def _inputs(n_seq: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_seq, seq, 16, generator=g), torch.randn(n_seq, seq, 16, generator=g)


def test_block_at_ep_2_equals_the_block_at_ep_1():
    """Fast: outputs, input gradients, router and shared-expert gradients (summed over the ranks)
    and each expert's gradient (on the rank that holds it) equal the ep = 1 block's."""
    n_seq, seq, seed = 4, 6, 3
    moe = make_moe(n_experts=4, n_shared_experts=1)
    x, cot = _inputs(n_seq, seq, seed)
    x.requires_grad_(True)
    out = moe(x)
    ((out * cot).sum() + moe.router_stats.aux_sum).backward()
    counts = moe.router_stats.tokens_per_expert
    assert counts.min() > 0 and counts.max() > counts.min()  # every rank sends and receives, unevenly
    ranks = run_ranks(_block_at_ep, 2, n_seq, seq, seed)
    cat = lambda key: torch.cat([torch.from_numpy(r[key]) for r in ranks])  # noqa: E731
    torch.testing.assert_close(cat("out"), out.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cat("x_grad"), x.grad, rtol=1e-5, atol=1e-6)
    assert sum(r["aux"] for r in ranks) == pytest.approx(float(moe.router_stats.aux_sum.detach()), rel=1e-6)
    seen = set()
    for r in ranks:
        for n, g in r["grads"].items():
            torch.testing.assert_close(
                torch.from_numpy(g), dict(moe.named_parameters())[n].grad, rtol=1e-5, atol=1e-6, msg=n
            )
            seen.add(n)
    assert seen == {n for n, _ in moe.named_parameters()}  # every expert is held by one of the ranks


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["parallel.ep=3"], "parallel.ep = 3 must divide the data-parallel degree"),
        (
            ["parallel.dp_shard=4", "parallel.ep=4", "model.args={n_layer = 1, d_model = 32, moe = {n_experts = 6}}"],
            "parallel.ep = 4 does not divide model.args.moe.n_experts = 6",
        ),
        (["parallel.ep=0"], "parallel.ep = 0 must divide"),
        (["parallel.cp=2", "parallel.dp_shard=2", "parallel.ep=2"], "parallel.ep > 1 with parallel.cp > 1"),
    ],
)
def test_bad_ep_is_one_line(overrides, match):
    import paratrain
    from paratrain.preflight import check_run

    cfg = paratrain.load_config(None, [*MOE_GPT, *overrides])
    with pytest.raises(ConfigError, match=match) as e:
        check_run(cfg, 4)
    assert "\n" not in str(e.value)


def test_ep_with_a_dense_model_is_refused():
    import paratrain
    from paratrain.preflight import check_run

    dense = [o for o in MOE_GPT if not o.startswith("model.args=")]
    cfg = paratrain.load_config(
        None, [*dense, "model.args={n_layer = 1, d_model = 32, n_head = 2, vocab_size = 32}", "parallel.ep=2"]
    )
    with pytest.raises(ConfigError, match=r"parallel.ep > 1 needs the built-in GPT with a mixture of experts"):
        check_run(cfg, 2)


# ------------------------------------------------------------------------------ whole runs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return moe_runs(tmp_path_factory.mktemp("ep_ref"), 1, {"ref": ["batch.micro_batch_size=8"]})["ref"]


def _check(runs: dict, ref: dict) -> None:
    assert ref["aux_loss"][0] > 0 and abs(ref["loss"][-1] - ref["loss"][0]) > 1e-3  # the weights move
    for name, got in runs.items():
        try:
            assert_same_moe_run(got, ref)
            assert set(got["params"]) == set(ref["params"])  # the full expert set, same names
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.slow
def test_ep_at_world_2_equals_one_process(tmp_path, reference):
    runs = {
        "ep2_ddp_acc2": ["parallel.ep=2", "batch.micro_batch_size=2"],
        "ep2_fsdp": ["parallel.ep=2", "parallel.dp_shard=2", "batch.micro_batch_size=4"],
        # The recomputation replays the all_to_alls, in the same order on both ranks.
        "ep2_ddp_ac": ["parallel.ep=2", "batch.micro_batch_size=4", "parallel.activation_checkpointing='full'"],
    }
    _check(moe_runs(tmp_path, 2, runs), reference)


@pytest.mark.slow
def test_ep_at_world_4_equals_one_process(tmp_path, reference):
    runs = {
        "ep4_ddp": ["parallel.ep=4", "batch.micro_batch_size=2"],
        # ep = 2 borrowed from dp = 4: each expert on 2 ranks, its gradient summed over those 2.
        "ep2_fsdp4_acc2": ["parallel.ep=2", "parallel.dp_shard=4", "batch.micro_batch_size=1"],
        "ep2_hsdp_2x2": ["parallel.ep=2", "parallel.dp_replicate=2", "parallel.dp_shard=2", "batch.micro_batch_size=2"],
    }
    _check(moe_runs(tmp_path, 4, runs), reference)


@pytest.mark.slow
def test_ep_2_checkpoint_resumes_at_ep_1_and_ep_4(tmp_path):
    ckpt = ["run.steps=4", "checkpoint.interval=2", "checkpoint.keep=0"]
    ref = moe_runs(tmp_path / "w2", 2, {"ref": ["parallel.ep=2", "batch.micro_batch_size=4", *ckpt]})["ref"]
    src = tmp_path / "w2" / "ref" / "checkpoints" / "step-2"
    # The full expert set, under the names of ep = 1 (each key written by a rank that holds it).
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(src)).read_metadata().state_dict_metadata
    held = {
        re.sub(r"^.*?(layers\.\d+\.mlp\.experts\.\d+\..*)$", r"\1", k)
        for k in keys
        if k.startswith("model.") and ".experts." in k
    }
    assert held == {k for k in ref["params"] if ".experts." in k}
    resume = [*ckpt, f"checkpoint.resume='{src}'"]
    got = {
        "ep1": moe_runs(tmp_path / "w1", 1, {"r": [*resume, "batch.micro_batch_size=8"]})["r"],
        "ep4": moe_runs(tmp_path / "w4", 4, {"r": [*resume, "parallel.ep=4", "batch.micro_batch_size=2"]})["r"],
    }
    for name, run in got.items():
        for key in ("loss", "aux_loss", "grad_norm"):
            torch.testing.assert_close(
                torch.tensor(run[key]),
                torch.tensor(ref[key][2:]),
                rtol=1e-5,
                atol=0,
                msg=lambda m: f"{name} {key}: {m}",
            )
        assert run["tokens"] == ref["tokens"][2:]


@pytest.mark.slow
def test_ep_2_adamw_checkpoint_resumes_at_ep_1(tmp_path):
    """AdamW's per-expert state is saved by the ranks holding the experts and loaded by one
    process: without it the resumed updates (and losses) would differ."""
    adamw = ["optim.name='adamw'", "optim.beta1=0.9", "optim.grad_clip=1.0", "optim.lr=0.01"]
    ckpt = ["run.steps=4", "checkpoint.interval=2", "checkpoint.keep=0", *adamw]
    ref = moe_runs(tmp_path / "w2", 2, {"ref": ["parallel.ep=2", "batch.micro_batch_size=4", *ckpt]})["ref"]
    src = tmp_path / "w2" / "ref" / "checkpoints" / "step-2"
    got = moe_runs(tmp_path / "w1", 1, {"r": [*ckpt, f"checkpoint.resume='{src}'", "batch.micro_batch_size=8"]})["r"]
    # AdamW is the point; its drift between ep 2 and ep 1 measured at most 1.6e-7 over steps 3-4 (AMD EPYC, CPU).
    for key in ("loss", "aux_loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(ref[key][2:]), rtol=1e-5, atol=0)
