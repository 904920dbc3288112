"""A local ``transformers`` causal LM as a paratrain model: config from a directory, a flat stage-able wrapper.

``HFCausalLM`` holds the HF model's own modules (no copies, no re-implementation of a layer):
the pieces its config's ``base_model_pp_plan`` names before the decoder layers (the token
embedding), ``layers`` (the decoder layers, still keyed "0".."n-1"), the pieces after them (the
final norm), then the output layer. That is the order ``distributed/pipeline_parallel.py``
splits by, so a pipeline stage keeps the embedding on the first stage and the norm and
``lm_head`` on the last, with no HF-specific code in ``distributed/``.

Its forward is the decoder's own loop (transformers 5: ``LlamaModel.forward`` and its relatives)
written so that a stage can run it: the rotary embedding is recomputed from the positions on every
stage (a few FLOPs; it holds no parameter, so it is kept outside the module tree, where no
stage split can drop it), the causal masks come from transformers' ``masking_utils`` per layer
type (full or sliding window), and the result is the logits tensor, not a ``ModelOutput``.
Parameter names are the wrapper's (``layers.0.self_attn.q_proj.weight``); ``hf_name`` maps them
back to the checkpoint's (``model.layers.0.self_attn.q_proj.weight``).
"""

from __future__ import annotations

import copy
import json
import os

import torch
from torch import nn

from paratrain.config import ConfigError
from paratrain.data.packing import split_packed
from paratrain.models.hf.moe import check_hf_moe, install_router_stats, keep_experts_eager, offer_expert_parallel

CONFIG_FILE = "config.json"


def check_hf_dir(path: str, key: str = "model.hf") -> str:
    """The directory, or one line saying why it cannot be used (never a hub download)."""
    if not os.path.isdir(path):
        if not os.path.isabs(path):
            raise ConfigError(
                f"{key} = {path!r} is not a local directory (a relative path in a config is taken from where"
                f" paratrain runs, {os.getcwd()!r}, not from the config file's folder; paratrain never downloads"
                " from the hub): run from the folder it is relative to, give an absolute path, or download the model"
                " first (`hf download NAME --local-dir DIR`) and pass that directory"
            )
        raise ConfigError(
            f"{key} = {path!r} is not a local directory (paratrain never downloads from the hub); download the"
            " model first (e.g. `hf download NAME --local-dir DIR`) and pass that directory"
        )
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        raise ConfigError(f"{key} = {path!r} has no {CONFIG_FILE}; pass the directory of a transformers model")
    return path


# (directory, its config.json's mtime, key, [model.args]) -> the checked PretrainedConfig: a
# process reads each config once however many of its parts (preflight, spec, build, export) ask.
_HF_CONFIGS: dict[tuple, object] = {}


def load_hf_config(path: str, overrides: dict, key: str = "model.hf"):
    """The model's ``PretrainedConfig`` with ``[model.args]`` overriding its fields. Every path
    that reads a ``model.hf`` starts here, so a missing transformers is one line here. Read once
    per process and arguments; each call gets its own copy (callers may set its fields)."""
    try:
        stamp = os.stat(os.path.join(path, CONFIG_FILE)).st_mtime_ns
    except OSError:  # read_hf_config names what is missing
        stamp = None
    cached = (os.path.abspath(path), stamp, key, json.dumps(overrides, sort_keys=True, default=repr))
    if cached not in _HF_CONFIGS or stamp is None:
        _HF_CONFIGS[cached] = read_hf_config(path, overrides, key)
    return copy.deepcopy(_HF_CONFIGS[cached])


def read_hf_config(path: str, overrides: dict, key: str = "model.hf"):
    """:func:`load_hf_config` without the cache: ``config.json`` read and checked."""
    try:
        from transformers import AutoConfig  # an optional extra: paratrain[hf]
    except ImportError:
        raise ConfigError(f"{key} needs transformers, which is not installed: pip install 'paratrain[hf]'") from None

    check_hf_dir(path, key)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{key} = {path!r}: transformers cannot read its {CONFIG_FILE} ({first})") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # An image-text model (a vision_config) goes through models/hf/vision.py.
    vision = getattr(config, "vision_config", None) is not None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not vision:
        raise ConfigError(
            f"{key} = {path!r}: model_type {config.model_type!r} is not a causal language model in transformers'"
            " AutoModelForCausalLM; pass a decoder LM's directory"
        )
    for name, value in overrides.items():
        if not hasattr(config, name):
            raise ConfigError(f"model.args.{name} is not a field of {type(config).__name__}; remove it")
        setattr(config, name, value)
    check_hf_moe(config, key)  # after [model.args]: they may turn a router option on
    # The decoder loop below calls the attention through masks made for SDPA (None = causal,
    # its fast path); the layer reads the implementation from the config.
    config._attn_implementation = "sdpa"
    config.use_cache = False
    if vision:  # its decoder and vision tower read their own sub-configs
        for sub in (config.get_text_config(), config.vision_config):
            sub._attn_implementation, sub.use_cache = "sdpa", False
    return config


