"""LoRA with PEFT's own adapters (``[model.lora]``, docs/lora.md).

The reference is code we did not write: PEFT's ``get_peft_model`` on the same transformers
Llama. paratrain's LoRA model must give the base model's logits at step 0 (B starts at zero),
count PEFT's ``get_nb_trainable_parameters``, and three plain SGD steps must give PEFT's losses
and gradient norms; the base weights it writes at the end are bitwise the ones it loaded. An
adapter left out of the optimiser, or a base weight that trained, fails it. Then every data-
parallel layout (DDP, FSDP2 at world 2) gives the one-process losses, for a Llama and the GPT.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

import paratrain
from paratrain.config import ConfigError, load_config
from paratrain.data.datasets import build_dataset
from paratrain.models import build
from paratrain.models.hf import weight_files
from paratrain.models.lora import adapter_base_name, is_adapter_param, trainable_parameters
from paratrain.preflight import check_run
from paratrain.testing.dist_utils import plain_sgd, read_metrics, run_ranks
from paratrain.testing.hf_models import save_tiny

pytest.importorskip("transformers")
pytest.importorskip("peft")

SGD = [*plain_sgd(2.0), "run.progress=false", "metrics.plot=false"]
LORA = [
    "model.lora.r=4",
    "model.lora.alpha=8",
    "model.lora.target_modules=['q_proj', 'v_proj', 'mlp.*_proj']",
    "model.lora.modules_to_save=['lm_head']",
]
DATA = ["data.factory='paratrain.testing.toy:toy_lm'", "data.args={n = 16, seq_len = 16, vocab = 128}"]


def test_lora_equals_peft_get_peft_model(tmp_path):
    """Step 0: the base model's logits, PEFT's trainable count, B = 0 and A PEFT's kaiming init.
    Three full-batch SGD steps: PEFT's losses and gradient norms (1e-5); base weights bitwise."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf_dir = save_tiny("llama", str(tmp_path / "llama"))
    out = str(tmp_path / "run")
    over = [f"model.hf='{hf_dir}'", *LORA, *DATA, "batch.global_batch_size=16", "run.steps=3", f"run.out_dir='{out}'"]
    cfg = load_config(None, [*over, *SGD])

    # paratrain's model at step 0, as build_run makes it: seed, build on meta, load after.
    torch.manual_seed(cfg.run.seed)
    model, spec = build(cfg.model)
    spec.materialize(model, device=torch.device("cpu"))
    params = dict(model.named_parameters())
    for name, p in params.items():
        if ".lora_B." in name:
            assert torch.count_nonzero(p) == 0, name
        if ".lora_A." in name:  # PEFT's init: kaiming_uniform(a=sqrt(5)), bound 1/sqrt(fan_in)
            assert 0 < p.abs().max() <= p.shape[1] ** -0.5, name

    base = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa")
    ds = build_dataset(cfg.data)
    x, y = (torch.stack(t) for t in zip(*(ds[i] for i in range(len(ds)))))
    with torch.no_grad():
        torch.testing.assert_close(model(x), base(input_ids=x).logits, rtol=0, atol=0)

    peft_model = get_peft_model(
        base,
        LoraConfig(
            r=4, lora_alpha=8, target_modules=r"(?:.*\.)?(?:q_proj|v_proj|mlp\..*_proj)", modules_to_save=["lm_head"]
        ),
    )
    assert trainable_parameters(model)[0] == peft_model.get_nb_trainable_parameters()[0]
    by_hf_name = {model.hf_name(n): p for n, p in params.items()}
    with torch.no_grad():  # paratrain's initial adapters into PEFT's (the same modules by name)
        names = [n for n, p in peft_model.named_parameters() if p.requires_grad]
        assert len(names) == sum(p.requires_grad for p in params.values())
        for n, p in peft_model.named_parameters():
            if p.requires_grad:
                p.copy_(by_hf_name[n.removeprefix("base_model.model.")])

    # PEFT's three steps: the mean cross-entropy of the whole batch, plain SGD on its trainables.
    ref_losses, ref_norms = [], []
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    for _ in range(3):
        loss = F.cross_entropy(peft_model(input_ids=x).logits.flatten(0, 1), y.flatten())
        grads = torch.autograd.grad(loss, trainable)
        ref_losses.append(float(loss.detach()))
        ref_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        with torch.no_grad():
            for p, g in zip(trainable, grads):
                p.sub_(cfg.optim.lr * g)

    paratrain.train(cfg)
    rows = read_metrics(out)
    torch.testing.assert_close([r["loss"] for r in rows], ref_losses, rtol=1e-5, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in rows], ref_norms, rtol=1e-5, atol=0)

    # Base weights bitwise the loaded ones; the adapters moved.
    final = load_file(os.path.join(out, "model.safetensors"))
    files = weight_files(hf_dir)
    for name, value in final.items():
        if is_adapter_param(name):
            if ".lora_B." in name:
                assert torch.count_nonzero(value) > 0, name
            continue
        key = adapter_base_name(model.hf_name(name))
        with safe_open(files[key], "pt") as f:
            assert torch.equal(value, f.get_tensor(key)), f"base weight {name} changed"


