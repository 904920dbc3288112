"""Anchors: paratrain's single-process reference checked once against code paratrain did not write.

Every layout test compares paratrain with paratrain at another layout, so a fault in the shared
reference (a clip that never clips, a validation loop that drops a batch, a resume that loses
the random state, an HF model trained differently from transformers' own) passes them all.
Each test here computes the same numbers with plain PyTorch or transformers instead. World 1,
in the test process (``paratrain.train`` makes its own one-rank group), tiny models, few steps.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import Dataset

import paratrain
from paratrain.data.stdlib_bytes import stdlib_corpus
from paratrain.testing.dist_utils import read_metrics
from paratrain.testing.toy import tiny_lm, toy_lm

COMMON = ["run.progress=false", "metrics.plot=false", "metrics.rank_stats_every=0"]
# Plain SGD (no momentum, decay or schedule): the update is lr x the gradient, nothing hides it.
SGD = [
    "optim.name='sgd'",
    "optim.beta1=0",
    "optim.weight_decay=0",
    "optim.warmup_steps=0",
    "optim.schedule='constant'",
]


def train(out: str, overrides: list[str], **objects) -> tuple[dict, list[dict]]:
    summary = paratrain.train(paratrain.load_config(None, [*COMMON, f"run.out_dir='{out}'", *overrides]), **objects)
    return summary, read_metrics(out)


def test_clipped_sgd_steps_match_plain_pytorch(tmp_path):
    """Anchor: ``torch.nn.utils.clip_grad_norm_`` + ``torch.optim.SGD`` on a copy of the model,
    the whole global batch in one forward with ``F.cross_entropy`` (mean over non-ignored tokens).
    Catches clipping that never clips (``finish_step`` passing ``math.inf``): the logged norm is
    the pre-clip one either way, but the weights and the second step's loss move by lr x norm.
    """
    max_norm, lr, steps = 0.05, 0.5, 2
    data = toy_lm(n=8, seq_len=16, vocab=32)  # n = the global batch: every step sees all 8 samples
    torch.manual_seed(0)
    model = tiny_lm(vocab=32)
    ref = copy.deepcopy(model)
    cfg = [*SGD, f"optim.lr={lr}", f"optim.grad_clip={max_norm}", f"run.steps={steps}"]
    cfg += ["batch.global_batch_size=8", "batch.micro_batch_size=4"]  # accumulation 2
    _, rows = train(str(tmp_path), cfg, model=model, dataset=data)

    # Clipping is the point; by a factor > 10 it is a smooth rescale, not a sign: measured at most 2.9e-7 (2 steps).
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    x, y = data.x, data.y
    for row in rows:
        loss = F.cross_entropy(ref(x).reshape(-1, 32), y.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        opt.step()
        assert norm > 10 * max_norm  # clipping really happens, by a large factor
        torch.testing.assert_close(row["grad_norm"], norm.item(), rtol=1e-5, atol=0)
        torch.testing.assert_close(row["loss"], loss.item(), rtol=1e-5, atol=0)
    got = load_file(os.path.join(tmp_path, "model.safetensors"))
    want = ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_val_loss_matches_cross_entropy_over_every_validation_window(tmp_path):
    """Anchor: the validation loss computed by hand: the held-out bytes that follow the training
    bytes of the standard-library corpus, cut here into windows of block_size + 1, the first
    ``eval.samples`` of them through the final weights (loaded into a fresh model), float64 mean
    of ``F.cross_entropy`` over every target byte. Catches a validation that skips a batch
    (``Evaluator`` iterating ``self._batches[1:]``) or windows that differ.
    """
    block, max_bytes, val_bytes, samples = 16, 20_000, 4_000, 32
    torch.manual_seed(0)
    cfg = [*SGD, "optim.lr=0.5", "run.steps=2", "batch.global_batch_size=8", "batch.micro_batch_size=4"]
    cfg += [f"data.args={{block_size={block},max_bytes={max_bytes},val_bytes={val_bytes}}}"]
    cfg += ["eval.interval=2", f"eval.samples={samples}", "eval.micro_batch_size=2"]
    _, rows = train(str(tmp_path), cfg, model=tiny_lm(vocab=256))
    val_loss = rows[-1]["val_loss"]

    model = tiny_lm(vocab=256)
    model.load_state_dict(load_file(os.path.join(tmp_path, "model.safetensors")))
    held_out = stdlib_corpus(max_bytes + val_bytes)[max_bytes:]
    assert len(held_out) == val_bytes
    windows = torch.tensor([list(held_out[i * block : i * block + block + 1]) for i in range(samples)])
    with torch.no_grad():
        logits = model(windows[:, :-1]).double()
    want = F.cross_entropy(logits.reshape(-1, 256), windows[:, 1:].reshape(-1)).item()
    torch.testing.assert_close(val_loss, want, rtol=1e-6, atol=0)
    # Not a trivial match: the 4 global batches' mean losses differ, so dropping one would show.
    per_token = F.cross_entropy(logits.reshape(-1, 256), windows[:, 1:].reshape(-1), reduction="none")
    assert per_token.view(4, -1).mean(1).std() > 1e-3


def test_resume_with_dropout_is_bitwise(tmp_path):
    """Anchor: the same run uninterrupted (the trajectory torch's RNG gives with no checkpoint in
    between). With dropout drawn from the global RNG (run.keyed_random = false; keyed masks need
    no state and resume at any world size: tests/distributed/test_randomness.py), stopping after step 2 and
    resuming from its checkpoint must restore that state to give bitwise-equal losses. Catches a
    resume that does not restore the random state (``set_rng_state`` skipped).
    """
    cfg = [
        "model.args={n_layer=2,n_head=2,d_model=32,block_size=16,vocab_size=32,dropout=0.3}",
        "data.factory='paratrain.testing.toy:toy_lm'",
        "data.args={n=32,seq_len=16,vocab=32}",
        "batch.global_batch_size=8",
        "batch.micro_batch_size=4",
        "optim.lr=3e-3",
        "optim.warmup_steps=1",
        "run.steps=4",
        "run.save_model=false",
        "checkpoint.interval=2",
        "run.keyed_random=false",
        "run.layout_dependent=true",
    ]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    straight, _ = train(full, cfg)
    train(part, [*cfg, "run.max_samples=16"])  # stops after step 2 (the lr schedule still spans 4)
    ckpt = os.path.join(part, "checkpoints", "step-2")
    resumed, rows = train(part, [*cfg, f"checkpoint.resume='{ckpt}'"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and resumed["resumed_from_step"] == 2
    assert resumed["losses"] == straight["losses"][2:]  # bitwise
    assert [r["loss"] for r in rows] == straight["losses"]


class MaskedTokens(Dataset):
    """Random token rows of length T + 1 with a different number of leading labels ignored:
    sample i is ``(tokens[i, :-1], labels[i, 1:])``, the pairs transformers makes from
    ``input_ids=tokens, labels=labels`` by shifting inside its loss."""

    def __init__(self, n: int = 8, seq_len: int = 16, vocab: int = 128, seed: int = 5):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (n, seq_len + 1), generator=g)
        self.labels = self.tokens.clone()
        for i, k in enumerate(torch.randint(1, seq_len - 1, (n,), generator=g).tolist()):
            self.labels[i, :k] = -100

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i, :-1], self.labels[i, 1:]


def test_hf_sgd_step_matches_transformers_forward_and_backward(tmp_path):
    """Anchor: transformers' own ``LlamaForCausalLM`` forward with ``labels=`` (its loss, its
    shift, its mean over non-ignored labels) and backward on the same global batch, then
    ``w - lr * grad``. paratrain runs the model through its own decoder loop (HFCausalLM) with
    accumulation 2; its loss, logged grad_norm and the gradient implied by its exported weights
    must match. Catches a detached embedding (no gradient reaches ``embed_tokens``), a wrong
    shift or mask, or a gradient off by a factor.
    """
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from paratrain.testing.hf_models import save_tiny

    src = save_tiny("llama", str(tmp_path / "llama"))
    lr, data = 1.0, MaskedTokens()
    cfg = [*SGD, f"optim.lr={lr}", "optim.grad_clip=0", "run.steps=1", f"model.hf='{src}'"]
    cfg += ["batch.global_batch_size=8", "batch.micro_batch_size=4"]
    out = str(tmp_path / "run")
    _, rows = train(out, cfg, dataset=data)

    ref = AutoModelForCausalLM.from_pretrained(src, attn_implementation="sdpa")
    ref.train()
    loss = ref(input_ids=data.tokens, labels=data.labels).loss
    loss.backward()
    grads = {k: p.grad for k, p in ref.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())
    norm = torch.nn.utils.get_total_norm(list(grads.values()))
    torch.testing.assert_close(rows[0]["loss"], loss.item(), rtol=1e-5, atol=0)
    torch.testing.assert_close(rows[0]["grad_norm"], norm.item(), rtol=1e-4, atol=0)

    trained = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf")).state_dict()
    before = ref.state_dict()
    for k, g in grads.items():
        implied = (before[k] - trained[k]) / lr
        torch.testing.assert_close(implied, g, rtol=1e-3, atol=2e-6, msg=lambda m, k=k: f"gradient of {k}: {m}")
