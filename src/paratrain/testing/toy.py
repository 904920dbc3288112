"""Small user-side model, dataset and loss, importable by `factory` paths in tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset


class Samples(Dataset):
    """Samples ``(x[i], y[i])`` of two tensors a subclass fills."""

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class ToyLM(Samples):
    """Random token sequences whose samples carry different numbers of ignored targets."""

    def __init__(self, n: int = 64, seq_len: int = 16, vocab: int = 32, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (n, seq_len), generator=g)
        self.y = torch.randint(0, vocab, (n, seq_len), generator=g)
        ignored = torch.randint(0, seq_len - 1, (n,), generator=g)  # 0 .. seq_len-2 ignored per sample
        for i, k in enumerate(ignored.tolist()):
            self.y[i, :k] = -100


def toy_lm(n: int = 64, seq_len: int = 16, vocab: int = 32, seed: int = 1234) -> ToyLM:
    return ToyLM(n, seq_len, vocab, seed)


class Regression(Samples):
    def __init__(self, n: int = 64, dim: int = 8):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.randn(dim, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)


def regression(n: int = 64, dim: int = 8) -> Regression:
    return Regression(n, dim)


def mlp(dim: int = 8, hidden: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def mean_of_means(output, target):
    """The 2024 accumulation bug as a loss: each micro-batch's mean counts as one item."""
    logits = output.reshape(-1, output.shape[-1])
    return torch.nn.functional.cross_entropy(logits, target.reshape(-1), ignore_index=-100), 1


mean_of_means.count = lambda target: 1


def _gpt_acting_at(gpt_args: dict, act) -> nn.Module:
    """The built-in GPT calling ``act(n)`` before its n-th training forward (the start-of-run
    probe's forwards, without grad, are not training forwards and are not counted)."""
    from paratrain.models import build_gpt

    model = build_gpt(**gpt_args)
    calls = [0]

    def hook(module, args):
        if torch.is_grad_enabled():
            calls[0] += 1
            act(calls[0])

    model.register_forward_pre_hook(hook)
    return model


def gpt_killed_at(kill_at_step: int = 0, kill_rank: int = 1, **gpt_args) -> nn.Module:
    """The built-in GPT, plus a test-only failure: on the first attempt of a torchrun job (no
    restart yet), rank ``kill_rank`` SIGKILLs itself in the forward of step ``kill_at_step``
    (counting forwards, so use it without gradient accumulation). 0 never kills."""
    import os
    import signal

    def maybe_die(n):
        if (
            n == kill_at_step
            and int(os.environ.get("RANK", "-1")) == kill_rank
            and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        ):
            os.kill(os.getpid(), signal.SIGKILL)

    return _gpt_acting_at(gpt_args, maybe_die)


def gpt_stalled_at(
    stall_at_step: int = 0, stall_rank: int = 1, stall_s: float = 60.0, first_attempt_only: bool = False, **gpt_args
) -> nn.Module:
    """The built-in GPT, plus a test-only hang: rank ``stall_rank`` sleeps ``stall_s`` seconds
    in the forward of step ``stall_at_step`` (counting forwards), so its peers time out.
    ``first_attempt_only``: not in workers torchrun restarted."""
    import os
    import time

    def maybe_stall(n):
        restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        if n == stall_at_step and int(os.environ.get("RANK", "-1")) == stall_rank:
            if not (first_attempt_only and restarted):
                time.sleep(stall_s)

    return _gpt_acting_at(gpt_args, maybe_stall)


def gpt_sigterm_at(sigterm_at_forward: int = 0, sigterm_rank: int = 1, **gpt_args) -> nn.Module:
    """The built-in GPT, plus a test-only preemption: rank ``sigterm_rank`` sends itself SIGTERM
    in its forward number ``sigterm_at_forward`` (as if only its node, or only it, were signalled)."""
    import os
    import signal

    def maybe_signal(n):
        if n == sigterm_at_forward and int(os.environ.get("RANK", "-1")) == sigterm_rank:
            os.kill(os.getpid(), signal.SIGTERM)

    return _gpt_acting_at(gpt_args, maybe_signal)


def gpt_chaos(chaos_dir: str = "", forward_sleep_s: float = 0.2, **gpt_args) -> nn.Module:
    """``gpt_slow`` plus two faults benchmarks/resilience/chaos.py injects from outside through files in
    ``chaos_dir``, each taken (deleted) by the rank it names: ``hang-rank{R}`` makes rank R's next
    forward sleep an hour (its peers time out), ``enospc-rank{R}`` makes rank R's next checkpoint
    write fail with ENOSPC (the disk is full on that node only)."""
    import errno
    import os
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    def take(kind: str) -> bool:
        try:
            os.remove(os.path.join(chaos_dir, f"{kind}-rank{os.environ.get('RANK', '0')}"))
            return True
        except FileNotFoundError:
            return False

    def maybe_hang(module, args):
        if take("hang"):
            time.sleep(3600)

    write_data = FileSystemWriter.write_data

    def full(self, plan, planner):
        if take("enospc"):
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = full
    model = gpt_slow(forward_sleep_s, **gpt_args)
    model.register_forward_pre_hook(maybe_hang)
    return model


