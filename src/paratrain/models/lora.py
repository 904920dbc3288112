"""LoRA fine-tuning with PEFT's own adapters: ``[model.lora]`` (docs/lora.md).

``apply_lora`` hands the model to ``peft.inject_adapter_in_model`` with a ``peft.LoraConfig``
made from ``[model.lora]``: the adapters are PEFT's modules (``peft.tuners.lora.Linear`` around
each targeted layer: ``q_proj.base_layer``, ``q_proj.lora_A.default``, ``q_proj.lora_B.default``),
not a re-implementation, and PEFT marks only them (and ``modules_to_save``' trainable copies)
trainable; every other parameter is frozen (``requires_grad = False``), so the optimiser
(optim.py takes trainable parameters only) holds adapter state only, DDP reduces adapter
gradients only and FSDP2 reduce-scatters only those.

It runs right after the model is built (models/__init__.py ``build``), before any parallelism,
on every rank after the same seed. A model built on the meta device (``model.hf`` with
weights) has meta adapters too: their initial values are made here on the CPU with PEFT's own
``reset_lora_parameters`` (A kaiming-uniform, B zero), layer by layer in module order, and
returned by checkpoint name, for the loader to copy each rank's shard of them after the
parallelisms (models/hf/weights.py ``load_into``), as it copies the base weights from the files.

LoRA's math at step 0 is the base model's (B = 0); ``adapter_base_name`` maps PEFT's wrapper
names back to the base model's (``q_proj.base_layer.weight`` -> ``q_proj.weight``).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterable

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from paratrain.config import ConfigError, LoraConfig

ADAPTER = "default"  # PEFT's adapter name: one adapter per run
# Components PEFT inserts into parameter names: the wrapped base layer, modules_to_save's copies.
_BASE_PARTS = re.compile(r"\.(base_layer|original_module|modules_to_save\.default)(?=\.)")


def adapter_base_name(name: str) -> str:
    """The base model's name of a parameter of an adapted model (``...q_proj.base_layer.weight`` ->
    ``...q_proj.weight``; ``lm_head.modules_to_save.default.weight`` -> ``lm_head.weight``)."""
    return _BASE_PARTS.sub("", name)


def is_adapter_param(name: str) -> bool:
    """Whether ``name`` is a parameter LoRA trains (an adapter, or a modules_to_save copy)."""
    return ".lora_" in f".{name}" or ".modules_to_save." in f".{name}"


def weights_sha256(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over each tensor's name, dtype, shape and bytes, in the order given (callers sort by
    name): the identity of a LoRA run's frozen base, written into its checkpoints' manifests."""
    h = hashlib.sha256()
    for name, t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def frozen_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The frozen parameters of an adapted model under the base model's names, sorted by name."""
    return sorted(
        ((adapter_base_name(n), p) for n, p in model.named_parameters() if not p.requires_grad),
        key=lambda item: item[0],
    )


def import_peft():
    try:
        import peft  # an optional extra: paratrain[lora]
    except ImportError:
        raise ConfigError("model.lora needs peft, which is not installed: pip install 'paratrain[lora]'") from None
    return peft


def _target_modules(targets: list | str) -> list | str:
    """[model.lora] target_modules -> PEFT's: 'all-linear' and plain names as they are (PEFT matches
    a name against the end of a module's dotted name); with a glob (``*``, ``?``), one regular
    expression that PEFT full-matches, each item anchored at a dot like PEFT's names."""
    if isinstance(targets, str) or not any(c in t for t in targets for c in "*?"):
        return targets if isinstance(targets, str) else list(targets)
    parts = [re.escape(t).replace(r"\*", ".*").replace(r"\?", ".") for t in targets]
    return r"(?:.*\.)?(?:" + "|".join(parts) + ")"


def peft_lora_config(cfg: LoraConfig, *, exclude: tuple[str, ...] = (), keep_out: str | None = None):
    """The ``peft.LoraConfig`` of ``[model.lora]``; ``exclude``: module names 'all-linear' leaves
    out (the output layer of a model PEFT does not know as a transformers model); ``keep_out``: a
    regular expression of module names that get no adapter whatever target_modules says (a frozen
    vision tower, models/hf/vision.py lora_keep_out)."""
    peft = import_peft()
    return peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=_target_modules(cfg.target_modules),
        exclude_modules=keep_out or (list(exclude) if exclude and cfg.target_modules == "all-linear" else None),
        modules_to_save=list(cfg.modules_to_save) or None,
        bias="none",
    )


def _linear_names(model: nn.Module, limit: int = 8) -> str:
    names: list[str] = []
    for name, m in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if isinstance(m, nn.Linear) and short not in names:
            names.append(short)
    return ", ".join(names[:limit]) or "none"


