"""Built-in models and the model builder (built-in name or user factory)."""

from __future__ import annotations

import inspect

from torch import nn

from paratrain.config import ConfigError, ModelConfig, resolve_callable
from paratrain.models.gpt import GPT, GPTConfig, build_gpt

BUILTIN_MODELS = {"gpt": build_gpt}


def model_builder(cfg: ModelConfig):
    """The builder and its config key, with [model.args] checked against its signature."""
    if cfg.factory:
        fn, key = resolve_callable(cfg.factory, "model.factory"), "model.factory"
    elif cfg.name in BUILTIN_MODELS:
        fn, key = BUILTIN_MODELS[cfg.name], "model.name"
    else:
        raise ConfigError(f"model.name = {cfg.name!r} is unknown; use one of {sorted(BUILTIN_MODELS)} or model.factory")
    _check_kwargs(fn, cfg.args, key, "model.args")
    return fn, key


def build_model(cfg: ModelConfig) -> nn.Module:
    """Build the model on CPU; the caller seeds the RNG first so the init is a function of the seed."""
    fn, key = model_builder(cfg)
    model = fn(**cfg.args)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{key} returned {type(model).__name__}, not a torch.nn.Module; return the model")
    return model


def _check_kwargs(fn, args: dict, key: str, args_key: str) -> None:
    """Name an unknown keyword argument before calling, instead of a TypeError traceback."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    params = sig.parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        if fn is build_gpt:
            params = inspect.signature(GPTConfig).parameters
        else:
            return
    for name in args:
        if name not in params:
            raise ConfigError(f"{args_key}.{name} is not accepted by {key}; accepted: {', '.join(params)}")


__all__ = ["GPT", "GPTConfig", "build_gpt", "build_model", "BUILTIN_MODELS"]
