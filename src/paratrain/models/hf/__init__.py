"""transformers causal LMs from a local directory: ``[model] hf = DIR`` (docs/huggingface.md).

``hf_spec(cfg)`` is the ModelSpec of the directory's model: build (config + ``[model.args]``
overrides, weights loaded after parallelisation when ``hf_weights``), blocks (the decoder layers),
the tensor-parallel plan from ``base_model_tp_plan`` and the layout checks.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from paratrain.config import ConfigError, ModelConfig
from paratrain.models.hf.model import HFCausalLM, causal_lm_from_config, load_hf_config
from paratrain.models.hf.moe import active_params, check_hf_moe_combinations, expert_layers, is_moe
from paratrain.models.hf.parallel import check_hf_layout, hf_cp_attention, hf_tp_plan
from paratrain.models.hf.vision import (
    HFVisionLM,
    build_vision,
    check_family,
    copy_processor,
    image_text_model_from_config,
    is_vision_dir,
)
from paratrain.models.hf.weights import converted_sources, load_into, save_hf, weight_files
from paratrain.models.lora import apply_lora
from paratrain.models.spec import ModelSpec


def hf_weights_enabled(cfg: ModelConfig, files: dict) -> bool:
    value = cfg.hf_weights
    if value == "auto":
        return bool(files)
    if value is True and not files:
        raise ConfigError(
            f"model.hf_weights = true but {cfg.hf!r} has no *.safetensors weights; add them or set model.hf_weights = false"
        )
    if not isinstance(value, bool):
        raise ConfigError(f"model.hf_weights = {value!r} must be true, false or 'auto'")
    return value


def build_hf(cfg: ModelConfig) -> HFCausalLM:
    config = load_hf_config(cfg.hf, cfg.args)
    hf_model = causal_lm_from_config(config, head=cfg.head)
    # LoRA on the transformers model itself, before the wrapper takes its modules: PEFT sees the
    # model it knows ('all-linear' leaves its output layer out) and the checkpoint's names.
    built = apply_lora(hf_model, cfg.lora) if cfg.lora.enabled else {}
    model = HFCausalLM(hf_model)
    if model.scores:
        built.update(new_score_head(cfg, config, model))
    model.built_tensors = built  # adapters of a meta model, by checkpoint name: load_into copies them in
    return model


def new_score_head(cfg: ModelConfig, config, model: HFCausalLM) -> dict[str, torch.Tensor]:
    """A score head the weights do not hold (a causal LM's directory turned reward model), made
    as transformers initialises it (normal, std ``initializer_range``; from the seeded RNG, the
    same on every rank), by checkpoint name for the loader; {} when the weights hold it or none
    are read (the model is then built for real, transformers' own init)."""
    files = weight_files(cfg.hf)
    if not hf_weights_enabled(cfg, files) or any(k.startswith("score.") for k in files):
        return {}
    std = getattr(config, "initializer_range", 0.02)
    return {
        model.hf_name(f"lm_head.{name}"): torch.empty(p.shape, device="cpu").normal_(0.0, std)
        if name == "weight"
        else torch.zeros(p.shape, device="cpu")
        for name, p in model.lm_head.named_parameters()
    }


def hf_spec(cfg: ModelConfig) -> ModelSpec:
    config = load_hf_config(
        cfg.hf, cfg.args
    )  # the directory, the architecture and [model.args], before any process starts
    if is_vision_dir(cfg.hf):
        return vision_spec(cfg, config)
    files = weight_files(cfg.hf)
    load = hf_weights_enabled(cfg, files)

    def materialize(model: nn.Module, *, device) -> int:
        # Checkpoint names that transformers converts on load (fused experts, renamed modules).
        with torch.device("meta"):
            hf_model = causal_lm_from_config(load_hf_config(cfg.hf, cfg.args), head=cfg.head)
        return load_into(model, files=files, device=device, converted=converted_sources(files, hf_model))

    return ModelSpec(
        name=f"hf:{cfg.hf}",
        build=functools.partial(build_hf, cfg),
        blocks_attr="layers",
        tp_plan=hf_tp_plan,
        check_layout=lambda args, *, tp, sequence_parallel: check_hf_layout(load_hf_config(cfg.hf, args), tp=tp),
        loss_parallel=False,
        context_length=lambda args: getattr(load_hf_config(cfg.hf, args), "max_position_embeddings", None),
        materialize=materialize if load else None,
        head_attr="lm_head",
        cp_attention=hf_cp_attention,
        flops_per_token=hf_flops,
        expert_layers=expert_layers,
    )


def vision_spec(cfg: ModelConfig, config) -> ModelSpec:
    """The spec of an image-text model (models/hf/vision.py): the decoder layers are the blocks;
    tensor parallel splits the language model by its text config's own plan (hf_tp_plan: the
    patterns start at ``layers.``/``lm_head``, so the vision tower and projector match none and
    stay replicated on every tp rank); what this slice does not run (pp, cp, ep, ...) is refused
    by preflight/support.py."""
    check_family(config)
    files = weight_files(cfg.hf)

    def materialize(model: nn.Module, *, device) -> int:
        # transformers 5 saves LLaVA under its older names (language_model.model.*): its own mapping.
        with torch.device("meta"):
            hf_model = image_text_model_from_config(load_hf_config(cfg.hf, cfg.args))
        return load_into(model, files=files, device=device, converted=converted_sources(files, hf_model))

    text = config.get_text_config()
    return ModelSpec(
        name=f"hf:{cfg.hf}",
        build=functools.partial(build_vision, cfg),
        blocks_attr="layers",
        tp_plan=hf_tp_plan,
        check_layout=lambda args, *, tp, sequence_parallel: check_hf_layout(
            load_hf_config(cfg.hf, args).get_text_config(), tp=tp
        ),
        loss_parallel=False,
        context_length=lambda args: getattr(text, "max_position_embeddings", None),
        materialize=materialize if hf_weights_enabled(cfg, files) else None,
        head_attr="lm_head",
        flops_per_token=hf_flops,
    )


def hf_flops(model: nn.Module):
    """6 x the parameters a token goes through (a mixture of experts: its top_k experts only)."""
    n = active_params(model)
    return lambda seq_len: 6.0 * n


def check_hf_moe_layout(cfg, *, tp: int, pp: int, cp: int, ep: int, dp_shard: int = 1) -> None:
    """A ``model.hf`` mixture of experts with a layout it does not run with: one line (preflight)."""
    config = load_hf_config(cfg.model.hf, cfg.model.args)
    check_hf_moe_combinations(config, cfg, tp=tp, pp=pp, cp=cp, ep=ep, dp_shard=dp_shard)


def hf_is_moe(cfg) -> bool:
    """Is ``model.hf`` a mixture of experts (models/hf/moe.py)?"""
    return is_moe(load_hf_config(cfg.model.hf, cfg.model.args))


def export_hf(state_dict: dict, *, model_cfg: ModelConfig, out_dir: str) -> None:
    """Gathered weights (HFCausalLM names) of a ``model.hf`` run -> a ``from_pretrained`` directory."""
    config = load_hf_config(model_cfg.hf, model_cfg.args)
    if is_vision_dir(model_cfg.hf):  # an image-text model (models/hf/vision.py), with its processor
        with torch.device("meta"):
            names = HFVisionLM(image_text_model_from_config(config))
        save_hf(
            state_dict,
            config=config,
            out_dir=out_dir,
            source_dir=model_cfg.hf,
            hf_name=names.hf_name,
            from_config=image_text_model_from_config,
        )
        copy_processor(model_cfg.hf, out_dir)
        return
    with torch.device("meta"):
        names = HFCausalLM(causal_lm_from_config(config, head=model_cfg.head))
    save_hf(
        state_dict, config=config, out_dir=out_dir, source_dir=model_cfg.hf, hf_name=names.hf_name, head=model_cfg.head
    )


__all__ = [
    "check_hf_moe_layout",
    "export_hf",
    "HFCausalLM",
    "build_hf",
    "hf_spec",
    "load_hf_config",
    "save_hf",
    "weight_files",
]