def apply_lora(
    model: nn.Module, cfg: LoraConfig, *, exclude: tuple[str, ...] = (), keep_out: str | None = None
) -> dict[str, torch.Tensor]:
    """Inject PEFT's LoRA adapters into ``model`` in place and freeze everything else.

    Returns the adapters' initial values by parameter name when ``model`` is on the meta device
    (the caller's loader copies them in after the parallelisms), else {} (PEFT initialised them).
    """
    peft = import_peft()
    config = peft_lora_config(cfg, exclude=exclude, keep_out=keep_out)
    fake = any(is_fake(p) for p in model.parameters())
    try:
        with _adapters_stay_where_made() if fake else contextlib.nullcontext():
            peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:
        if any(
            m in str(e)
            for m in ("not found in the base model", "No modules were targeted", "All modules were excluded")
        ):
            raise ConfigError(
                f"model.lora.target_modules = {cfg.target_modules!r} matches no layer of the model; its linear"
                f" layers are named {_linear_names(model)}"
                + (
                    " (model.vision = 'freeze' keeps adapters out of the vision tower and projector)"
                    if keep_out
                    else ""
                )
            ) from None
        raise
    for wanted in cfg.modules_to_save:
        if not any(n == wanted or n.endswith(f".{wanted}") for n, m in model.named_modules() if _is_saved(m)):
            raise ConfigError(
                f"model.lora.modules_to_save names {wanted!r}, which matches no module of the model; name one such as"
                f" {_linear_names(model, 4)}"
            )
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    leaked = [n for n in trainable if not is_adapter_param(n)]
    if leaked:  # PEFT's contract; a base weight that trained would break "frozen"
        raise RuntimeError(f"LoRA left base parameters trainable: {leaked[:3]}")
    if not trainable:
        raise ConfigError(f"model.lora.target_modules = {cfg.target_modules!r} gave no trainable adapter")
    return _initial_adapters(model, config) if any(p.is_meta for p in model.parameters()) else {}


@contextlib.contextmanager
def _adapters_stay_where_made():
    """PEFT moves each new adapter to its base layer's device and dtype with ``Module.to``, which
    cannot convert fake parameters (torch 2.13 swaps a tensor subclass on conversion and refuses
    one with a weakref, as FakeTensorMode's are). Under the memory estimate's fake mode
    (batch/measure.py, plan/memory.py) the adapters are made on the base's fake device already:
    ``Module.to`` is a no-op while PEFT injects them."""
    original = nn.Module.to
    nn.Module.to = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        nn.Module.to = original


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """``model`` as its base alone: every LoRA layer's adapters off (a preference loss's
    reference, objectives/preference.py). PEFT's own switch (``disable_adapters``, read by each
    layer's forward) is set directly: ``enable_adapters`` would also flip the adapters'
    ``requires_grad``, which DDP and FSDP2 have already taken as the parameters to reduce."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ConfigError("preference.reference = 'adapters_off' needs LoRA adapters; enable model.lora")
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def _is_saved(module: nn.Module) -> bool:
    return type(module).__name__ == "ModulesToSaveWrapper"


@torch.no_grad()
def _initial_adapters(model: nn.Module, config) -> dict[str, torch.Tensor]:
    """PEFT's own init of every adapter of a meta model, on the CPU, in module order (the same
    values on every rank after the same seed), by parameter name; the adapters stay on meta."""
    from peft.tuners.lora import LoraLayer

    values: dict[str, torch.Tensor] = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        dicts = [(a, getattr(layer, a)) for a in layer.adapter_layer_names if ADAPTER in getattr(layer, a, {})]
        for _, d in dicts:
            _move(d, lambda t: torch.empty_like(t, device="cpu"))
        layer.reset_lora_parameters(ADAPTER, config.init_lora_weights)
        for attr, d in dicts:
            entry = d[ADAPTER]
            named = entry.named_parameters() if isinstance(entry, nn.Module) else [("", entry)]
            for pname, p in named:
                values[".".join(filter(None, (name, attr, ADAPTER, pname)))] = p.detach().clone()
            _move(d, lambda t: t.to("meta"))
    return values


def _move(d: nn.Module, make) -> None:
    """Replace the ``ADAPTER`` entry's tensors of a ModuleDict (lora_A: Linear) or ParameterDict
    (lora_embedding_A) by ``make(tensor)``, as parameters that keep their requires_grad."""
    entry = d[ADAPTER]
    if isinstance(entry, nn.Module):
        for m in entry.modules():
            for k, p in m._parameters.items():
                if p is not None:
                    m._parameters[k] = nn.Parameter(make(p.detach()), requires_grad=p.requires_grad)
    else:
        d[ADAPTER] = nn.Parameter(make(entry.detach()), requires_grad=entry.requires_grad)


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter counts, as PEFT's ``get_nb_trainable_parameters`` counts them."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())