def test_bad_lora_input_is_one_line(tmp_path):
    def refused(over: list[str], needle: str, *, world: int = 1, build_it: bool = False) -> None:
        with pytest.raises(ConfigError) as e:
            cfg = load_config(None, ["model.args={n_layer = 1, n_head = 2, d_model = 16}", *over])
            check_run(cfg, world)
            if build_it:
                build(cfg.model)
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)

    refused(["model.lora.r=0", "model.lora.target_modules=['q_proj']"], "model.lora.r = 0 must be > 0")
    refused(["model.lora.r=-2"], "model.lora.r = -2 must be > 0")
    refused(["model.lora.use_dora=true"], "model.lora.use_dora is a PEFT LoraConfig option paratrain does not support")
    refused(["model.lora.lora_alpha=16"], "write model.lora.alpha instead")
    refused(["model.lora.target_modules='q_proj'"], "use 'all-linear' or a list")
    refused(["model.lora.modules_to_save=['lm_head']"], "model.lora.target_modules is empty")
    refused(
        ["model.lora.target_modules=['qkv']"],
        "matches no layer of the model; its linear layers are named q_proj, k_proj, v_proj, o_proj",
        build_it=True,
    )
    refused(
        ["model.lora.target_modules=['q_proj']", "model.lora.modules_to_save=['head']"],
        "model.lora.modules_to_save names 'head', which matches no module",
        build_it=True,
    )
    refused(
        ["model.lora.target_modules='all-linear'", "parallel.tp=2", "parallel.sequence_parallel=true"],
        "model.lora with parallel.sequence_parallel = true is not supported yet",
        world=2,
    )


# ----------------------------------------------------------------------------- layouts


def _runs(root: str) -> tuple[dict, dict]:
    """One-process references and their world-2 layouts: a Llama and a Qwen2 with weights, and the GPT."""
    llama = [f"model.hf='{root}/llama'", *LORA]
    qwen2 = [f"model.hf='{root}/qwen2'", *LORA]
    gpt = [
        "model.args={n_layer = 2, n_head = 4, d_model = 32, vocab_size = 128, block_size = 16}",
        "model.lora.target_modules='all-linear'",
        "model.lora.modules_to_save=['norm']",
    ]
    common = [*DATA, "batch.global_batch_size=8", "run.steps=3", *SGD]
    world1, world2 = {}, {}
    for name, model in (("llama", llama), ("qwen2", qwen2), ("gpt", gpt)):
        world1[f"{name}_ref"] = [*common, *model, "batch.micro_batch_size=8"]
        world2[f"{name}_ddp"] = [*common, *model, "parallel.dp_replicate=2", "batch.micro_batch_size=2"]
        world2[f"{name}_fsdp"] = [*common, *model, "parallel.dp_shard=2", "batch.micro_batch_size=2"]
    return world1, world2


