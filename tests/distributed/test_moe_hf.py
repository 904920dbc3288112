"""transformers mixtures of experts under ``model.hf`` (models/hf/moe.py, docs/moe.md).

Tiny Qwen3-MoE (one sparse layer of two, tied embeddings) and Mixtral (every layer sparse, its
checkpoint's ``block_sparse_moe.experts.N.w1`` names) from ``from_config`` + ``save_pretrained``
(src/paratrain/testing/hf_models.py MOE_ARCHS). Anchored to transformers itself: at lr = 0 the first loss is its
own forward's language-model loss, the auxiliary loss is its ``load_balancing_loss_func`` applied
to each sequence and each sparse layer (weighted by ``router_aux_loss_coef``, averaged), and the
exported directory loads in ``from_pretrained`` with no missing or unexpected key and the same
logits. Then the layouts under plain SGD against one process (loss, aux_loss, grad_norm, tokens
per expert, final weights).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from paratrain.config import ConfigError
from paratrain.testing.dist_utils import read_metrics, run_ranks
from paratrain.testing.hf_models import MOE_ARCHS, save_tiny
from paratrain.testing.moe_utils import HF_MOE_BASE, assert_same_moe_run, hf_moe_runs

pytest.importorskip("transformers")


def transformers_reference(src: str, x: torch.Tensor, y: torch.Tensor) -> dict:
    """transformers' own numbers for the batch (x, y): LM loss, the per-sequence aux loss, counts."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(src, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    lib = __import__(type(model).__module__, fromlist=["load_balancing_loss_func"])
    cfg = model.config
    e, k = MOE_ARCHS[cfg.model_type].get("num_experts") or cfg.num_local_experts, cfg.num_experts_per_tok
    # The toy targets are already shifted (and partly ignored): transformers takes them as shift_labels.
    out = model(input_ids=x, labels=y, shift_labels=y, output_router_logits=True)
    layers = [logits.view(x.shape[0], x.shape[1], e) for logits in out.router_logits]  # one per sparse layer
    per_sequence = [
        sum(lib.load_balancing_loss_func((layer[b],), e, k) for layer in layers) / len(layers)
        for b in range(x.shape[0])
    ]
    counts = torch.stack([torch.bincount(layer.topk(k, dim=-1).indices.flatten(), minlength=e) for layer in layers])
    batch_level = lib.load_balancing_loss_func(out.router_logits, e, k)
    return {
        "loss": (out.loss - cfg.router_aux_loss_coef * out.aux_loss).item(),  # transformers adds its aux itself
        "aux_loss": cfg.router_aux_loss_coef * torch.stack(per_sequence).mean().item(),
        "batch_level_aux_loss": cfg.router_aux_loss_coef * batch_level.item(),
        "tokens": (int(counts.min()), int(counts.max())),
        "logits": out.logits,
    }


