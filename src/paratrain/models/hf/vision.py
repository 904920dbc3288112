"""transformers' image-text-to-text models through ``model.hf`` (docs/vision-language.md).

``HFVisionLM`` is :class:`~paratrain.models.hf.model.HFCausalLM` over the model's language half
(its embedding, decoder layers, norm and ``lm_head``, the same flat layout, so FSDP2 shards the
decoder layers block by block and everything else as the root) plus the family's own vision
tower and projector. Its forward takes an :class:`~paratrain.data.image_rows.ImageTextBatch`:
the family's own ``get_image_features`` (vision tower, feature selection, projector) turns the
pixel values into one feature per image token, which replace the image tokens' embeddings in
row order (as ``LlavaModel.forward`` does with ``masked_scatter``); the decoder then runs as for
text. ``model.vision = "freeze"`` leaves the vision tower and projector out of training.

Families: LLaVA (a fixed number of image tokens per image, 1-D positions) and Qwen2-VL
(variable patches: the batch's ``image_grid_thw`` says how many patch rows of ``pixel_values`` each
image has; its vision tower holds its projector, the merger; and multimodal rotary positions,
which the family's own ``get_rope_index`` computes from the ids and grids of the micro-batch);
Qwen2.5-VL (``qwen2_5_vl``) is laid out the same.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

from paratrain.config import ConfigError, ModelConfig
from paratrain.models.hf.model import CONFIG_FILE, HFCausalLM, load_hf_config
from paratrain.models.lora import apply_lora

# The families whose forward this wrapper reproduces: (vision tower, projector) attribute names
# of their inner model (Qwen2-VL's projector, its merger, is inside its vision tower).
FAMILIES = {
    "llava": ("vision_tower", "multi_modal_projector"),
    "qwen2_vl": ("visual", None),
    "qwen2_5_vl": ("visual", None),
}
VISION_MODES = ("train", "freeze")


def is_vision_dir(path: str) -> bool:
    """Does ``path`` hold an image-text model (a config.json with a ``vision_config``)? Read as
    JSON, without transformers, so preflight's support checks cost nothing."""
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def check_family(config, key: str = "model.hf") -> None:
    if config.model_type not in FAMILIES:
        raise ConfigError(
            f"{key}: the image-text model type {config.model_type!r} is not supported yet (this version runs"
            f" {', '.join(sorted(FAMILIES))})"
        )


class _TextView:
    """The language half of an image-text model as HFCausalLM reads a causal LM: its text config,
    its decoder, its output layer; module names are the whole model's (the checkpoint's)."""

    score = None

    def __init__(self, hf_model: nn.Module):
        self.config, self._model = hf_model.config.get_text_config(), hf_model

    def get_decoder(self) -> nn.Module:
        return self._model.model.language_model

    def get_output_embeddings(self) -> nn.Module:
        return self._model.get_output_embeddings()

    def named_modules(self):
        return self._model.named_modules()