def assert_same_lora_run(run_dir: str, ref_dir: str, rtol: float) -> None:
    """A LoRA run against its reference: losses and grad_norm within ``rtol``, the adapters within
    ``rtol`` (atol 1e-6), the frozen base weights bit for bit (the one-process run kept their
    initial values)."""
    ref, rows = read_metrics(ref_dir), read_metrics(run_dir)
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(
            [r[key] for r in rows], [r[key] for r in ref], rtol=rtol, atol=0, msg=lambda m: f"{run_dir} {key}: {m}"
        )
    final, ref_final = (load_file(f"{d}/model.safetensors") for d in (run_dir, ref_dir))
    assert final.keys() == ref_final.keys()
    for key, value in final.items():
        if is_adapter_param(key):
            torch.testing.assert_close(value, ref_final[key], rtol=rtol, atol=1e-6)
        else:
            assert torch.equal(value, ref_final[key]), f"{run_dir}: base weight {key} differs"


@pytest.mark.slow
def test_ddp_and_fsdp2_give_the_one_process_lora_losses(tmp_path):
    """DDP (with accumulation) and FSDP2 at world 2: losses and grad_norm within 1e-5 / 1e-4 of one
    process, base weights unchanged; FSDP2 shards units that hold frozen and trainable parameters."""
    from paratrain.testing.dist_utils import train_layouts

    root = str(tmp_path)
    save_tiny("llama", f"{root}/llama")
    save_tiny("qwen2", f"{root}/qwen2")  # q/k/v with biases
    world1, world2 = _runs(root)
    for name, over in world1.items():
        paratrain.train(load_config(None, [*over, f"run.out_dir='{root}/{name}'"]))
    run_ranks(train_layouts, 2, world2, root, timeout=900)
    for name in world2:
        assert_same_lora_run(f"{root}/{name}", f"{root}/{name.split('_')[0]}_ref", 1e-4 if "fsdp" in name else 1e-5)


# ----------------------------------------------------------------------------- adapter-only checkpoints


def _checkpoint_keys(path: str) -> list[str]:
    from paratrain.checkpoint import load_metadata

    return sorted(load_metadata(path).state_dict_metadata)


def test_lora_checkpoint_holds_adapters_and_resumes_on_its_base_only(tmp_path):
    """A LoRA checkpoint holds the adapters, their optimiser state and the run state, with the base's
    hash in the manifest; resumed, the run continues bitwise; on another base it is refused (one line,
    both hashes) and nothing is written."""
    import json

    from paratrain.models.hf.weights import file_tensors
    from paratrain.models.lora import weights_sha256

    hf_dir = save_tiny("llama", str(tmp_path / "llama"))
    other = save_tiny("llama", str(tmp_path / "other"), seed=1)
    # AdamW (the default): the optimiser has state to save.
    run = [f"model.hf='{hf_dir}'", *LORA, *DATA, "batch.global_batch_size=8", "run.steps=4", *SGD[-2:]]
    a = str(tmp_path / "a")
    paratrain.train(load_config(None, [*run, f"run.out_dir='{a}'", "checkpoint.interval=2", "checkpoint.keep=0"]))
    ckpt = f"{a}/checkpoints/step-2"
    keys = _checkpoint_keys(ckpt)
    model_keys = [k for k in keys if k.startswith("model.")]
    optim_keys = [k for k in keys if k.startswith("optim.state.")]
    assert model_keys and all(is_adapter_param(k) for k in model_keys), model_keys
    assert optim_keys and all(is_adapter_param(k) for k in optim_keys), optim_keys
    assert any(k.startswith("train_state.") for k in keys)
    with open(f"{ckpt}/manifest.json") as f:
        base = json.load(f)["base"]
    assert base["sha256"] == weights_sha256(file_tensors(weight_files(hf_dir))), base

    b = str(tmp_path / "b")
    paratrain.train(load_config(None, [*run, f"run.out_dir='{b}'", f"checkpoint.resume='{ckpt}'"]))
    ref, resumed = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in resumed] == [3, 4]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in resumed] == [r[key] for r in ref[2:]], key

    before = {n: os.path.getmtime(f"{ckpt}/{n}") for n in os.listdir(ckpt)}
    c = str(tmp_path / "c")
    with pytest.raises(ConfigError) as e:
        paratrain.train(
            load_config(None, [*run, f"model.hf='{other}'", f"run.out_dir='{c}'", f"checkpoint.resume='{ckpt}'"])
        )
    line = str(e.value)
    theirs = weights_sha256(file_tensors(weight_files(other)))
    assert "\n" not in line and base["sha256"] in line and theirs in line, line
    assert {n: os.path.getmtime(f"{ckpt}/{n}") for n in os.listdir(ckpt)} == before
    assert not os.path.exists(f"{c}/metrics.jsonl") and not os.path.exists(f"{c}/checkpoints")