def causal_lm_from_config(config, key: str = "model.hf", *, head: str = "lm") -> nn.Module:
    """transformers' model of ``config``: its causal LM, or with ``head = 'score'`` its
    sequence classifier with one label (a reward model's score head, ``model.head``)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification  # paratrain[hf]

    try:
        if head == "score":
            config.num_labels = 1
            return AutoModelForSequenceClassification.from_config(config)
        return AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise ConfigError(
                f"{key}: {type(config).__name__} ({', '.join(config.architectures or [])}) is not a causal language"
                " model in transformers' AutoModelForCausalLM; pass a decoder LM's directory"
            ) from None
        raise


class HFCausalLM(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab) with the modules of an HF ``*ForCausalLM``."""

    # True: forward stops before lm_head, whose logits a chunked loss makes itself (loss.py).
    return_hidden = False
    # Context parallel: the ring attention (models/hf/parallel.py hf_cp_attention); it builds its
    # own masks per chunk pair, so the forward makes none.
    cp_attention = None
    # Tensors the checkpoint does not hold, made at build time, by checkpoint name (LoRA's
    # adapters of a meta model, models/lora.py): the loader copies each rank's part of them in.
    built_tensors: dict = {}

    def __init__(self, hf_model: nn.Module, *, key: str = "model.hf"):
        super().__init__()
        config = hf_model.config
        decoder = hf_model.get_decoder()
        plan = list(getattr(config, "base_model_pp_plan", None) or {})
        blocks = getattr(decoder, "layers", None)
        if "layers" not in plan or not isinstance(blocks, nn.ModuleList):
            raise ConfigError(
                f"{key}: {type(hf_model).__name__} has no decoder layers in model.layers described by"
                " base_model_pp_plan; paratrain trains transformers decoders laid out like Llama (Llama, Mistral,"
                " Qwen2, Qwen3, ...)"
            )
        if getattr(config, "final_logit_softcapping", None):
            # The *ForCausalLM forward caps the logits (Gemma 2); this module returns the head's
            # logits directly, so it would train a different function: refuse rather than differ.
            raise ConfigError(
                f"{key}: {type(hf_model).__name__} caps its logits (final_logit_softcapping ="
                f" {config.final_logit_softcapping}), which paratrain does not reproduce yet; set it to null in"
                " model.args or train another architecture"
            )
        pos = plan.index("layers")
        self.config = config
        self._head_names = plan[:pos]  # e.g. ["embed_tokens"]
        self._tail_names = plan[pos + 1 :]  # e.g. ["norm"]
        for name in self._head_names:
            setattr(self, name, getattr(decoder, name))
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(blocks)})
        for name in self._tail_names:
            setattr(self, name, getattr(decoder, name))
        # A sequence classifier (model.head = 'score') has a score head in place of the LM's:
        # the per-token scores come out where the logits would (objectives/preference.py reads
        # each sequence's last one).
        self.scores = getattr(hf_model, "score", None) is not None and hf_model.get_output_embeddings() is None
        self.lm_head = hf_model.score if self.scores else hf_model.get_output_embeddings()
        # The prefix of the decoder inside the HF model ("model"), for the checkpoint names.
        self._decoder_prefix = next(n for n, m in hf_model.named_modules() if m is decoder)
        self._lm_head_name = next(n for n, m in hf_model.named_modules() if m is self.lm_head)
        rope = getattr(decoder, "rotary_emb", None)
        if rope is not None:
            # Built for real even when the model is built on the meta device: it has no
            # parameter, only the inv_freq buffer that its config fixes.
            with torch.device("cpu"):
                rope = type(rope)(config=config)
        self._rope = (rope,)  # a tuple: not a submodule, so no stage split drops it
        self.tied = bool(getattr(config, "tie_word_embeddings", False)) and not self.scores
        # Mixture of experts (models/hf/moe.py): each router leaves its sequence-wise balance loss.
        self.n_sparse_blocks = install_router_stats(self)
        offer_expert_parallel(self)  # parallel.ep: distributed/expert_parallel.apply_ep finds it
        keep_experts_eager(self)  # train.compile: the routed experts stay out of the compiled blocks

    @property
    def has_rope(self) -> bool:
        """Rotary position embeddings (plan/cost.py prices their pointwise work)."""
        return self._rope[0] is not None

    def hf_name(self, name: str) -> str:
        """The transformers checkpoint name of the wrapper's parameter ``name``."""
        first = name.split(".", 1)[0]
        if first == "lm_head":
            return self._lm_head_name + name[len("lm_head") :]
        return f"{self._decoder_prefix}.{name}" if self._decoder_prefix else name

    def new_cache(self):
        """transformers' own cache for the sampler's forwards (objectives/rl/rollout.py)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def _cached_forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache,
        key_mask: torch.Tensor,
        embedded=False,
        rope_positions=None,
    ):
        """The forward of new tokens against a KV cache (the sampler's, objectives/rl/rollout.py): the
        decoder layers as transformers' own model runs them with ``use_cache``; ``embedded`` and
        ``rope_positions`` as in :meth:`forward` (an image-text model's prompts, models/hf/vision.py)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        for name in [] if embedded else self._head_names:
            module = getattr(self, name)
            if module is not None:
                x = module(x)
        args = dict(config=self.config, inputs_embeds=x, attention_mask=key_mask, cache=cache, position_ids=positions)
        masks = {"full_attention": create_causal_mask(**args)}
        if "sliding_attention" in (getattr(self.config, "layer_types", None) or ()):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**args)
        position_embeddings = self._rotary(x, positions if rope_positions is None else rope_positions)
        layer_types = getattr(self.config, "layer_types", None)
        for key, layer in self.layers.items():
            kind = layer_types[int(key)] if layer_types else "full_attention"
            x = layer(
                x,
                attention_mask=masks[kind],
                position_embeddings=position_embeddings,
                position_ids=positions,
                cache=cache,
                use_cache=True,
            )
            if isinstance(x, tuple):
                x = x[0]
        for name in self._tail_names:
            module = getattr(self, name)
            if module is not None:
                x = module(x)
        return self.lm_head(x)

    def _rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        rope = self._rope[0]
        if rope is None:
            return None
        if rope.inv_freq.device != hidden.device:
            rope.to(hidden.device)
        return rope(hidden, position_ids)

    def _masks(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """transformers' own masks per layer type. With packed documents, the position ids that
        restart at 0 make ``masking_utils`` build the block-diagonal causal mask itself
        (``find_packed_sequence_indices``): each document attends to itself only."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        # Local tensors for the mask builders (a sequence-sharded DTensor has a global shape).
        args = dict(
            config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=position_ids
        )
        masks = {"full_attention": create_causal_mask(**args)}
        if "sliding_attention" in (getattr(self.config, "layer_types", None) or ()):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**args)
        return masks

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        cache=None,
        key_mask=None,
        embedded=False,
        rope_positions=None,
    ) -> torch.Tensor:
        """Token ids (B, T) -> logits; on a later pipeline stage hidden -> hidden (or -> logits).

        Packed documents (B, 2, T) carry their position ids (data/packing.py); padding's -1
        starts a one-token sequence of its own for the mask and rotates as position 0. A
        pipeline stage gets the ids (or the hidden states) and the ``positions`` (B, T) apart.

        ``cache``: transformers' ``DynamicCache`` of the generation phase (objectives/rl/rollout.py),
        with ``x``, ``positions`` and ``key_mask`` as in the built-in GPT's (models/gpt/model.py).
        ``embedded``: ``x`` is already the embeddings (models/hf/vision.py put the images in).
        ``rope_positions``: what the rotary embedding rotates by when it is not ``positions``
        (Qwen2-VL's multimodal positions, (3, B, T)); the masks still follow ``positions``.
        """
        if cache is not None:
            return self._cached_forward(x, positions, cache, key_mask, embedded, rope_positions)
        if positions is None:
            x, positions = split_packed(x)
        for name in [] if embedded else self._head_names:
            module = getattr(self, name)
            if module is not None:
                x = module(x)
        if self.cp_attention is not None:  # the step gives global positions (step.cp_local_batch)
            masks, position_ids = {"full_attention": None}, positions.clamp(min=0)
        elif positions is None:
            position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            masks = self._masks(x, position_ids)
        else:
            masks = self._masks(x, positions)
            position_ids = positions.clamp(min=0)
        position_embeddings = self._rotary(x, position_ids if rope_positions is None else rope_positions)
        layer_types = getattr(self.config, "layer_types", None)
        for key, layer in self.layers.items():
            kind = layer_types[int(key)] if layer_types else "full_attention"
            x = layer(x, attention_mask=masks[kind], position_embeddings=position_embeddings, position_ids=position_ids)
            if isinstance(x, tuple):  # older decoder layers return (hidden, ...)
                x = x[0]
        for name in self._tail_names:
            module = getattr(self, name)
            if module is not None:
                x = module(x)
        if self.lm_head is not None and not self.return_hidden:
            x = self.lm_head(x)
        return x