def gpt_slow(forward_sleep_s: float = 0.2, **gpt_args) -> nn.Module:
    """The built-in GPT, each forward slowed by ``forward_sleep_s`` (the math is unchanged), so a
    test can signal a run mid-way."""
    import time

    from paratrain.models import build_gpt

    model = build_gpt(**gpt_args)
    model.register_forward_pre_hook(lambda module, args: time.sleep(forward_sleep_s))
    return model


class ResidualMLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """A user's token model with its blocks in `layers`, for tensor-parallel plans in TOML."""

    def __init__(self, vocab: int = 32, d: int = 32, hidden: int = 64, n_layer: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([ResidualMLP(d, hidden) for _ in range(n_layer)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def tiny_lm(vocab: int = 32, d: int = 32, hidden: int = 64, n_layer: int = 2) -> TinyLM:
    return TinyLM(vocab, d, hidden, n_layer)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def gpt_skewed_grad(factor: float = 3.0, **gpt_args) -> nn.Module:
    """A deliberately broken layout, from the user's side: on every rank but 0 the gradient that
    flows back out of block 0 is multiplied by ``factor`` (the forward is unchanged), as a rank
    with a bad gradient would do. One process (rank 0) computes the true model."""
    import torch.distributed as dist

    from paratrain.models import build_gpt

    model = build_gpt(**gpt_args)

    def hook(module, args, output):
        rank = dist.get_rank() if dist.is_initialized() else 0
        return _ScaleGrad.apply(output, factor) if rank != 0 else output

    model.layers["0"].register_forward_hook(hook)
    return model


def tiny_lm_tp_plan(model: nn.Module, tp_mesh) -> dict:
    """A tensor-parallel plan in Python (parallel.tp_plan_factory) for TinyLM."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"emb": RowwiseParallel(input_layouts=Replicate()), "head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.layers)):
        plan[f"layers.{i}.fc1"] = ColwiseParallel()
        plan[f"layers.{i}.fc2"] = RowwiseParallel()
    return plan


def sse_miscounted(output, target):
    """A user loss whose returned count (2 per sample) disagrees with its count(target) (1)."""
    return ((output - target) ** 2).sum(), 2 * target.shape[0]


sse_miscounted.count = lambda target: target.shape[0]


def ce_miscounted(logits, target):
    """A token loss whose returned count (twice the tokens) disagrees with its count(target)."""
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), target.flatten(), reduction="sum")
    return loss, 2 * target.numel()


ce_miscounted.count = lambda target: torch.tensor(float(target.numel()))


def gpt_slow_rank(slow_rank: int = 1, sleep_s: float = 0.05, **gpt_args) -> nn.Module:
    """The built-in GPT, plus a test-only straggler: rank ``slow_rank`` sleeps ``sleep_s`` seconds
    in every forward, as a rank on a slower device would."""
    import os
    import time

    from paratrain.models import build_gpt

    model = build_gpt(**gpt_args)

    def slow(module, args):
        if int(os.environ.get("RANK", "0")) == slow_rank:
            time.sleep(sleep_s)

    model.register_forward_pre_hook(slow)
    return model


def gpt_scaled_grad(factor: float = 2.0, **gpt_args) -> nn.Module:
    """A deliberately broken layout whose whole gradient is off by a constant: when the job has
    more than one process, the gradient flowing back out of the logits is multiplied by
    ``factor`` on every rank (the forward is unchanged), as a dropped ``dp`` factor would do.
    One process computes the true model. AdamW (invariant to a constant gradient factor) and
    clipping hide this; plain SGD and the logged grad_norm do not."""
    import torch.distributed as dist

    from paratrain.models import build_gpt

    model = build_gpt(**gpt_args)

    def hook(module, args, output):
        multi = dist.is_initialized() and dist.get_world_size() > 1
        return _ScaleGrad.apply(output, factor) if multi else output

    model.register_forward_hook(hook)
    return model


# --- models and data that draw random numbers (tests/distributed/test_randomness.py, issue 35) -----------


class Tagger(nn.Module):
    """A token tagger with two ``nn.Dropout``: what most user models hold."""

    def __init__(self, vocab: int = 32, dim: int = 32, p: float = 0.1):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.drop_in = nn.Dropout(p)
        self.hidden = nn.Linear(dim, dim)
        self.drop_out = nn.Dropout(p)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.drop_in(self.emb(x))))
        return self.head(self.drop_out(h))


def tagger(vocab: int = 32, dim: int = 32, p: float = 0.1) -> nn.Module:
    return Tagger(vocab, dim, p)


class Augmented(Samples):
    """Small images whose ``__getitem__`` draws a random flip, shift and noise from torch's,
    Python's and numpy's global RNGs, as torchvision-style transforms do."""

    def __init__(self, n: int = 64, size: int = 8, classes: int = 4):
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, 1, size, size, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __getitem__(self, i):
        import random

        import numpy as np

        x = self.x[i]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        x = torch.roll(x, random.randint(-2, 2), dims=-1)
        return x + torch.from_numpy(np.random.normal(0.0, 0.1, x.shape)).float(), self.y[i]


def augmented(n: int = 64, size: int = 8, classes: int = 4) -> Augmented:
    return Augmented(n, size, classes)


def small_cnn(size: int = 8, classes: int = 4, p: float = 0.1) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Dropout(p),
        nn.Linear(4 * size * size, classes),
    )


class DropPath(nn.Module):
    """Per-sample stochastic depth as timm writes it: one Bernoulli draw per row, in place."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not self.p:
            return x
        keep = x.new_empty(x.shape[0], *([1] * (x.dim() - 1))).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class DeepTagger(nn.Module):
    """Residual blocks dropped per sample (DropPath 0.3) with Gaussian input noise (randn_like)."""

    def __init__(self, vocab: int = 32, dim: int = 32, depth: int = 3, p: float = 0.3):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.drop_path = DropPath(p)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + 0.1 * torch.randn_like(h)
        for block in self.blocks:
            h = h + self.drop_path(torch.tanh(block(h)))
        return self.head(h)


def deep_tagger(vocab: int = 32, dim: int = 32, depth: int = 3, p: float = 0.3) -> nn.Module:
    return DeepTagger(vocab, dim, depth, p)


# --- batch math (models/batch_norm.py, objectives/batch_loss.py) ------------------------------


class Images(Samples):
    """Fixed small images and labels, no augmentation."""

    def __init__(self, n: int = 64, size: int = 6, classes: int = 4):
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(n, 2, size, size, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)


def images(n: int = 64, size: int = 6, classes: int = 4) -> Images:
    return Images(n, size, classes)


def bn_cnn(size: int = 6, classes: int = 4, momentum: float | None = 0.1) -> nn.Module:
    """A user's small CNN with BatchNorm2d (the issue's first model)."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=momentum),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * size * size, classes),
    )


class Pairs(Samples):
    """(query, document) feature pairs: the document is a noisy copy of its query."""

    def __init__(self, n: int = 64, dim: int = 8):
        g = torch.Generator().manual_seed(12)
        q = torch.randn(n, dim, generator=g)
        self.x = torch.stack([q, q + 0.5 * torch.randn(n, dim, generator=g)], dim=1)
        self.y = torch.zeros(n, dtype=torch.long)  # no label: the loss pairs the batch's rows


def pairs(n: int = 64, dim: int = 8) -> Pairs:
    return Pairs(n, dim)


class DualEncoder(nn.Module):
    """One tower for queries and documents (BatchNorm1d inside, called twice per forward), and
    optionally CLIP's learnable log logit scale."""

    def __init__(
        self, dim: int = 8, hidden: int = 16, out: int = 8, batch_norm: bool = True, scale: bool = False, p: float = 0.0
    ):
        super().__init__()
        norm = nn.BatchNorm1d(hidden) if batch_norm else nn.Identity()
        self.tower = nn.Sequential(nn.Linear(dim, hidden), norm, nn.ReLU(), nn.Dropout(p), nn.Linear(hidden, out))
        self.logit_scale = nn.Parameter(torch.tensor([2.0])) if scale else None  # 1-d: FSDP2 shards no 0-dim

    def forward(self, x):
        q, d = self.tower(x[:, 0]), self.tower(x[:, 1])
        # open_clip's convention: the scale itself (a new tensor: FSDP2 frees an unsharded parameter's
        # storage after the forward, so a parameter returned as it is would be read freed)
        return (q, d) if self.logit_scale is None else (q, d, self.logit_scale.exp())


def dual_encoder(
    dim: int = 8, hidden: int = 16, out: int = 8, batch_norm: bool = True, scale: bool = False, p: float = 0.0
):
    return DualEncoder(dim, hidden, out, batch_norm, scale, p)


def in_batch_mean_loss(output, target):
    """A user's own loss over the whole global batch: InfoNCE one way, temperature 0.1."""
    q, d = (torch.nn.functional.normalize(t, dim=-1) for t in output[:2])
    logits = q @ d.T / 0.1
    return torch.nn.functional.cross_entropy(logits, torch.arange(len(q)))


class HFResNet(nn.Module):
    """transformers' ResNet (six BatchNorm2d), as a user wraps it: images in, logits out."""

    def __init__(self):
        super().__init__()
        from transformers import ResNetConfig, ResNetForImageClassification

        cfg = ResNetConfig(
            num_channels=2, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=4
        )
        self.net = ResNetForImageClassification(cfg)

    def forward(self, x):
        return self.net(pixel_values=x).logits


def hf_resnet() -> nn.Module:
    return HFResNet()
