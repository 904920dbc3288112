"""Built-in models, their specs, and the model builder (built-in name or user factory).

``resolve(cfg)`` is the one branch on ``model.hf`` / ``model.factory`` / ``model.name``;
``build(cfg) -> (model, spec)``: a built-in name has its registered ModelSpec; a user factory may
return a ModelSpec (then its ``build()`` makes the model) or a module (then the conventions of
models/spec.py apply: ``default_spec``). ``with_lora`` is where a non-HF model gets its adapters.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from paratrain.config import ConfigError, ModelConfig, check_kwargs, resolve_callable
from paratrain.models.gpt import GPT, GPT_SPEC, GPTConfig, build_gpt
from paratrain.models.hf import HFCausalLM, hf_spec, weight_files
from paratrain.models.hf.weights import file_tensors
from paratrain.models.lora import apply_lora, frozen_tensors, weights_sha256
from paratrain.models.spec import ModelSpec, default_spec

BUILTIN_SPECS: dict[str, ModelSpec] = {"gpt": GPT_SPEC}
BUILTIN_MODELS = {name: spec.build for name, spec in BUILTIN_SPECS.items()}


@dataclass(frozen=True)
class ModelSource:
    """Which model a ``[model]`` section means, decided once (``model.hf``, ``model.factory`` or a
    built-in ``model.name``): the config key that names it, the function that builds it from
    ``model.args``, and its spec when known without building (a factory's may be what it returns)."""

    key: str
    builder: Callable[..., object]
    spec: ModelSpec | None


def resolve(cfg: ModelConfig) -> ModelSource:
    """The one branch on hf / factory / name, with [model.args] checked against the builder."""
    if cfg.hf:
        spec = hf_spec(cfg)  # the directory's checks
        return ModelSource("model.hf", spec.build, spec)
    if cfg.factory:
        fn, key, spec = resolve_callable(cfg.factory, "model.factory"), "model.factory", None
    elif cfg.name in BUILTIN_SPECS:
        spec = BUILTIN_SPECS[cfg.name]
        fn, key = spec.build, "model.name"
    else:
        raise ConfigError(f"model.name = {cfg.name!r} is unknown; use one of {sorted(BUILTIN_MODELS)} or model.factory")
    # build_gpt forwards **kwargs to GPTConfig: its fields are what it accepts.
    accepted = inspect.signature(GPTConfig).parameters if fn is build_gpt else ()
    check_kwargs(fn, cfg.args, key, "model.args", accepted)
    return ModelSource(key, fn, spec)


def build(cfg: ModelConfig, *, meta_enabled: bool = True) -> tuple[nn.Module, ModelSpec]:
    """Build the model on CPU with its spec; the caller seeds the RNG first so the init is a
    function of the seed. A spec with ``materialize`` (pretrained weights) builds on the meta
    device: the weights arrive after the parallelisms, each rank reading its own shards.
    ``meta_enabled=False``: on the current device even then (the memory estimate builds under a
    fake mode, whose tensors must share the batches' device, and never reads weights)."""
    source = resolve(cfg)
    if cfg.hf:  # LoRA: build_hf applies it on the transformers model, before the wrapper takes its modules
        spec = source.spec
        with torch.device("meta") if spec.materialize and meta_enabled else contextlib.nullcontext():
            return spec.build(), spec
    made = source.builder(**cfg.args)
    if isinstance(made, ModelSpec):  # a factory that describes its model fully
        spec, made = made, made.build()
    else:
        spec = source.spec or default_spec(cfg.factory, source.builder)
    if not isinstance(made, nn.Module):
        raise ConfigError(
            f"{source.key} returned {type(made).__name__}, not a torch.nn.Module or ModelSpec; return the model"
        )
    return with_lora(made, cfg, spec), spec


def with_lora(model: nn.Module, cfg: ModelConfig, spec: ModelSpec) -> nn.Module:
    """``model`` with the LoRA adapters of ``model.lora`` (when enabled), its output layer left
    out: a built model and one passed to ``paratrain.train(model=...)`` alike."""
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora, exclude=(spec.head_attr,) if spec.head_attr else ())
    return model


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model of ``cfg`` alone (see :func:`build`)."""
    return build(cfg)[0]


def lora_base(cfg: ModelConfig, model: nn.Module) -> dict:
    """The identity of a LoRA run's frozen base, for its checkpoints' manifests (docs/lora.md): a
    sha256 of the full base tensors in name order, the same whatever the layout. A model whose
    weights are still to be read (``model.hf`` with weights, built on meta) is hashed from its
    safetensors files' tensors; any other from its frozen parameters as built, before any
    parallelism (the seed's init)."""
    if cfg.hf and any(p.is_meta for p in model.parameters()):
        return {"sha256": weights_sha256(file_tensors(weight_files(cfg.hf))), "of": f"the tensors of {cfg.hf}"}
    return {"sha256": weights_sha256(frozen_tensors(model)), "of": "the frozen parameters as built from the seed"}


def spec_of(cfg: ModelConfig, model: nn.Module | None = None) -> ModelSpec:
    """The spec of a model passed to ``paratrain.train(model=...)``, or of the config's built-in
    model, without building anything (a factory's spec needs :func:`build`)."""
    if cfg.hf and (model is None or isinstance(model, HFCausalLM)):
        return hf_spec(cfg)
    if model is None and not cfg.factory and cfg.name in BUILTIN_SPECS:
        return BUILTIN_SPECS[cfg.name]
    if isinstance(model, GPT):
        return GPT_SPEC
    if model is not None:
        return default_spec(type(model).__name__, lambda: model)
    source = resolve(cfg)
    return source.spec or default_spec(cfg.factory, source.builder)


__all__ = [
    "GPT",
    "GPTConfig",
    "ModelSpec",
    "build",
    "build_gpt",
    "build_model",
    "lora_base",
    "resolve",
    "spec_of",
    "with_lora",
    "BUILTIN_MODELS",
]
