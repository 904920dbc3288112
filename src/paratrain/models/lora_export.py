"""A LoRA checkpoint's adapters as PEFT's own formats (``paratrain export --peft`` / ``--hf --merge``).

The checkpoint holds the adapters under paratrain's parameter names (PEFT's module names inside
the model paratrain trains: ``layers.0.self_attn.q_proj.lora_A.default.weight``). Both exports let
PEFT do the conversion rather than re-implementing its file format: the base model is built on
the meta device (no memory), PEFT's ``get_peft_model`` wraps it with the run's ``LoraConfig``, and

- ``export_peft``: PEFT's ``get_peft_model_state_dict`` turns the adapters, under the
  PeftModel's names, into the keys ``PeftModel.from_pretrained`` reads (adapter name removed,
  ``modules_to_save`` copies under their module's name); the config is PEFT's
  ``LoraConfig.save_pretrained`` (``adapter_config.json``), the tensors ``adapter_model.safetensors``.
- ``export_merged``: the base weights are read from the model.hf directory, PEFT loads the
  adapters (``set_peft_model_state_dict``) and merges them (``merge_and_unload``: W + B A x
  alpha / r, modules_to_save's copies in place of the originals); the result is written as a
  transformers directory like ``export --hf`` does.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch
from safetensors.torch import save_file
from torch import nn

from paratrain.config import ConfigError, LoraConfig, ModelConfig
from paratrain.models import build
from paratrain.models.hf import HFCausalLM
from paratrain.models.hf.model import causal_lm_from_config, load_hf_config
from paratrain.models.hf.vision import (
    HFVisionLM,
    copy_processor,
    image_text_model_from_config,
    is_vision_dir,
    lora_keep_out,
)
from paratrain.models.hf.weights import file_tensors, quiet_progress, save_hf, weight_files
from paratrain.models.lora import (
    ADAPTER,
    adapter_base_name,
    import_peft,
    is_adapter_param,
    peft_lora_config,
    weights_sha256,
)

PEFT_PREFIX = "base_model.model."  # a PeftModel's name for the model it wraps


def hf_model_of(model_cfg: ModelConfig):
    """(model.hf's transformers model on meta, paratrain name -> its name, the builder of its class):
    an image-text model (models/hf/vision.py) or a causal LM."""
    vision = is_vision_dir(model_cfg.hf)
    make = image_text_model_from_config if vision else causal_lm_from_config
    with torch.device("meta"):
        hf_model = make(load_hf_config(model_cfg.hf, model_cfg.args))
        names = (HFVisionLM if vision else HFCausalLM)(hf_model)
    return hf_model, names.hf_name, make


def _base_on_meta(model_cfg: ModelConfig):
    """(the base model PEFT wraps, on meta; paratrain name -> its name; 'all-linear' exclusions)."""
    if model_cfg.hf:
        hf_model, hf_name, _ = hf_model_of(model_cfg)
        return hf_model, hf_name, ()
    with torch.device("meta"):
        model, spec = build(dataclasses.replace(model_cfg, lora=LoraConfig()))
    return model, (lambda n: n), (spec.head_attr,) if spec.head_attr else ()


def peft_model_of(model_cfg: ModelConfig, adapters: dict[str, torch.Tensor], *, base_weights=None):
    """(PEFT's PeftModel of the run's base, the adapters under its state_dict names). The base stays
    on meta unless ``base_weights`` (its state dict) are given: then PEFT wraps the real model."""
    peft = import_peft()
    base, name_of, exclude = _base_on_meta(model_cfg)
    if base_weights is not None:
        # assign: the file tensors themselves, no second copy.
        missing, unexpected = base.load_state_dict(base_weights, strict=False, assign=True)
        if getattr(base.config, "tie_word_embeddings", False):
            base.tie_weights()
        missing = [k for k in missing if any(p.is_meta for n, p in base.named_parameters() if n == k)]
        if missing or unexpected:
            raise ConfigError(
                f"export --merge: the weights of {model_cfg.hf!r} do not fit its model: missing {missing[:3]},"
                f" unexpected {unexpected[:3]}"
            )
    with warnings.catch_warnings():  # transformers 5 deprecates a name PEFT still reads: not the user's concern
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        # An image-text model: the adapters where training put them (model.vision, models/hf/vision.py).
        keep_out = lora_keep_out(model_cfg, base.config) if model_cfg.hf else None
        config = peft_lora_config(model_cfg.lora, exclude=exclude, keep_out=keep_out)
        peft_model = peft.get_peft_model(base, config, adapter_name=ADAPTER)
    sd = {PEFT_PREFIX + name_of(k): v for k, v in adapters.items()}
    expected = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    if set(sd) != expected:  # the checkpoint's adapters are not this config's: say which
        raise ConfigError(
            f"the checkpoint's adapters do not fit its own [model.lora]: missing {sorted(expected - set(sd))[:3]},"
            f" unexpected {sorted(set(sd) - expected)[:3]}"
        )
    return peft_model, sd


def adapters_of(weights: dict[str, torch.Tensor], *, path: str, flag: str) -> dict[str, torch.Tensor]:
    adapters = {k: v for k, v in weights.items() if is_adapter_param(k)}
    if not adapters:
        raise ConfigError(
            f"export {flag}: checkpoint {path} holds no LoRA adapters (its run had no [model.lora]);"
            " export it with --to FILE or --hf DIR"
        )
    return adapters


def export_peft(
    adapters: dict[str, torch.Tensor],
    *,
    model_cfg: ModelConfig,
    out_dir: str,
    base_weights: dict[str, torch.Tensor] | None = None,
) -> tuple[int, str | None]:
    """Write a PEFT adapter directory that ``PeftModel.from_pretrained(base, out_dir)`` loads;
    returns the number of tensors written and the base ``adapter_config.json`` names (None: not
    a ``model.hf`` run). ``base_weights``: the frozen weights under paratrain's names (a finished
    run's model.safetensors), written as ``out_dir/base`` when model.hf holds no weights of its own
    (:func:`peft_base_path`)."""
    from peft.utils import get_peft_model_state_dict  # optional: paratrain[lora]

    peft_model, sd = peft_model_of(model_cfg, adapters)
    # save_embedding_layers: PEFT's guess adds whole embedding matrices when target_modules names one;
    # paratrain trains a full layer only through modules_to_save, which are in ``sd`` already.
    saved = get_peft_model_state_dict(peft_model, state_dict=sd, adapter_name=ADAPTER, save_embedding_layers=False)
    os.makedirs(out_dir, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in saved.items()},
        os.path.join(out_dir, "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    config = peft_model.peft_config[ADAPTER]
    base_path = None
    if model_cfg.hf:
        # What PEFT writes for a transformers causal LM, so that AutoPeftModelForCausalLM.from_pretrained(DIR)
        # finds its class and its base: the task, and the base directory as an absolute path (the config's
        # may be relative to wherever training ran).
        # An image-text model has no PEFT task of its own: PeftModel.from_pretrained onto
        # AutoModelForImageTextToText (docs/vision-language.md).
        config.task_type = None if is_vision_dir(model_cfg.hf) else "CAUSAL_LM"
        config.base_model_name_or_path = base_path = peft_base_path(model_cfg, out_dir, base_weights)
    config.inference_mode = True
    config.save_pretrained(out_dir)
    return len(saved), base_path


BASE_DIR = "base"  # export --peft: the base beside the adapter when model.hf has no weights


def peft_base_path(model_cfg: ModelConfig, out_dir: str, base_weights: dict[str, torch.Tensor] | None) -> str:
    """The base an adapter's ``base_model_name_or_path`` names: model.hf (absolute) when it holds
    weights, as PEFT itself writes it. A model.hf of a config and tokenizer only (a trial, like
    configs/sft/model) trained on a base made from the run's seed, which only the run's
    model.safetensors holds: with those weights at hand, they are written as a transformers
    directory ``out_dir/base`` (config and tokenizer copied from model.hf) and named instead, so
    ``AutoPeftModelForCausalLM.from_pretrained(out_dir)`` loads the very base the adapters trained
    on (issue 60). Without them (a checkpoint holds adapters only) model.hf is named as is."""
    hf = model_cfg.hf
    if not os.path.isdir(hf):
        return hf
    if base_weights is None or weight_files(hf):
        return os.path.abspath(hf)
    base_dir = os.path.join(out_dir, BASE_DIR)
    _save_transformers(hf_base_weights(model_cfg, base_weights), model_cfg=model_cfg, out_dir=base_dir)
    return os.path.abspath(base_dir)


def hf_base_weights(model_cfg: ModelConfig, base_weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA run's frozen weights (paratrain's names, PEFT's ``base_layer`` inside) under the
    transformers model's own names."""
    hf_name = hf_model_of(model_cfg)[1]
    return {hf_name(adapter_base_name(k)): v for k, v in base_weights.items()}


@torch.no_grad()
def export_merged(
    adapters: dict[str, torch.Tensor],
    *,
    model_cfg: ModelConfig,
    out_dir: str,
    base: dict | None = None,
    base_weights: dict[str, torch.Tensor] | None = None,
) -> nn.Module:
    """The base weights of model.hf with the adapters merged in by PEFT, as a transformers directory;
    ``base``: the checkpoint manifest's hash of the base it trained on, checked against the files.
    ``base_weights``: the frozen weights under paratrain's names (a finished run's model.safetensors
    holds the very base it trained on, also one made from the seed): merged into those instead."""
    if base_weights is not None:
        return _merge_and_save(adapters, hf_base_weights(model_cfg, base_weights), model_cfg=model_cfg, out_dir=out_dir)
    files = weight_files(model_cfg.hf)
    if not files:
        raise ConfigError(
            f"export --merge: {model_cfg.hf!r} has no safetensors weights to merge the adapters into (the run"
            " trained on a base made from its seed); export the run.out_dir of the finished run (its"
            " model.safetensors holds that base), or the adapters with --peft DIR"
        )
    here = weights_sha256(file_tensors(files)) if base else None
    if base and here != base.get("sha256"):
        raise ConfigError(
            f"export --merge: the weights in {model_cfg.hf!r} are not the base the adapters were trained on"
            f" (sha256 {here} here, {base.get('sha256')} in the checkpoint's manifest);"
            " restore that base or export the adapters with --peft DIR"
        )
    hf_base = _renamed_by_transformers(model_cfg) if is_vision_dir(model_cfg.hf) else dict(file_tensors(files))
    return _merge_and_save(adapters, hf_base, model_cfg=model_cfg, out_dir=out_dir)


def _renamed_by_transformers(model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """model.hf's weights under its model's own names: an image-text checkpoint may hold older
    names (transformers 5 saves LLaVA as ``language_model.model.*``), which its from_pretrained renames."""
    from transformers import AutoModelForImageTextToText  # an optional extra: paratrain[hf]

    with quiet_progress():
        return AutoModelForImageTextToText.from_pretrained(model_cfg.hf).state_dict()


def _merge_and_save(adapters, hf_base: dict, *, model_cfg: ModelConfig, out_dir: str) -> nn.Module:
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict  # optional: paratrain[lora]

    peft_model, sd = peft_model_of(model_cfg, adapters, base_weights=hf_base)
    result = set_peft_model_state_dict(
        peft_model, get_peft_model_state_dict(peft_model, state_dict=sd, adapter_name=ADAPTER), adapter_name=ADAPTER
    )
    lost = [k for k in result.missing_keys if is_adapter_param(k)]
    if lost or result.unexpected_keys:
        raise RuntimeError(
            f"PEFT did not take the adapters: missing {lost[:3]}, unexpected {result.unexpected_keys[:3]}"
        )
    merged = peft_model.merge_and_unload()
    _save_transformers(merged.state_dict(), model_cfg=model_cfg, out_dir=out_dir)
    return merged


def _save_transformers(state_dict: dict, *, model_cfg: ModelConfig, out_dir: str) -> None:
    """Weights under transformers' names as model.hf's class saves them; an image-text model with
    its processor's files (as export --hf writes it)."""
    save_hf(
        state_dict,
        config=load_hf_config(model_cfg.hf, model_cfg.args),
        out_dir=out_dir,
        source_dir=model_cfg.hf,
        hf_name=lambda n: n,
        from_config=hf_model_of(model_cfg)[2] if is_vision_dir(model_cfg.hf) else None,
    )
    if is_vision_dir(model_cfg.hf):
        copy_processor(model_cfg.hf, out_dir)
