"""Chance keyed by the sample: every random draw of a run is a pure function of (run seed, epoch,
global sample index, call site, position in the sample's tensor), never of the rank, the
micro-batch's shape, the loader's workers or how many draws came before (docs/randomness.md).

Two places draw:

- **the data**: a dataset's ``__getitem__(i)`` (a torchvision-style augmentation from the global
  RNGs) runs under :func:`sample_rng`, with torch's CPU generator, numpy's and Python's global RNG
  seeded from the sample's key and restored afterwards, so the augmented sample is the same on
  every layout and after a resume, with no change to the user's code;
- **the model**: dropout masks (``nn.Dropout``, ``F.dropout``, the dropout of
  ``scaled_dot_product_attention``) are drawn by :class:`KeyedDraws` from the key of the row they
  belong to and the element's position in that row, so splitting the batch into micro-batches or
  data-parallel ranks, FSDP2 and activation-checkpoint recomputation all see the same mask.

Why a generator per row, seeded by a key: a row's draws then depend on its key alone, never on
which rows share its micro-batch or rank. The key is a hash of (seed, epoch, sample index, site)
(murmur3's 32-bit finaliser, in Python on a few integers per row); the row's values come from
torch's own generator of the device (Philox on CUDA, Mersenne twister on CPU), drawn whole, so a
shard of a row (a tensor-parallel slice) is a slice of the same draw. An integer hash of every
element in torch ops (counter-based, as Philox, Salmon et al. 2011) would draw any element alone,
but measured here it was 65 times slower than ``torch.rand`` on CPU (4M elements: 0.84 s against
0.013 s, one thread), while seeding a generator per row costs about what ``torch.rand`` does
(0.013 s for 64 rows). The masks differ between CPU and CUDA (other generators); each device
is layout-exact on its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack, _pop_mode, _push_mode
from torch.utils.data import TensorDataset

from paratrain.config import ConfigError

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: consecutive counters land far apart before the mix


def _fmix32_int(h: int) -> int:
    """:func:`fmix32` of one Python int (the same function: the products are taken mod 2^32)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def key_of(*words: int) -> int:
    """A 32-bit key from integers (the run seed, an epoch, a sample index, a site), each folded
    in as two 32-bit halves."""
    h = 0x3C6EF372
    for w in words:
        w = int(w) & 0xFFFFFFFFFFFFFFFF
        for half in (w & MASK32, w >> 32):
            h = _fmix32_int(((h ^ half) * GOLDEN) & MASK32)
    return h


def site_of(name: str) -> int:
    """A call site's 32-bit id from its name (a module's qualified name and call ordinal)."""
    return zlib.crc32(name.encode())


def row_keys(seed: int, samples: list[tuple[int, int]]) -> torch.Tensor:
    """The keys of a micro-batch's rows from their ``(epoch, dataset index)``: int64 (rows,)."""
    return torch.tensor([key_of(seed, epoch, index) for epoch, index in samples], dtype=torch.int64)


_GENERATORS = threading.local()


def _generator(device: torch.device) -> torch.Generator:
    """One generator per device and thread, reseeded for every row (creating one costs more than
    seeding). Per thread: GRPO's stale rounds sample in a background thread while the step draws
    its dropout masks (objectives/rl/stale.py), and a shared one would be reseeded under them."""
    cache = _GENERATORS.__dict__
    if device not in cache:
        cache[device] = torch.Generator(device=device)
    return cache[device]