@pytest.mark.slow  # ~10 s (transformers' MoE code); the refusals below are the fast case
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_lr0_losses_are_transformers_own_and_the_export_loads_back(tmp_path, arch):
    """Weights loaded through transformers' conversion (per-expert -> fused), the LM loss and the
    per-sequence aux loss of transformers, and ``run.save_model``'s HF directory (save_pretrained
    converts back to per-expert names) read by ``from_pretrained`` with the same logits."""
    import paratrain
    from paratrain.testing.toy import toy_lm

    src = save_tiny(arch, str(tmp_path / arch))
    out = str(tmp_path / "run")
    cfg = [*HF_MOE_BASE, f"model.hf='{src}'", "data.shuffle=false", "optim.lr=0", "run.steps=1", f"run.out_dir='{out}'"]
    paratrain.train(paratrain.load_config(None, [*cfg, "batch.micro_batch_size=4"]))
    row = read_metrics(out)[0]
    data = toy_lm(n=64, seq_len=16, vocab=128)
    x, y = data.x[:8], data.y[:8]
    ref = transformers_reference(src, x, y)
    assert row["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=0)
    assert row["aux_loss"] == pytest.approx(ref["aux_loss"], rel=1e-5, abs=0)
    # Not transformers' batch-level value (every token of the forward pooled): that one depends on the micro-batch.
    assert abs(ref["batch_level_aux_loss"] - ref["aux_loss"]) > 1e-4
    assert (row["expert_tokens_min"], row["expert_tokens_max"]) == ref["tokens"]
    # MFU counts a token's top_k experts, not every expert.
    from paratrain.models.hf import hf_flops, hf_spec

    model = hf_spec(paratrain.load_config(None, cfg).model).build()
    every = 6.0 * sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert hf_flops(model)(16) == every - 6.0 * experts / 2  # 4 experts, top 2: half of them idle
    # The export: per-expert names as transformers saves them, and the same model.
    exported = os.path.join(out, "hf")
    with open(os.path.join(exported, "model.safetensors.index.json")) as f:
        names = json.load(f)["weight_map"]
    assert any(".experts.0." in n for n in names) and not any(n.endswith("gate_up_proj") for n in names)
    from transformers import AutoModelForCausalLM

    back, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    torch.testing.assert_close(back(input_ids=x).logits, ref["logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "arch, extra, match",
    [
        (
            "qwen2_moe",
            [],
            "qwen2_moe is a mixture of experts .4 experts. that model.hf does not support yet; the"
            " supported ones are qwen3_moe, mixtral$",
        ),
        ("olmoe", [], "olmoe is a mixture of experts .4 experts. that model.hf does not support yet"),
        ("mixtral", ["model.args.router_jitter_noise=0.1"], "router_jitter_noise = 0.1 draws noise per forward call"),
        (
            "mixtral",
            ["parallel.dp_shard=2", "parallel.ep=2", "precision.dtype='bf16'"],
            "parallel.ep > 1 with parallel.dp_shard > 1 and precision.dtype = 'bf16' is not supported yet",
        ),
        ("qwen3_moe", ["train.compile=true", "parallel.tp=2"], "runs with train.compile = true with parallel.tp"),
        ("llama", ["parallel.dp_shard=2", "parallel.ep=2"], "parallel.ep = 2 needs a mixture of experts, .* is dense"),
    ],
)
def test_unsupported_hf_moe_is_refused_in_one_line(tmp_path, arch, extra, match):
    import paratrain
    from paratrain.preflight import check_run

    path = save_tiny(arch, str(tmp_path / arch), weights=False)
    cfg = paratrain.load_config(None, [f"model.hf='{path}'", "data.factory='paratrain.testing.toy:toy_lm'", *extra])
    with pytest.raises(ConfigError, match=match) as e:
        check_run(cfg, 2 if any("=2" in x for x in extra) else 1)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module", params=sorted(MOE_ARCHS))
def moe_reference(request, tmp_path_factory):
    """One process, one micro-batch of 8, and accumulation (4 x 2; 2 x 4 with full activation
    checkpointing, whose recompute runs the routers again)."""
    tmp = tmp_path_factory.mktemp(f"moe_hf_{request.param}")
    src = save_tiny(request.param, str(tmp / "src"))
    runs = {
        "ref": ["batch.micro_batch_size=8"],
        "acc4": ["batch.micro_batch_size=2"],
        "acc2_ac": ["batch.micro_batch_size=4", "parallel.activation_checkpointing='full'"],
    }
    return src, hf_moe_runs(tmp, 1, src, runs)


@pytest.mark.slow
def test_hf_moe_layouts_at_world_2_equal_one_process(tmp_path, moe_reference):
    src, one = moe_reference
    ref = one["ref"]
    # The weights move, the balance loss is trained, and the routing is uneven (so counts can differ).
    assert ref["aux_loss"][0] > 0 and abs(ref["loss"][-1] - ref["loss"][0]) > 1e-3
    assert ref["tokens"][0][0] != ref["tokens"][0][1]
    assert_same_moe_run(one["acc4"], ref, rtol=1e-5, atol_params=1e-6)
    assert_same_moe_run(one["acc2_ac"], ref, rtol=1e-5, atol_params=1e-6)
    runs = hf_moe_runs(
        tmp_path,
        2,
        src,
        {
            "ddp_acc2": ["parallel.dp_replicate=2", "batch.micro_batch_size=2"],
            "fsdp_acc2": ["parallel.dp_shard=2", "batch.micro_batch_size=2"],
        },
    )
    assert_same_moe_run(runs["ddp_acc2"], ref, rtol=1e-5, atol_params=1e-6)
    assert_same_moe_run(runs["fsdp_acc2"], ref, rtol=1e-4, atol_params=1e-6)


@pytest.mark.slow
def test_hf_moe_layouts_and_expert_parallel_at_world_4_equal_one_process(tmp_path, moe_reference):
    """World 4, one launch: DDP 4 and HSDP 2 x 2; ep = 2 borrowed from dp = 4 (each expert's rows
    on 2 ranks: their gradient summed over the ep_replicate group) with DDP, and ep = 4 (one expert
    per rank) with FSDP2."""
    src, one = moe_reference
    runs = hf_moe_runs(
        tmp_path,
        4,
        src,
        {
            "ddp": ["parallel.dp_replicate=4", "batch.micro_batch_size=2"],
            "hsdp_2x2": ["parallel.dp_replicate=2", "parallel.dp_shard=2", "batch.micro_batch_size=1"],
            "ep2_ddp4": ["parallel.dp_replicate=4", "parallel.ep=2", "batch.micro_batch_size=2"],
            "ep4_fsdp4": ["parallel.dp_shard=4", "parallel.ep=4", "batch.micro_batch_size=2"],
        },
    )
    assert_same_moe_run(runs["ddp"], one["ref"], rtol=1e-5, atol_params=1e-6)
    assert_same_moe_run(runs["hsdp_2x2"], one["ref"], rtol=1e-4, atol_params=1e-6)
    assert_same_moe_run(runs["ep2_ddp4"], one["ref"], rtol=1e-5, atol_params=1e-6)
    assert_same_moe_run(runs["ep4_fsdp4"], one["ref"], rtol=1e-5, atol_params=1e-6)


@pytest.mark.slow
def test_hf_moe_resumes_at_another_layout(tmp_path):
    """A Mixtral checkpoint of one process at step 2 (DCP, fused expert tensors) resumed by FSDP2
    on 2 ranks: steps 3-4 as uninterrupted."""
    src = save_tiny("mixtral", str(tmp_path / "src"))
    ckpt = ["run.steps=4", "checkpoint.interval=2", "checkpoint.keep=0"]
    ref = hf_moe_runs(tmp_path / "w1", 1, src, {"ref": ["batch.micro_batch_size=8", *ckpt]})["ref"]
    step2 = tmp_path / "w1" / "ref" / "checkpoints" / "step-2"
    resume = [*ckpt, f"checkpoint.resume='{step2}'", "parallel.dp_shard=2", "batch.micro_batch_size=2"]
    got = hf_moe_runs(tmp_path / "w2", 2, src, {"resumed": resume})["resumed"]
    for key in ("loss", "aux_loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(ref[key][2:]), rtol=1e-4, atol=0)
    assert got["tokens"] == ref["tokens"][2:]


def _sparse_block(seed: int = 0):
    """A Qwen3-MoE sparse block (router + 4 fused experts, top 2), weights ~N(0, 0.5): routing far from uniform."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    args = {k: v for k, v in MOE_ARCHS["qwen3_moe"].items() if k != "model_type"}
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(AutoConfig.for_model("qwen3_moe", **args))
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return block


def _block_inputs(n_seq: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = MOE_ARCHS["qwen3_moe"]["hidden_size"]
    return torch.randn(n_seq, seq, d, generator=g), torch.randn(n_seq, seq, d, generator=g)


def _hf_block_at_ep(n_seq: int, seq: int, seed: int) -> dict:
    """One rank of the sparse block at ep = world size on its share of the sequences."""
    import torch.distributed as dist

    from paratrain.distributed.expert_parallel import ExpertGroup
    from paratrain.models.hf.moe import enable_expert_parallel

    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        block = _sparse_block()
        enable_expert_parallel(block.experts, ExpertGroup(dist.group.WORLD, rank, world, None, 1))
        x, cot = _block_inputs(n_seq, seq, seed)
        mine = slice(rank * n_seq // world, (rank + 1) * n_seq // world)
        x = x[mine].clone().requires_grad_(True)
        (block(x) * cot[mine]).sum().backward()
        router = block.gate.weight.grad.clone()
        dist.all_reduce(router)  # replicated: a sum over the ranks
        return {
            "out": block(x).detach().numpy(),  # numpy: a tensor would cross the queue as shared memory
            "x_grad": x.grad.numpy(),
            "router": router.numpy(),
            "gate_up": block.experts.gate_up_proj.grad.to_local().numpy(),  # DTensors Shard(0): this rank's rows
            "down": block.experts.down_proj.grad.to_local().numpy(),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks importing transformers: over the fast tier's budget on a loaded machine
def test_hf_experts_at_ep_2_equal_transformers_experts():
    """The building block of ep for model.hf (still refused end to end): transformers' sparse
    block with its fused experts run through the registered ExpertsInterface function that
    dispatches by all_to_all, at ep = 2 (each rank half the sequences and half the experts),
    against the same block run by transformers' own experts function: outputs, input and router
    gradients, and each expert's gradient on the rank that holds it."""
    n_seq, seq, seed = 4, 6, 3
    block = _sparse_block()
    x, cot = _block_inputs(n_seq, seq, seed)
    x.requires_grad_(True)
    out = block(x)
    (out * cot).sum().backward()
    _, _, experts = block.gate(x.detach().reshape(-1, x.shape[-1]))
    counts = torch.bincount(experts.flatten(), minlength=4)
    assert counts.min() > 0 and counts.max() > counts.min()  # every rank sends and receives, unevenly
    ranks = run_ranks(_hf_block_at_ep, 2, n_seq, seq, seed)
    cat = lambda key: torch.cat([torch.from_numpy(r[key]) for r in ranks])  # noqa: E731
    torch.testing.assert_close(cat("out"), out.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cat("x_grad"), x.grad, rtol=1e-5, atol=1e-6)
    for r in ranks:
        torch.testing.assert_close(torch.from_numpy(r["router"]), block.gate.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cat("gate_up"), block.experts.gate_up_proj.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cat("down"), block.experts.down_proj.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_hf_moe_expert_parallel_equals_one_process_and_resumes_at_ep_1(tmp_path, moe_reference):
    """parallel.ep = 2 on 2 ranks (the fused experts' rows split over them, as DTensors Shard(0):
    each rank loads its experts' rows through transformers' conversion), with DDP and with FSDP2
    for the rest, against one process; then its DCP checkpoint at step 2 resumed by one process
    (ep 1): steps 3-4 as uninterrupted, and the exported weights (gathered rows) equal too."""
    src, one = moe_reference
    ckpt = ["run.steps=4", "checkpoint.interval=2", "checkpoint.keep=0"]
    ref4 = hf_moe_runs(tmp_path / "w1", 1, src, {"ref4": ["batch.micro_batch_size=8", *ckpt]})["ref4"]
    runs = hf_moe_runs(
        tmp_path / "w2",
        2,
        src,
        {
            "ep2_ddp": ["parallel.dp_replicate=2", "parallel.ep=2", "batch.micro_batch_size=2"],
            "ep2_fsdp": ["parallel.dp_shard=2", "parallel.ep=2", "batch.micro_batch_size=4", *ckpt],
        },
    )
    assert_same_moe_run(runs["ep2_ddp"], one["ref"], rtol=1e-5, atol_params=1e-6)
    assert_same_moe_run(runs["ep2_fsdp"], ref4, rtol=1e-5, atol_params=1e-6)
    step2 = tmp_path / "w2" / "ep2_fsdp" / "checkpoints" / "step-2"
    resume = [*ckpt, f"checkpoint.resume='{step2}'", "batch.micro_batch_size=8"]
    got = hf_moe_runs(tmp_path / "w1r", 1, src, {"resumed": resume})["resumed"]
    for key in ("loss", "aux_loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(ref4[key][2:]), rtol=1e-5, atol=0)
    assert got["tokens"] == ref4["tokens"][2:]
    for k in ref4["params"]:
        torch.testing.assert_close(got["params"][k], ref4["params"][k], rtol=1e-5, atol=1e-6)
