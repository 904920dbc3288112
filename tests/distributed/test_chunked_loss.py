"""The chunked cross-entropy (``loss.chunk_size``, loss.py ``ChunkedCrossEntropy``): the loss runs
the output layer chunk by chunk, so the ``[tokens, vocab]`` logits never exist at once.

Anchored to plain PyTorch (``F.cross_entropy`` over the whole logits of the same model), to
transformers' own ``labels=`` loss on each conversation alone, and to the unchunked one-process
run on every layout: DDP, FSDP2, TP with torch's ``loss_parallel`` (and sequence parallel), PP.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from paratrain.config import ConfigError, LossConfig, load_config
from paratrain.models.gpt.model import build_gpt
from paratrain.objectives.registry import build_loss
from paratrain.testing.sft import losses_and_norms, reference, sft_config, sft_gpt


def test_chunks_give_the_whole_logits_loss_and_gradients():
    """Against plain PyTorch on the same weights: the sum and every parameter's gradient within
    1e-6 (relative norm), with a chunk that does not divide the positions (the last one short)."""
    torch.manual_seed(0)
    model = build_gpt(vocab_size=1000, block_size=64, n_layer=2, n_head=2, d_model=32)
    x = torch.randint(0, 1000, (3, 64))
    target = torch.randint(0, 1000, (3, 64))
    target[:, :10] = -100
    chunked = copy.deepcopy(model)
    ref = F.cross_entropy(model(x).reshape(-1, 1000), target.reshape(-1), ignore_index=-100, reduction="sum")
    ref.backward()
    loss = build_loss(LossConfig(chunk_size=7))
    assert loss.owns_head
    chunked.return_hidden = True
    loss.fn.bind(chunked.lm_head, loss_parallel=False)
    hidden = chunked(x)
    assert hidden.shape == (3, 64, 32)  # the model stopped before its output layer
    s, count = loss(hidden, target)
    s.backward()
    assert int(count) == 3 * 54
    torch.testing.assert_close(s, ref, rtol=1e-6, atol=0)
    for (name, p), q in zip(chunked.named_parameters(), model.parameters()):
        err = float((p.grad - q.grad).norm() / q.grad.norm())
        assert err < 1e-6, f"{name}: gradient off by {err:.2e} (relative norm)"


def test_bad_chunk_settings_are_one_line():
    with pytest.raises(ConfigError, match="loss.chunk_size = -1 must be >= 0"):
        build_loss(LossConfig(chunk_size=-1))
    with pytest.raises(ConfigError, match="chunks the built-in cross_entropy only"):
        build_loss(LossConfig(name="mse", chunk_size=64))
    with pytest.raises(ConfigError, match="not the loss passed to train"):
        build_loss(LossConfig(chunk_size=64), lambda out, t: (out.sum(), t.numel()))


def test_tensor_parallel_loss_parallel_chunks_equal_one_process(sft, gpt_reference):
    """tp = 2 with loss_parallel: each chunk's logits stay vocabulary-sharded DTensors; losses and
    grad_norm of 3 SGD steps equal the unchunked one-process run."""
    from paratrain.testing.dist_utils import run_ranks, train_rank

    name = "gpt_tp_chunked"
    run_ranks(train_rank, 2, sft_gpt(sft, name, "parallel.tp=2", "batch.micro_batch_size=4", "loss.chunk_size=100"))
    losses, norms = losses_and_norms(os.path.join(sft["root"], name))
    torch.testing.assert_close(losses, gpt_reference[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(norms, gpt_reference[1], rtol=1e-5, atol=0)


LAYOUTS = {
    2: {
        "gpt_chunk_ddp": ["parallel.dp_replicate=2", "batch.micro_batch_size=2"],
        "gpt_chunk_fsdp": ["parallel.dp_shard=2", "batch.micro_batch_size=2"],
        "gpt_chunk_tp_sp": ["parallel.tp=2", "parallel.sequence_parallel=true", "batch.micro_batch_size=4"],
        "gpt_chunk_pp": ["parallel.pp=2", "parallel.pp_schedule='1f1b'", "batch.micro_batch_size=4"],
    },
    4: {
        "gpt_chunk_fsdp_tp": ["parallel.dp_shard=2", "parallel.tp=2", "batch.micro_batch_size=2"],
        "gpt_chunk_ddp_tp": ["parallel.dp_replicate=2", "parallel.tp=2", "batch.micro_batch_size=2"],
        # The stage holding the output layer must keep it gathered under FSDP2 for the loss.
        "gpt_chunk_pp_fsdp": ["parallel.pp=2", "parallel.dp_shard=2", "batch.micro_batch_size=2"],
        "gpt_chunk_pp_tp": [
            "parallel.pp=2",
            "parallel.tp=2",
            "parallel.pp_schedule='gpipe'",
            "batch.micro_batch_size=4",
        ],
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_every_layout_chunked_equals_one_process_unchunked(sft, gpt_reference, world):
    from paratrain.testing.dist_utils import run_ranks, train_layouts

    runs = {
        name: [o for o in sft_gpt(sft, name, *extra, "loss.chunk_size=100") if not o.startswith("run.out_dir")]
        for name, extra in LAYOUTS[world].items()
    }
    run_ranks(train_layouts, world, runs, sft["root"], timeout=900)
    for name in runs:
        losses, norms = losses_and_norms(os.path.join(sft["root"], name))
        tol = 1e-4 if "fsdp" in name or "tp" in name else 1e-5
        torch.testing.assert_close(losses, gpt_reference[0], rtol=tol, atol=0, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(norms, gpt_reference[1], rtol=tol, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_hf_model_chunked_equals_transformers_on_each_conversation_alone(sft):
    """A Llama whose loss runs its lm_head in chunks: val_loss and one SGD step's grad_norm equal
    transformers' own labels= loss on each conversation alone."""
    import paratrain
    from paratrain.data.tokens import build_tokens
    from paratrain.launch.eval_worker import eval_checkpoint
    from paratrain.testing.dist_utils import read_metrics

    ref_loss, ref_items, ref_norm = reference(sft, sft["convs"])
    cfg = load_config(
        None, sft_config(sft, sft["val"], "eval_chunked", "batch.global_batch_size=4", "loss.chunk_size=64")
    )
    result = eval_checkpoint(cfg, "")
    assert result["val_items"] == ref_items
    torch.testing.assert_close(result["val_loss"], ref_loss, rtol=1e-5, atol=0)
    rows = len(build_tokens(sft["train"], block_size=512))
    over = sft_config(sft, sft["train"], "step_chunked", f"batch.global_batch_size={rows}", "run.steps=1")
    paratrain.train(load_config(None, over + ["loss.chunk_size=64"]))
    (row,) = read_metrics(os.path.join(sft["root"], "step_chunked"))
    torch.testing.assert_close(row["loss"], ref_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(row["grad_norm"], ref_norm, rtol=1e-5, atol=0)