@pytest.mark.slow
def test_lora_checkpoint_resumes_across_ddp_fsdp2_and_world_sizes(tmp_path):
    """An adapter-only checkpoint written by DDP resumes under FSDP2 and back, and at world 1: steps
    3 and 4 give the uninterrupted one-process run's losses and grad_norm (1e-4). SGD with momentum,
    so the optimiser state (the adapters' momentum buffers) is resharded too."""
    from paratrain.testing.dist_utils import train_layouts

    root = str(tmp_path)
    save_tiny("llama", f"{root}/llama")
    run = [
        f"model.hf='{root}/llama'",
        *LORA,
        *DATA,
        "batch.global_batch_size=8",
        "run.steps=4",
        *SGD,
        "optim.beta1=0.9",
        "checkpoint.keep=0",
    ]
    ddp, fsdp = ["parallel.dp_replicate=2", "batch.micro_batch_size=2"], ["parallel.dp_shard=2"]
    step2 = "checkpoints/step-2"
    paratrain.train(load_config(None, [*run, f"run.out_dir='{root}/ref'"]))
    world2 = {
        "ddp": [*run, *ddp, "checkpoint.interval=2"],
        "fsdp": [*run, *fsdp, "checkpoint.interval=2"],
        "fsdp_from_ddp": [*run, *fsdp, f"checkpoint.resume='{root}/ddp/{step2}'"],
        "ddp_from_fsdp": [*run, *ddp, f"checkpoint.resume='{root}/fsdp/{step2}'"],
    }
    run_ranks(train_layouts, 2, world2, root, timeout=900)
    paratrain.train(
        load_config(None, [*run, f"run.out_dir='{root}/one_from_fsdp'", f"checkpoint.resume='{root}/fsdp/{step2}'"])
    )
    ref = read_metrics(f"{root}/ref")[2:]
    # Momentum is linear in the gradient (no AdamW sign step to amplify rounding): drift measured at most 3.7e-7.
    for name in ("fsdp_from_ddp", "ddp_from_fsdp", "one_from_fsdp"):
        rows = read_metrics(f"{root}/{name}")
        assert [r["step"] for r in rows] == [3, 4], name
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(
                [r[key] for r in rows], [r[key] for r in ref], rtol=1e-4, atol=0, msg=lambda m: f"{name} {key}: {m}"
            )


# ----------------------------------------------------------------------------- export