class HFVisionLM(HFCausalLM):
    """An :class:`ImageTextBatch` -> logits (B, T, vocab) with the modules of an HF image-text model."""

    def __init__(self, hf_model: nn.Module, *, key: str = "model.hf"):
        check_family(hf_model.config, key)
        super().__init__(_TextView(hf_model), key=key)
        inner = hf_model.model
        tower, projector = FAMILIES[hf_model.config.model_type]
        self.vision_tower = getattr(inner, tower)
        self.multi_modal_projector = getattr(inner, projector) if projector else None
        # Not submodules: the family's own get_image_features runs the two modules above (the
        # same objects, so FSDP2's gathered parameters are the ones it reads), and the text
        # embedding is self's own.
        self._family = (inner,)
        self._embed = (inner.get_input_embeddings(),)
        self.vision_config = hf_model.config
        self._vision_names = {
            attr: next(n for n, m in hf_model.named_modules() if m is getattr(self, attr))
            for attr in ("vision_tower", "multi_modal_projector")
            if getattr(self, attr) is not None
        }
        self.built_tensors = self._position_buffers()
        # parallel.activation_checkpointing wraps these lists' layers too, beside the decoder's
        # (distributed/activation_checkpoint.py): the vision tower's encoder layers, the ones
        # transformers itself checkpoints (its GradientCheckpointingLayer), CLIP's encoder.layers
        # and Qwen2-VL's blocks. A tuple, not submodules: the tower keeps them and their names.
        from transformers.modeling_layers import GradientCheckpointingLayer  # paratrain[hf], as the model

        self.extra_checkpoint_blocks = tuple(
            m
            for m in self.vision_tower.modules()
            if isinstance(m, nn.ModuleList) and len(m) and all(isinstance(c, GradientCheckpointingLayer) for c in m)
        )

    def _position_buffers(self) -> dict[str, torch.Tensor]:
        """The vision tower's non-persistent position buffers (CLIP's ``position_ids``, an arange;
        Qwen2-VL's rotary ``inv_freq``, made by the module from its config), which the checkpoint
        does not hold, by checkpoint name, made on the CPU even for a meta model: the weight loader
        copies them in (built_tensors) instead of refusing them."""
        out = {}
        for prefix, module in self.vision_tower.named_modules(prefix="vision_tower"):
            for name in module._non_persistent_buffers_set:
                b = module._buffers.get(name)
                if b is not None and name == "position_ids":
                    out[self.hf_name(f"{prefix}.{name}")] = torch.arange(b.shape[-1], device="cpu").expand(b.shape)
                elif b is not None and "inv_freq" in name:
                    with torch.device("cpu"):
                        out[self.hf_name(f"{prefix}.{name}")] = getattr(type(module)(module.config), name)
        return out

    def hf_name(self, name: str) -> str:
        first = name.split(".", 1)[0]
        if first in self._vision_names:
            return self._vision_names[first] + name[len(first) :]
        return super().hf_name(name)

    def image_features(self, pixel_values: torch.Tensor, dtype: torch.dtype, grid=None) -> torch.Tensor:
        """One row per image token, the images in order: the family's own vision path (with
        variable patches, ``grid`` (images, 3) says which patch rows are whose)."""
        cfg = self.vision_config
        if grid is not None:
            args = dict(image_grid_thw=grid)
        else:
            args = dict(
                vision_feature_layer=cfg.vision_feature_layer,
                vision_feature_select_strategy=cfg.vision_feature_select_strategy,
            )
        out = self._family[0].get_image_features(pixel_values=pixel_values.to(dtype), return_dict=True, **args)
        return torch.cat(list(out.pooler_output), dim=0).to(dtype)

    def rope_positions(self, batch) -> torch.Tensor | None:
        """Qwen2-VL's multimodal rotary positions (3, B, T): the family's own ``get_rope_index``
        over the micro-batch (an image's tokens take its grid's temporal, height and width indices,
        the text after it continues from their largest; padding, outside ``attention_mask``, gets
        0). It walks the images in row order, the order of the batch's grids. None for 1-D families."""
        get_rope_index = getattr(self._family[0], "get_rope_index", None)
        if get_rope_index is None:
            return None
        ids = batch.input_ids
        image = (ids == self.vision_config.image_token_id).int()  # the processor's mm_token_type_ids
        positions, _ = get_rope_index(
            ids, mm_token_type_ids=image, image_grid_thw=batch.image_grid_thw, attention_mask=batch.positions >= 0
        )
        # Packed documents (data/image_rows.py; a DPO pair's two sides): get_rope_index numbers a
        # row's documents on from each other, each one's positions its own plus one constant (its
        # text and images advance a counter that starts at 0). Less the positions of its first
        # token (the counter's value there, on all three axes), each document has the positions
        # it has alone, in integers, so exactly. Its image runs sit between <|vision_start|> and
        # <|vision_end|>, so two documents' images never merge into one run of image tokens.
        starts = torch.arange(ids.shape[1], device=ids.device) - batch.positions.clamp(min=0)
        first = positions.gather(2, starts.expand(positions.shape[0], -1, -1))
        return torch.where(batch.positions >= 0, positions - first, positions)

    def forward(self, batch, positions=None, *, cache=None, key_mask=None) -> torch.Tensor:
        """An :class:`ImageTextBatch` -> logits. The sampler's (objectives/rl/rollout.py) with a KV
        ``cache``: the prompts' batch (its images' features go into the cache with the prompt),
        then the new tokens' ids (B, 1) at ``positions``, text as in :class:`HFCausalLM`."""
        if cache is not None and isinstance(batch, torch.Tensor):  # a new token: text after the prompt
            rope = None
            if getattr(cache, "rope_delta", None) is not None:  # Qwen2-VL: text continues from the images' positions
                rope = (positions + cache.rope_delta[:, None]).expand(3, -1, -1)
            return super().forward(batch, positions, cache=cache, key_mask=key_mask, rope_positions=rope)
        ids = batch.input_ids
        x = self._embed[0](ids)
        slots = ids == self.vision_config.image_token_id
        if batch.pixel_values.shape[0]:
            features = self.image_features(batch.pixel_values, x.dtype, batch.image_grid_thw)
            # Under FakeTensorMode (the memory estimate, plan/) the count is not data: no check.
            if not is_fake(slots) and features.shape[0] != int(slots.sum()):
                raise ValueError(
                    f"{int(slots.sum())} image tokens but {features.shape[0]} image features: the corpus was"
                    " prepared with another processor than this model's"
                )
            x = x.masked_scatter(slots.unsqueeze(-1).expand_as(x), features)
        x = self._every_vision_parameter(x)
        # The memory estimate (batch/measure.py) keeps the batch real: its positions are made from
        # the ids' and grids' values (python lists, torch.tensor), outside the fake mode. A no-op here otherwise.
        with unset_fake_temporarily():
            rope = self.rope_positions(batch)
        if cache is None:
            return super().forward(x, batch.positions, embedded=True, rope_positions=rope)
        if rope is not None:  # a text token at position q after the prompt rotates by q + delta (get_rope_index)
            real = batch.positions >= 0
            cache.rope_delta = torch.where(real, rope.amax(0), -1).amax(-1) + 1 - real.sum(-1)
        return super().forward(x, positions, cache=cache, key_mask=key_mask, embedded=True, rope_positions=rope)

    def _every_vision_parameter(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus 0 x one element of every trainable vision parameter: a micro-batch without
        images (a text row) leaves the vision tower out of the graph, and CLIP's post_layernorm
        is never used (the features are a hidden state), but DDP's reducer waits for every
        parameter's gradient. The gradients this adds are zeros, on every layout alike (exact:
        x + 0.0 is x), and cost one element per parameter."""
        modules = [m for m in (self.vision_tower, self.multi_modal_projector) if m is not None]
        touched = [p.reshape(-1)[0] for m in modules for p in m.parameters()]
        touched = [t for t in touched if t.requires_grad]
        return x + 0.0 * torch.stack(touched).sum().to(x.dtype) if touched else x


def image_text_model_from_config(config) -> nn.Module:
    from transformers import AutoModelForImageTextToText  # an optional extra: paratrain[hf]

    return AutoModelForImageTextToText.from_config(config)


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "chat_template.jinja", "chat_template.json")


def copy_processor(source_dir: str, out_dir: str) -> None:
    """The processor's files beside an exported model (export --hf), so AutoProcessor loads it there."""
    for name in PROCESSOR_FILES:
        src = os.path.join(source_dir, name)
        if os.path.isfile(src) and not os.path.exists(os.path.join(out_dir, name)):
            shutil.copy(src, out_dir)