def uniform(keys: torch.Tensor, site: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``(rows, n)`` float32 uniforms in [0, 1): row ``r`` is a function of ``keys[r]`` and
    ``site`` alone, drawn whole by torch's own generator of ``device`` seeded with their key."""
    g = _generator(torch.device(device))
    out = torch.empty(keys.numel(), n, device=device)
    for r, k in enumerate(keys.tolist()):
        g.manual_seed(key_of(k, site))
        out[r].uniform_(generator=g)
    return out


def keep_mask(keys: torch.Tensor, site: int, shape: torch.Size, p: float, device: torch.device) -> torch.Tensor:
    """The keep mask (bool, ``shape``) of dropout with drop rate ``p``: rows are ``shape[0]``."""
    n = 1
    for s in shape[1:]:
        n *= s
    return (uniform(keys, site, n, device) >= p).view(shape)


def keyed_dropout(x: torch.Tensor, p: float, keys: torch.Tensor, site: int) -> torch.Tensor:
    """``F.dropout(x, p)`` in train mode with the mask of :func:`keep_mask` (the same scaling,
    ``1 / (1 - p)`` on the kept elements)."""
    if p >= 1.0:
        return x * 0.0
    keep = keep_mask(keys, site, x.shape, p, x.device)
    if isinstance(x, DTensor):  # sequence parallel: this rank's slice of the whole rows' mask
        shape, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
        local = keep[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        keep = DTensor.from_local(local, x.device_mesh, x.placements, run_check=False)
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


def head_shard(module: nn.Module) -> tuple[int, int] | None:
    """``(rank, tp)`` when ``module``'s projections are split by output features over a
    tensor-parallel mesh (colwise: whole heads, their weight a DTensor sharded on dim 0), so its
    attention holds heads ``rank * local .. (rank + 1) * local`` of ``local * tp``; None otherwise."""
    for child in module.children():
        weight = getattr(child, "weight", None)
        if isinstance(weight, DTensor):
            for dim, placement in enumerate(weight.placements):
                if isinstance(placement, Shard) and placement.dim == 0:
                    return weight.device_mesh.get_local_rank(dim), weight.device_mesh.size(dim)
    return None


# --- the data: a sample's __getitem__ under its own seeds ------------------------------------


@contextlib.contextmanager
def kept_rngs() -> Iterator[None]:
    """Torch's CPU generator (and CUDA's, once initialised), numpy's and Python's global RNG as
    they were before the body (numpy only when installed: it is optional for paratrain)."""
    try:
        import numpy as np
    except ImportError:
        np = None
    cpu, py = torch.random.get_rng_state(), random.getstate()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    npy = np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(py)
        if np is not None:
            np.random.set_state(npy)


@contextlib.contextmanager
def sample_rng(seed: int, epoch: int, index: int) -> Iterator[int]:
    """Torch's CPU generator, numpy's and Python's global RNG seeded from the sample's key for
    the body, then restored: ``dataset[i]`` under it draws the same on every layout. Yields the
    key (a user's dataset can also take it explicitly: docs/randomness.md)."""
    key = key_of(seed, epoch, index, site_of("data"))
    with kept_rngs():
        torch.random.default_generator.manual_seed(key)
        random.seed(key)
        try:
            import numpy as np

            np.random.seed(key)
        except ImportError:  # numpy is optional for paratrain itself
            pass
        yield key


def draws_random(dataset) -> bool:
    """False for a dataset that says it draws nothing (``draws_random = False``, paratrain's own
    token datasets), which then skips :func:`sample_rng`'s cost; True otherwise."""
    while True:
        if type(dataset) is TensorDataset:  # in-memory tensors: indexing draws nothing
            return False
        if hasattr(dataset, "draws_random"):
            return bool(dataset.draws_random)
        inner = getattr(dataset, "dataset", None)
        if inner is None:
            return True
        dataset = inner


# --- the model: dropout masks keyed by the row ------------------------------------------------

# Wrappers that insert a name segment without changing the model (DDP's ``module``, activation
# checkpointing's and torch.compile's): a site's name must be the same on every layout.
_WRAPPER_SEGMENTS = {"module", "_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"}


def site_names(model: nn.Module) -> dict[int, str]:
    """id(module) -> its qualified name without wrapper segments."""
    return {
        id(m): ".".join(s for s in name.split(".") if s not in _WRAPPER_SEGMENTS) for name, m in model.named_modules()
    }


def has_dropout(model: nn.Module) -> bool:
    """Whether ``model`` draws dropout in training: an ``nn.Dropout`` with p > 0, or a module whose
    config or attribute says a dropout rate > 0 (the GPT's attention, a ``transformers`` config's
    ``*dropout*`` and ``*_pdrop`` rates, PEFT's ``lora_dropout`` modules)."""
    configs = set()  # a transformers model's modules share one config: read it once
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if isinstance(getattr(m, "dropout", None), float) and m.dropout > 0:
            return True
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "to_dict") and id(config) not in configs:
            configs.add(id(config))
            for k, v in config.to_dict().items():
                if ("dropout" in k or k.endswith("_pdrop")) and isinstance(v, float) and v > 0:
                    return True
    return False


# The draws KeyedDraws keys besides dropout, when their tensor's first dimension is the rows.
_ROW_DRAWS = (torch.rand, torch.randn, torch.rand_like, torch.randn_like, torch.bernoulli, torch.Tensor.bernoulli_)


# Every function that draws from a generator (torch 2.13's random sampling ops and in-place
# samplers), for the detector below.
_ANY_DRAWS = (
    *_ROW_DRAWS,
    torch.randint,
    torch.randint_like,
    torch.randperm,
    torch.normal,
    torch.poisson,
    torch.multinomial,
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
    torch.Tensor.multinomial,
    F.alpha_dropout,
    F.feature_alpha_dropout,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
)


@dataclasses.dataclass
class Draws:
    """What a forward draws (:func:`draws_in_forward`): the first draw's name, and the first draw
    the keyed path leaves to the global generator (its name and shape), None when it keys them all."""

    first: str
    unkeyed: str | None = None
    why: str = ""  # why ``unkeyed`` is not keyed

    def __str__(self) -> str:
        """The start-up line's words: "keyed by the sample" only when every draw seen is."""
        if self.unkeyed is None:
            return f"the forward draws ({self.first}): keyed by the sample"
        # Said as keyed before the probe found it unkeyed (issue 60): a draw whose first
        # dimension is not the rows is not one of KeyedDraws' (_row_draw returns None for it).
        return (
            f"the forward draws ({self.first}); {self.unkeyed} is not keyed by the sample ({self.why}): its numbers"
            " may depend on the layout, which the layout probe checks"
        )


class _DrawDetector(TorchFunctionMode):
    """Records the first random draw of a forward (its function's name) and the first one that
    :class:`KeyedDraws` would not key for ``rows`` rows; runs everything as is."""

    def __init__(self, rows: int):
        super().__init__()
        self.rows, self.first, self.unkeyed, self.why = rows, None, None, ""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training and p:
                self.first = self.first or "dropout"  # keyed, or refused in one line (KeyedDraws._check_rows)
        elif func is F.scaled_dot_product_attention:
            if _sdpa_reference(*args, **kwargs)[4]:
                self.first = self.first or "attention dropout"
        elif func in _ANY_DRAWS and "generator" not in kwargs:
            name = getattr(func, "__name__", str(func))
            self.first = self.first or name
            if self.unkeyed is None and not _keyed_row_draw(func, args, kwargs, self.rows):
                out = func(*args, **kwargs)
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else ()
                self.unkeyed = f"{name} of shape {shape}"
                self.why = (
                    f"its first dimension is not the micro-batch's {self.rows} rows"
                    if func in _ROW_DRAWS
                    else "the keyed path takes rand, randn, their _like forms and bernoulli of the rows"
                )
                return out
        return func(*args, **kwargs)


def _keyed_row_draw(func, args, kwargs, rows: int) -> bool:
    """Whether :meth:`KeyedDraws._row_draw` keys this draw (the same tests): one of ``_ROW_DRAWS``
    over a tensor whose first dimension is the micro-batch's ``rows``."""
    if func not in _ROW_DRAWS:
        return False
    if func in (torch.rand, torch.randn):
        size = tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
        return bool(size) and size[0] == rows and kwargs.get("out") is None
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != rows:
        return False
    p = args[1] if len(args) > 1 else kwargs.get("p")
    return not isinstance(p, torch.Tensor)


def draws_in_forward(model: nn.Module, inputs) -> Draws | None:
    """What ``model``'s train-mode forward on ``inputs`` draws (:class:`Draws`), or None when it
    draws nothing: what no static look at a model can tell (noise, stochastic depth, a user's own
    sampling). No gradient; the generators' states are as before afterwards."""
    devices = [inputs.device] if isinstance(inputs, torch.Tensor) and inputs.device.type == "cuda" else []
    first = next(iter(t for t in _tensors_of(inputs)), None)
    detector = _DrawDetector(rows=first.shape[0] if first is not None and first.dim() else 0)
    with torch.random.fork_rng(devices=devices), torch.no_grad(), detector:
        model(inputs)
    return None if detector.first is None else Draws(detector.first, detector.unkeyed, detector.why)


def _tensors_of(obj):
    """The tensors of a batch's inputs (a tensor, or a tuple, list or dict of them), in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors_of(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors_of(o)


def _sdpa_reference(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The arguments of ``scaled_dot_product_attention``, by name."""
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class KeyedDraws(TorchFunctionMode):
    """While active, ``F.dropout`` and the dropout of ``scaled_dot_product_attention`` draw their
    masks from the rows' keys (:func:`keyed_dropout`). A draw's site is the module running it (its
    qualified name, wrappers left out) and the call's ordinal within that module's forward, found
    by global forward hooks; a recomputation (activation checkpointing) reruns the module's
    forward and so draws the same site again, and the same mask."""

    def __init__(self, names: dict[int, str], keys: torch.Tensor, sequence: tuple[torch.Tensor, int] | None = None):
        super().__init__()
        self.names, self.keys = names, keys
        # Context parallel: (the whole-sequence index of each of this rank's tokens, the whole
        # length). A tensor whose dim 1 is this rank's tokens (a hidden state) takes those
        # positions of the whole row's mask.
        self.sequence = sequence
        # [module name, draws so far, pushed the mode, the keys to restore] of the modules running
        self.stack: list[list] = []
        # The keys each module call ran with, by its first input (alive while its recomputation
        # may come): under a pipeline the stages' forwards of other micro-batches run between a
        # forward and its recomputation, each with its own keys.
        self.by_input: dict[int, torch.Tensor] = {}

    def _pre(self, module, args) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        # An activation checkpoint's recomputation runs in the backward, where the autograd
        # engine does not carry torch-function modes (torch 2.13): the recomputed module's
        # forward hook puts this mode back on for its own forward, so it draws the same masks.
        pushed = not any(m is self for m in _get_current_function_mode_stack())
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        restore = self.keys
        if pushed:
            _push_mode(self)
            if first is not None:
                self.keys = self.by_input.get(id(first), self.keys)
        elif first is not None:
            self.by_input[id(first)] = self.keys
        self.stack.append([name, 0, pushed, restore, module])

    def _post(self, module, args, output) -> None:
        if self.names.get(id(module)) is not None and self.stack:
            _, _, pushed, self.keys, _ = self.stack.pop()
            if pushed:
                _pop_mode()

    def set_keys(self, keys: torch.Tensor) -> None:
        """The rows' keys of the forward about to run (a pipeline stage's micro-batch)."""
        self.keys = keys

    def site(self) -> int:
        name, k = self.stack[-1][:2] if self.stack else ("", 0)
        if self.stack:
            self.stack[-1][1] += 1
        return site_of(f"{name}#{k}")

    def _check_rows(self, x: torch.Tensor, what: str) -> None:
        if x.dim() == 0 or x.shape[0] != self.keys.numel():
            where = self.stack[-1][0] if self.stack else "the model"
            raise ConfigError(
                f"{what} in {where or 'the model'} got a tensor of shape {tuple(x.shape)} whose first dimension is not"
                f" the micro-batch's {self.keys.numel()} rows, so its mask cannot be keyed by the sample; put the batch"
                " first, or set run.keyed_random = false (each rank's own RNG: not layout-exact)"
            )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta":
            return func(*args, **kwargs)  # shape inference (a pipeline stage's first run) draws nothing
        if func is F.dropout:
            x = args[0]
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if not training or p == 0:
                return x
            self._check_rows(x, "dropout")
            if self._sequence_sharded(x):
                index, length = self.sequence
                whole = keep_mask(self.keys, self.site(), (x.shape[0], length, *x.shape[2:]), p, x.device)
                return x * whole[:, index.to(x.device)].to(x.dtype) * (1.0 / (1.0 - p))
            return keyed_dropout(x, p, self.keys, self.site())
        if func is F.scaled_dot_product_attention:
            q, k, v, mask, p, causal, scale, gqa = _sdpa_reference(*args, **kwargs)
            if p:
                self._check_rows(q, "attention dropout")
                return self._attention(q, k, v, mask, p, causal, scale, gqa)
        if func in _ROW_DRAWS and "generator" not in kwargs:  # a draw given its own generator is the user's
            out = self._row_draw(func, args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _sequence_sharded(self, x) -> bool:
        """Whether ``x`` holds this context-parallel rank's part of each row along dim 1."""
        return (
            self.sequence is not None
            and not isinstance(x, DTensor)
            and x.dim() >= 2
            and x.shape[1] == self.sequence[0].numel()
        )

    def _row_draw(self, func, args, kwargs) -> torch.Tensor | None:
        """Other draws of a tensor whose first dimension is the micro-batch's rows, each row from
        its own key (per-sample stochastic depth draws ``x.new_empty(rows, 1, 1).bernoulli_(p)``;
        noise ``torch.randn_like(x)``); None for a draw of another shape (the layout probe finds
        it: docs/layout-probe.md)."""
        rows = self.keys.numel()
        if func in (torch.rand, torch.randn):
            size = tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
            if not size or size[0] != rows or kwargs.get("out") is not None:
                return None
            out = torch.empty(size, dtype=kwargs.get("dtype"), device=kwargs.get("device"))
            fill = "uniform_" if func is torch.rand else "normal_"
            return self._fill(out, lambda r, g: getattr(out[r], fill)(generator=g))
        x = args[0]
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != rows:
            return None
        if self._sequence_sharded(x):
            raise ConfigError(
                f"{func.__name__} of a tensor that holds part of each row under parallel.cp > 1 is not keyed by the"
                " sample; use dropout (keyed under cp), or set parallel.cp = 1"
            )
        if func in (torch.rand_like, torch.randn_like):
            out = torch.empty_like(x, dtype=kwargs.get("dtype"))
            fill = "uniform_" if func is torch.rand_like else "normal_"
            return self._fill(out, lambda r, g: getattr(out[r], fill)(generator=g))
        p = args[1] if len(args) > 1 else kwargs.get("p")
        if isinstance(p, torch.Tensor):
            return None
        if func is torch.Tensor.bernoulli_:  # in place, as stochastic depth writes it
            return self._fill(x, lambda r, g: x[r].bernoulli_(0.5 if p is None else p, generator=g))
        out = torch.empty_like(x)  # torch.bernoulli: each element with its own probability, or p
        if p is None:
            return self._fill(out, lambda r, g: out[r].copy_(torch.bernoulli(x[r], generator=g)))
        return self._fill(out, lambda r, g: out[r].copy_(torch.bernoulli(x[r], p, generator=g)))

    def _fill(self, out: torch.Tensor, draw) -> torch.Tensor:
        """``draw(r, generator)`` for each row r of ``out``, the generator seeded with the row's key
        and this call's site."""
        site = self.site()
        g = _generator(out.device)
        for r, k in enumerate(self.keys.tolist()):
            g.manual_seed(key_of(k, site))
            draw(r, g)
        return out

    def _attention(self, q, k, v, mask, p, causal, scale, gqa):
        """Attention with its probabilities dropped by the keyed mask (torch's math reference:
        softmax(q k^T scale + mask), dropout, times v)."""
        if gqa:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        if causal:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = torch.softmax(scores, dim=-1)
        if mask is not None and not causal:
            probs = torch.nan_to_num(probs, nan=0.0)  # a row that sees nothing (padding) attends to nothing
        if p >= 1.0:
            return probs.new_zeros(*probs.shape[:-1], v.shape[-1])
        keep = self.attention_keep(probs.shape, p, probs.device)
        # The 1 / (1 - p) scale on the (T x d) output rather than the (T x T) probabilities.
        return (probs * keep) @ v * (1.0 / (1.0 - p))

    def attention_keep(self, shape, p: float, device: torch.device) -> torch.Tensor:
        """The keep mask (bool, ``shape`` = (rows, local heads, queries, keys) of the whole
        sequence) of the attention running now: its heads' slice of the mask of every head,
        where tensor parallel (:func:`head_shard` of the module) and all-to-all context parallel
        (:func:`head_slice`) leave this rank some heads."""
        rows, local, t, s = shape
        offset, heads = _HEAD_SLICE[-1] if _HEAD_SLICE else (0, local)
        shard = head_shard(self.stack[-1][4]) if self.stack else None
        rank, tp = shard if shard is not None else (0, 1)
        whole = keep_mask(self.keys, self.site(), (rows, heads * tp, t, s), p, device)
        start = rank * heads + offset
        return whole[:, start : start + local]

    def __enter__(self):
        self.stack.clear()
        self.by_input.clear()
        self._hooks = (
            nn.modules.module.register_module_forward_pre_hook(self._pre),
            nn.modules.module.register_module_forward_hook(self._post),
        )
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)


# (offset, heads): the heads of the running attention module that this rank's attention holds
# (all-to-all context parallel: ``heads / cp`` of them from ``cp_rank * heads / cp``).
_HEAD_SLICE: list[tuple[int, int]] = []


@contextlib.contextmanager
def head_slice(offset: int, heads: int) -> Iterator[None]:
    """An attention within runs heads ``offset ..`` of the ``heads`` its module holds."""
    _HEAD_SLICE.append((offset, heads))
    try:
        yield
    finally:
        _HEAD_SLICE.pop()


def active_draws() -> KeyedDraws | None:
    """The keyed draws in effect (the mode on torch's stack), or None: an attention that does not
    go through ``scaled_dot_product_attention`` (the ring of context parallel) asks it for its
    mask (:meth:`KeyedDraws.attention_keep`)."""
    for mode in _get_current_function_mode_stack():
        if isinstance(mode, KeyedDraws):
            return mode
    return None


# The keyword that carries a pipeline micro-batch's row keys to every stage (the schedule cuts
# keyword tensors into micro-batches like the input and hands them to all stages).
STAGE_KEYS = "paratrain_draw_keys"


@contextlib.contextmanager
def maybe_keyed_stages(parts, names: dict[int, str] | None, keys: list[torch.Tensor] | None, split):
    """Keyed draws over a pipeline schedule's run: returns the ``split_inputs`` that adds the rows'
    keys (every micro-batch's, in order) to the keywords of every stage, whose forward pre-hook
    hands its micro-batch's keys to the mode. ``split`` unchanged when either is None."""
    if names is None or keys is None:
        yield split
        return
    all_keys = torch.cat(keys)
    mode = KeyedDraws(names, all_keys)

    def take_keys(module, args, kwargs):
        if STAGE_KEYS in kwargs:
            kwargs = dict(kwargs)
            mode.set_keys(kwargs.pop(STAGE_KEYS))
        return args, kwargs

    def split_with_keys(inputs):
        first, kwargs = split(inputs)
        return first, {**kwargs, STAGE_KEYS: all_keys}

    hooks = [p.register_forward_pre_hook(take_keys, with_kwargs=True, prepend=True) for p in parts]
    try:
        with mode:
            yield split_with_keys
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def maybe_keyed_draws(
    names: dict[int, str] | None, keys: torch.Tensor | None, sequence: tuple[torch.Tensor, int] | None = None
) -> Iterator[None]:
    """Draw the model's dropout from ``keys`` (the micro-batch's row keys) over a forward and its
    backward (which may recompute it); does nothing when either is None. ``sequence``: context
    parallel's (whole-sequence index of this rank's tokens, whole length)."""
    if names is None or keys is None:
        yield
        return
    with KeyedDraws(names, keys, sequence):
        yield