def test_export_peft_and_merged_give_paratrains_logits(tmp_path, capsys):
    """``export --peft``: PEFT's own PeftModel.from_pretrained loads the directory with no missing or
    unexpected adapter key and gives paratrain's logits (1e-5); ``--hf --merge``: transformers'
    from_pretrained gives them within 1e-4. --peft/--merge of a checkpoint without adapters, and
    --hf alone of one with adapters, are one line each (exit 2)."""
    import dataclasses
    import warnings

    from peft import PeftModel
    from peft.utils import set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from paratrain.cli import main as cli_main
    from paratrain.config import LoraConfig
    from paratrain.models import build_model

    hf_dir = save_tiny("llama", str(tmp_path / "llama"))
    out = str(tmp_path / "run")
    over = [f"model.hf='{hf_dir}'", *LORA, *DATA, "batch.global_batch_size=16", "run.steps=3", "checkpoint.at_end=true"]
    cfg = load_config(None, [*over, *SGD, f"run.out_dir='{out}'"])
    paratrain.train(cfg)
    ckpt = f"{out}/checkpoints/step-3"

    # paratrain's own forward of the trained model (its final weights, adapters included)
    torch.manual_seed(cfg.run.seed)
    model, spec = build(cfg.model)
    spec.materialize(model, device=torch.device("cpu"))
    model.load_state_dict(load_file(f"{out}/model.safetensors"))
    ds = build_dataset(cfg.data)
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    with torch.no_grad():
        ours = model(x)

    assert cli_main(["export", ckpt, "--peft", str(tmp_path / "peft")]) == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir), str(tmp_path / "peft"))
    assert not [w for w in caught if "keys" in str(w.message)], [str(w.message) for w in caught]
    result = set_peft_model_state_dict(peft_model, load_file(str(tmp_path / "peft/adapter_model.safetensors")))
    assert not result.unexpected_keys, result.unexpected_keys
    assert not [k for k in result.missing_keys if is_adapter_param(k)], result.missing_keys
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=x).logits, ours, rtol=1e-5, atol=1e-5)

    assert cli_main(["export", ckpt, "--hf", str(tmp_path / "merged"), "--merge"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert not any("lora" in n or "modules_to_save" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, ours, rtol=1e-4, atol=1e-4)

    # The GPT: PEFT wraps the plain module; its base is the seed's init.
    gpt = ["model.args={n_layer = 1, n_head = 2, d_model = 16, vocab_size = 128, block_size = 16}", *DATA]
    gpt_lora = ["model.lora.target_modules='all-linear'", "model.lora.modules_to_save=['norm']"]
    gcfg = load_config(None, [*gpt, *gpt_lora, "run.steps=2", "checkpoint.at_end=true", *SGD, f"run.out_dir='{out}g'"])
    paratrain.train(gcfg)
    assert cli_main(["export", f"{out}g/checkpoints/step-2", "--peft", str(tmp_path / "gpeft")]) == 0
    ours = build_model(gcfg.model)
    ours.load_state_dict(load_file(f"{out}g/model.safetensors"))
    torch.manual_seed(gcfg.run.seed)
    base = build_model(dataclasses.replace(gcfg.model, lora=LoraConfig()))
    peft_gpt = PeftModel.from_pretrained(base, str(tmp_path / "gpeft"))
    with torch.no_grad():
        torch.testing.assert_close(peft_gpt(x), ours(x), rtol=1e-5, atol=1e-5)

    full = str(tmp_path / "full")
    paratrain.train(load_config(None, [*gpt, "run.steps=1", "checkpoint.at_end=true", *SGD, f"run.out_dir='{full}'"]))
    capsys.readouterr()
    for argv, needle in (
        (["--peft", str(tmp_path / "x")], "is not of a LoRA run"),
        (["--hf", str(tmp_path / "x"), "--merge"], "is not of a LoRA run"),
        (["--to", str(tmp_path / "x.safetensors"), "--merge"], "--merge goes with --hf DIR"),
    ):
        assert cli_main(["export", f"{full}/checkpoints/step-1", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, err
    assert cli_main(["export", ckpt, "--hf", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds LoRA adapters only" in err and "--merge" in err and "\n" not in err, err


# ----------------------------------------------------------------------------- plan and find-batch


def test_plan_and_find_batch_know_frozen_weights_hold_no_gradient_nor_optimiser_state():
    """The planner's state bound is below full fine-tuning's by exactly the frozen weights' gradient
    and AdamW moments (12 bytes each) less the adapters' own (16 bytes each); the fake-tensor
    estimate of find-batch --estimate and plan by about that (the adapters' activations take a
    little back); the cost model's gradient reduction and optimiser step shrink to the trained share."""
    import dataclasses

    from paratrain.distributed.parallel_dims import ParallelDims
    from paratrain.plan import get_profile
    from paratrain.plan.cost import ModelStats, step_cost
    from paratrain.plan.enumerate import Layout, meta_model
    from paratrain.plan.memory import MemoryModel, estimate_layout_peak

    torch.set_num_threads(1)
    base = [
        "model.args={n_layer = 2, n_head = 4, d_model = 64, vocab_size = 256, block_size = 16}",
        "data.factory='paratrain.testing.toy:toy_lm'",
        "data.args={n = 16, seq_len = 16, vocab = 256}",
        "batch.global_batch_size=2",
        "batch.micro_batch_size=2",
        # The loop's per-tensor temporaries put full training's peak at the optimiser step, where
        # the gradients and both moments are whole; fused AdamW has none and peaks lower (by 188 kB
        # here), so the gap below would be the bytes held less that.
        "optim.implementation='for-loop'",
    ]
    full = load_config(None, base)
    lora = load_config(None, [*base, "model.lora.target_modules=['q_proj', 'v_proj']", "model.lora.r=4"])
    model = meta_model(lora)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert 0 < trained < frozen / 20
    expected = 12 * frozen - 16 * trained

    for layout in (Layout(1, 1, 1, 1, 2), Layout(1, 1, 1, 2, 1)):  # whole, and a pipeline rank's blocks
        bound_full = MemoryModel(full, model=meta_model(full)).lower_bound(layout)
        bound_lora = MemoryModel(lora, model=model).lower_bound(layout)
        if layout.pp == 1:
            assert bound_full - bound_lora == expected
        else:
            assert bound_lora < bound_full / 2

    dims = ParallelDims(1, 1, 1, 1, 1)
    gap = estimate_layout_peak(full, dims, 2) - estimate_layout_peak(lora, dims, 2)
    assert 0.9 * expected < gap <= expected, (gap, expected)

    hw = get_profile("h100-sxm")
    full, lora = (
        dataclasses.replace(c, batch=dataclasses.replace(c.batch, global_batch_size=16)) for c in (full, lora)
    )
    stats_full, stats_lora = ModelStats.of(meta_model(full), full), ModelStats.of(model, lora)
    assert stats_lora.trained == pytest.approx(trained / (trained + frozen))
    for layout, term in ((Layout(8, 1, 1, 1, 1), "dp_grad_reduce"), (Layout(1, 8, 1, 1, 1), "fsdp_comm")):
        c_full = step_cost(layout, cfg=full, stats=stats_full, hw=hw, ranks_per_node=8).terms
        c_lora = step_cost(layout, cfg=lora, stats=stats_lora, hw=hw, ranks_per_node=8).terms
        assert c_lora[term] < c_full[term], term
        share = max(stats_lora.trained, stats_lora.trained_tensors)
        assert c_lora["optimizer"] <= c_full["optimizer"] * share * 1.05, (c_lora["optimizer"], c_full["optimizer"])


# ----------------------------------------------------------------------------- tensor parallel


@pytest.mark.slow
def test_tensor_parallel_lora_gives_the_one_process_losses(tmp_path):
    """parallel.tp = 2: the adapters split to follow their base layer (colwise base: B colwise, A
    replicated; rowwise base: A rowwise, B replicated); losses and grad_norm (plain SGD) within 1e-4
    of one process, base weights bitwise the one-process run's, for a Llama, a Qwen2 and the GPT."""
    from paratrain.testing.dist_utils import train_layouts

    root = str(tmp_path)
    save_tiny("llama", f"{root}/llama")
    save_tiny("qwen2", f"{root}/qwen2")  # colwise q/k/v with biases
    common = [*DATA, "batch.global_batch_size=8", "run.steps=3", *SGD]
    hf_lora = [
        "model.lora.r=4",
        "model.lora.alpha=8",
        "model.lora.target_modules=['q_proj', 'v_proj', 'o_proj', 'mlp.*_proj']",
    ]
    runs = {
        "llama": [*common, f"model.hf='{root}/llama'", *hf_lora],
        "qwen2": [*common, f"model.hf='{root}/qwen2'", *hf_lora],
        "gpt": [
            *common,
            "model.args={n_layer = 2, n_head = 4, d_model = 32, vocab_size = 128, block_size = 16}",
            "model.lora.target_modules='all-linear'",
            "model.lora.modules_to_save=['norm']",
        ],
    }
    for name, over in runs.items():
        paratrain.train(load_config(None, [*over, f"run.out_dir='{root}/{name}_ref'"]))
    world2 = {f"{n}_tp": [*o, "parallel.tp=2"] for n, o in runs.items()}
    run_ranks(train_layouts, 2, world2, root, timeout=900)
    for run in world2:
        assert_same_lora_run(f"{root}/{run}", f"{root}/{run.split('_')[0]}_ref", 1e-4)


def test_tensor_parallel_plan_splits_each_adapter_like_its_base():
    """The GPT's Megatron plan around PEFT's wrappers: the base layer keeps its style; a colwise
    base's B is colwise (A replicated), a rowwise base's A rowwise (B replicated); modules_to_save's
    two copies take the wrapper's style."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from paratrain.distributed.tensor_parallel import styles_around_adapters
    from paratrain.models.gpt.parallel import gpt_tp_plan

    cfg = load_config(
        None,
        [
            "model.args={n_layer = 1, n_head = 2, d_model = 16}",
            "model.lora.target_modules='all-linear'",
            "model.lora.modules_to_save=['norm']",
        ],
    )
    model, _ = build(cfg.model)
    styles = styles_around_adapters(model, gpt_tp_plan(model, sequence_parallel=True, loss_parallel=False))
    p = "layers.0."
    assert type(styles[p + "attn.q_proj.base_layer"]) is ColwiseParallel
    assert type(styles[p + "attn.q_proj.lora_B.default"]) is ColwiseParallel
    assert p + "attn.q_proj.lora_A.default" not in styles and p + "attn.q_proj" not in styles
    rowwise = styles[p + "attn.o_proj.lora_A.default"]
    assert (
        type(rowwise) is RowwiseParallel
        and rowwise.output_layouts == styles[p + "attn.o_proj.base_layer"].output_layouts
    )
    assert p + "attn.o_proj.lora_B.default" not in styles
    assert type(styles["norm.original_module"]) is SequenceParallel
    assert type(styles["norm.modules_to_save.default"]) is SequenceParallel


@pytest.mark.slow
def test_fsdp2_x_tensor_parallel_lora_gives_the_one_process_losses(tmp_path):
    """dp_shard = 2 x tp = 2 at world 4 (the GPT): losses and grad_norm within 1e-4 of one process."""
    from paratrain.testing.dist_utils import train_layouts

    root = str(tmp_path)
    gpt = [
        *DATA,
        "batch.global_batch_size=8",
        "run.steps=3",
        *SGD,
        "model.args={n_layer = 2, n_head = 4, d_model = 32, vocab_size = 128, block_size = 16}",
        "model.lora.target_modules='all-linear'",
        "model.lora.modules_to_save=['norm']",
    ]
    paratrain.train(load_config(None, [*gpt, f"run.out_dir='{root}/ref'"]))
    run_ranks(train_layouts, 4, {"fsdp_tp": [*gpt, "parallel.dp_shard=2", "parallel.tp=2"]}, root, timeout=900)
    ref, rows = read_metrics(f"{root}/ref"), read_metrics(f"{root}/fsdp_tp")
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in rows], [r[key] for r in ref], rtol=1e-4, atol=0, msg=key)


# ----------------------------------------------------------------------------- pipeline parallel


@pytest.mark.slow
def test_pipeline_parallel_lora_gives_the_one_process_losses(tmp_path):
    """pp = 2 (1F1B, 2 pipeline micro-batches): the adapters stay with their layers (the split keeps
    the module tree), a Llama's lm_head copy (modules_to_save) on the last stage; losses and
    grad_norm within 1e-4 of one process, base weights bitwise the one-process run's."""
    from paratrain.testing.dist_utils import train_layouts

    root = str(tmp_path)
    save_tiny("llama", f"{root}/llama")
    common = [*DATA, "batch.global_batch_size=8", "run.steps=3", *SGD]
    runs = {
        "llama": [
            *common,
            f"model.hf='{root}/llama'",
            "model.lora.r=4",
            "model.lora.target_modules=['q_proj', 'v_proj', 'o_proj', 'mlp.*_proj']",
            "model.lora.modules_to_save=['lm_head']",
        ],
        "gpt": [
            *common,
            "model.args={n_layer = 2, n_head = 4, d_model = 32, vocab_size = 128, block_size = 16}",
            "model.lora.target_modules='all-linear'",
            "model.lora.modules_to_save=['norm']",
        ],
    }
    for name, over in runs.items():
        paratrain.train(load_config(None, [*over, f"run.out_dir='{root}/{name}_ref'"]))
    world2 = {f"{n}_pp": [*o, "parallel.pp=2", "batch.micro_batch_size=4"] for n, o in runs.items()}
    run_ranks(train_layouts, 2, world2, root, timeout=900)
    for name in runs:
        assert_same_lora_run(f"{root}/{name}_pp", f"{root}/{name}_ref", 1e-4)


# ----------------------------------------------------------------------------- compile


def _train_counting_graphs(runs: dict, root: str) -> dict:
    """paratrain.testing.dist_utils.train_layouts on one rank, returning what dynamo compiled and where it broke
    (an eager fallback would compare eager with eager)."""
    from torch._dynamo.utils import counters

    from paratrain.testing.dist_utils import train_layouts

    counters.clear()
    train_layouts(runs, root)
    return {"aot_autograd": dict(counters["aot_autograd"]), "graph_break": dict(counters["graph_break"])}


@pytest.mark.slow
@pytest.mark.timeout(900)  # inductor on 2 shared cores: minutes
def test_compiled_lora_equals_uncompiled(tmp_path):
    """train.compile = true with PEFT's adapters inside the compiled blocks of a transformers Llama
    with weights, at world 1 and DDP world 2 (with accumulation): losses and grad_norm (plain SGD)
    within 1e-5 of the uncompiled one-process run, adapters within 1e-5, base weights bitwise; dynamo
    compiled the blocks through AOTAutograd with no graph break. The GPT with adapters compiles in
    the next test (FSDP2, tp) and in the covering sweep (DDP: its compile x lora layouts), so it is
    not run a third time here (the slow tier's budget)."""
    from torch._dynamo.utils import counters

    root = str(tmp_path)
    save_tiny("llama", f"{root}/llama")
    common = [*DATA, "batch.global_batch_size=8", "run.steps=2", *SGD]
    models = {"llama": [f"model.hf='{root}/llama'", *LORA]}
    compiled = {}
    for name, model in models.items():
        paratrain.train(load_config(None, [*common, *model, f"run.out_dir='{root}/{name}_ref'"]))
        counters.clear()
        over = [*common, *model, "train.compile=true", f"run.out_dir='{root}/{name}_compiled'"]
        paratrain.train(load_config(None, over))
        compiled[name] = {"aot_autograd": dict(counters["aot_autograd"]), "graph_break": dict(counters["graph_break"])}
    ddp = ["parallel.dp_replicate=2", "batch.micro_batch_size=2", "train.compile=true"]
    world2 = {f"{name}_ddp": [*common, *model, *ddp] for name, model in models.items()}
    per_rank = run_ranks(_train_counting_graphs, 2, world2, root, timeout=840)  # under pytest's 900: names the rank
    for name in models:
        for run in (f"{name}_compiled", f"{name}_ddp"):
            counted = compiled[name] if run.endswith("compiled") else per_rank[0]
            assert counted["aot_autograd"].get("ok", 0) >= 1 and not counted["graph_break"], (run, counted)
            assert_same_lora_run(f"{root}/{run}", f"{root}/{name}_ref", 1e-5)


@pytest.mark.slow
@pytest.mark.timeout(900)  # inductor on 2 shared cores: minutes
def test_compiled_lora_with_fsdp2_and_tp_equals_uncompiled(tmp_path):
    """train.compile = true with adapters under FSDP2 (dp_shard 2) and TP (tp 2) at world 2, the GPT
    with every linear adapted: losses and grad_norm (plain SGD) within 1e-4 of the uncompiled
    one-process run, adapters within 1e-4, base weights bitwise; compiled with no graph break."""
    root = str(tmp_path)
    common = [
        *DATA,
        "batch.global_batch_size=8",
        "run.steps=2",
        *SGD,
        "model.args={n_layer = 2, n_head = 4, d_model = 32, vocab_size = 128, block_size = 16}",
        "model.lora.target_modules='all-linear'",
    ]
    paratrain.train(load_config(None, [*common, f"run.out_dir='{root}/ref'"]))
    layouts = {"fsdp2": ["parallel.dp_shard=2"], "tp2": ["parallel.tp=2"]}
    runs = {name: [*common, *extra, "train.compile=true"] for name, extra in layouts.items()}
    counted = run_ranks(_train_counting_graphs, 2, runs, root, timeout=840)[0]  # under pytest's 900
    assert counted["aot_autograd"].get("ok", 0) >= 1 and not counted["graph_break"], counted
    for name in layouts:
        assert_same_lora_run(f"{root}/{name}", f"{root}/ref", 1e-4)