def lora_keep_out(cfg: ModelConfig, config) -> str | None:
    """PEFT's ``exclude_modules`` (a regular expression of module names) for LoRA on an image-text
    model: ``model.vision = 'freeze'`` keeps adapters out of the vision tower and projector;
    ``'train'`` lets target_modules match them as PEFT's ``get_peft_model`` does on the whole
    model (CLIP's attention is q_proj/k_proj/v_proj too). docs/vision-language.md."""
    if cfg.vision != "freeze":
        return None
    # Qwen2-VL's projector (its merger) is inside its vision tower: no name of its own (None).
    tower_and_projector = [name for name in FAMILIES.get(config.model_type, ()) if name]
    return r"(?:.*\.)?(?:" + "|".join(tower_and_projector) + r")(?:\..*)?" if tower_and_projector else None


def build_vision(cfg: ModelConfig) -> HFVisionLM:
    """The wrapper of ``model.hf``'s image-text model; ``model.vision = 'freeze'`` freezes its
    vision tower and projector (their parameters keep requires_grad False: no gradient, no update).
    ``[model.lora]``: PEFT's adapters on the transformers model before the wrapper takes its
    modules, as for a causal LM (models/hf/__init__.py build_hf)."""
    if cfg.vision not in VISION_MODES:
        raise ConfigError(f"model.vision = {cfg.vision!r} is unknown; use one of {', '.join(VISION_MODES)}")
    hf_model = image_text_model_from_config(load_hf_config(cfg.hf, cfg.args))
    built = apply_lora(hf_model, cfg.lora, keep_out=lora_keep_out(cfg, hf_model.config)) if cfg.lora.enabled else {}
    model = HFVisionLM(hf_model)
    model.built_tensors = {**model.built_tensors, **built}  # a meta model's adapters, by checkpoint name
    if cfg.vision == "freeze":
        model.vision_tower.requires_grad_(False)
        if model.multi_modal_projector is not None:
            model.multi_modal_projector.requires_grad_(False)
    return model
