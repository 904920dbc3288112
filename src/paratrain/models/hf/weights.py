"""HF weights in and out: per-rank sliced loading from safetensors, export to a ``from_pretrained`` directory.

Loading (``load_into``) runs after the parallelisms, on a model built on the meta device: each
parameter is materialised where it now lives (``to_empty``), then filled from the safetensors
files with ``safe_open(...).get_slice`` reading only this rank's part of it (the shard of a
DTensor, by ``compute_local_shape_and_global_offset``, the same rule DTensor shards by). No rank
holds the full model unless its layout does (plain DDP replicates it by design). This is the
"each rank reads its shards" recipe of torchtitan's HF loader, with safetensors' own lazy reads.

Checkpoints whose names differ from the model's (transformers 5 fuses a mixture of experts'
per-expert ``experts.0.gate_proj.weight``... into one ``experts.gate_up_proj``, and renames
Mixtral's ``block_sparse_moe`` to ``mlp``) are read through transformers' own conversion mapping
(``conversion_mapping.get_model_conversion_mapping``, the renamings and ``WeightConverter``s
``from_pretrained`` applies): :func:`converted_sources` finds, for each model tensor the files do
not hold, the checkpoint tensors and converter that make it, and the loader runs that converter
(all of one tensor's sources are read, then this rank's region is kept: one layer's experts at a
time in memory). ``save_pretrained`` reverts the same mapping on export.

Export (``save_hf``) writes ``config.json`` and sharded ``*.safetensors`` with their index through
transformers' own ``save_pretrained``, so the names, tied weights and index are what
``from_pretrained`` expects, and copies the tokenizer files of the source directory.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import glob
import json
import os
import shutil

import torch
from safetensors import safe_open
from torch import nn

# DTensor is imported in the functions that use it: its import costs seconds, which the launcher,
# whose preflight reads this module through the models, must not pay (tests/e2e/test_startup.py).
from paratrain.config import ConfigError
from paratrain.models.hf.model import causal_lm_from_config
from paratrain.models.lora import adapter_base_name

INDEX = "model.safetensors.index.json"
# Module names that wrappers insert around blocks: checkpoint_wrapper's and torch.compile's.
WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
)


def weight_files(path: str) -> dict[str, str]:
    """``{tensor name: safetensors file}`` of an HF directory (sharded with an index, or one file); {} if none."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    names: dict[str, str] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, "pt") as f:
            names.update({k: file for k in f.keys()})
    return names


def file_tensors(files: dict[str, str]):
    """``(name, tensor)`` of every tensor of an HF directory's weight files, sorted by name, one at a
    time (safetensors maps the files: at most one tensor is in memory)."""
    handles: dict[str, object] = {}
    for name in sorted(files):
        if files[name] not in handles:
            handles[files[name]] = safe_open(files[name], "pt")
        yield name, handles[files[name]].get_tensor(name)


def converted_sources(files: dict[str, str], hf_model: nn.Module) -> dict[str, tuple[object, list[tuple]]]:
    """``{model tensor name: (converter or None, [(source pattern, checkpoint name), ...])}`` for the
    tensors of ``hf_model`` (a transformers model, meta is fine) that the files hold under other
    names, by transformers' own mapping for this architecture; the sources in the order
    ``from_pretrained`` collects them (``dot_natural_key``: expert 10 after expert 9). A converter
    of None is a plain renaming (one source)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(hf_model)
    if not transforms:
        return {}
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    targets = set(hf_model.state_dict())
    out: dict[str, tuple[object, list[tuple]]] = {}
    for key in sorted(files, key=dot_natural_key):
        if key in targets:
            continue
        name, pattern = rename_source_key(key, renamings, converters)
        if name not in targets:
            continue
        converter = next((c for c in converters if pattern in c.source_patterns), None) if pattern else None
        out.setdefault(name, (converter, []))[1].append((pattern, key))
    return out


def _read_converted(name: str, converter, sources: list[tuple], handle) -> torch.Tensor:
    """The whole tensor ``name`` made by transformers' ``converter`` from its checkpoint ``sources``."""
    conv = copy.deepcopy(converter)  # it collects tensors: one instance per target, as from_pretrained does
    for pattern, key in sources:
        conv.add_tensor(name, key, pattern, functools.partial(lambda k: handle(k).get_tensor(k), key))
    made = conv.convert(name)
    if name not in made:
        raise ConfigError(
            f"model.hf: transformers' conversion made {sorted(made)} for {name!r}; pass a checkpoint it reads"
        )
    return made[name]


def _local_slice(p: torch.Tensor) -> tuple[slice, ...] | None:
    """This rank's region of parameter ``p`` in the full tensor (None: the whole of it)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return None
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def _to_empty_keeping_ties(module: nn.Module, device: torch.device) -> None:
    """``to_empty`` that keeps shared parameters shared (tied embeddings) and the parameters'
    attributes: it makes new Parameter objects (torch 2.13 swaps tensors on conversion), one per
    module that held the shared one."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    attrs: dict[int, dict] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, name))
                attrs[id(p)] = dict(vars(p))
    module.to_empty(device=device)
    for key, places in owners.items():
        first_module, first_name = places[0]
        # Attributes set on the parameter (expert_parallel.EP_ATTR, which the gradient reduce and
        # norm read) do not follow it into the new object.
        new = getattr(first_module, first_name)
        for name, value in attrs[key].items():
            if not hasattr(new, name):
                setattr(new, name, value)
        for m, name in places[1:]:
            setattr(m, name, getattr(first_module, first_name))


def _clean(name: str) -> str:
    """Activation checkpointing and compile wrap blocks; their names do not reach the checkpoint."""
    return ".".join(c for c in name.split(".") if c not in WRAPPER_NAMES)


def _parts(model: nn.Module) -> list[nn.Module]:
    # A PipelineModel (distributed/pipeline_parallel.py) holds this rank's stages in ``parts``.
    parts = getattr(model, "parts", None)
    return list(parts) if isinstance(parts, nn.ModuleList) else [model]


@torch.no_grad()
def load_into(model: nn.Module, *, files: dict[str, str], device: torch.device, converted: dict | None = None) -> int:
    """Materialise ``model`` (meta parameters, possibly sharded) on ``device`` and fill it from ``files``.

    ``model`` is an HFCausalLM, parallelised or not (a PipelineModel's stages, DDP's ``module``);
    ``converted`` (:func:`converted_sources`) says how to make the tensors the files hold under
    other names. Returns the number of elements this rank read (its share of the model).
    """
    from torch.distributed.tensor import DTensor

    read = 0
    handles: dict[str, object] = {}
    converted = converted or {}

    def handle(key: str):
        file = files[key]
        if file not in handles:
            handles[file] = safe_open(file, "pt", device="cpu").__enter__()
        return handles[file]

    try:
        for part in _parts(model):
            part = getattr(part, "module", part)  # DDP's wrapper: its module keeps the names
            # A LoRA model's adapters come from its build (HFCausalLM.built_tensors), its base
            # layers from the files under the base model's names (models/lora.py).
            built = getattr(part, "built_tensors", {})
            hf_name = part.hf_name
            # to_empty leaves buffers uninitialised too. A buffer the weights hold is read below like a
            # parameter; one they do not hold (non-persistent, e.g. Gemma 3's embed_tokens.embed_scale)
            # would train on garbage, silently: refuse it (the rotary inv_freq is rebuilt by
            # HFCausalLM itself, outside the module tree).
            lost = [
                n
                for n, b in part.named_buffers()
                if b.is_meta and adapter_base_name(hf_name(_clean(n))) not in {**files, **converted, **built}
            ]
            if lost:
                raise ConfigError(
                    f"model.hf: {type(part).__name__} keeps buffers the weights do not hold ({', '.join(lost[:3])}),"
                    " which paratrain cannot rebuild on load; set model.hf_weights = false to train from the seed"
                )
            if any(p.is_meta for p in part.parameters()):
                _to_empty_keeping_ties(part, device)
            for name, p in [*part.named_parameters(), *part.named_buffers()]:
                key = hf_name(_clean(name))
                if key in built:
                    region = _local_slice(p)
                    value = built[key][region] if region is not None else built[key]
                    (p.to_local() if isinstance(p, DTensor) else p).copy_(value)
                    continue
                key = adapter_base_name(key)
                if key not in files and key in converted:
                    converter, sources = converted[key]
                    if converter is None:  # a plain renaming: read the source's slice below
                        key = sources[0][1]
                    else:
                        whole = _read_converted(key, converter, sources, handle)
                        if list(whole.shape) != list(p.shape):
                            raise ConfigError(
                                f"model.hf: tensor {key!r} has shape {list(whole.shape)} in the weights but"
                                f" {list(p.shape)} in the model; remove the [model.args] that change its size"
                            )
                        region = _local_slice(p)
                        value = whole[region] if region is not None else whole
                        (p.to_local() if isinstance(p, DTensor) else p).copy_(value)
                        read += value.numel()
                        continue
                if key not in files:
                    raise ConfigError(
                        f"model.hf: the weights have no tensor {key!r}; set model.hf_weights = false to train from"
                        " the seed, or pass the directory of the same architecture"
                    )
                region = _local_slice(p)
                local = p.to_local() if isinstance(p, DTensor) else p
                src = handle(key).get_slice(key)
                if list(src.get_shape()) != list(p.shape):
                    raise ConfigError(
                        f"model.hf: tensor {key!r} has shape {src.get_shape()} in the weights but {list(p.shape)} in"
                        " the model; remove the [model.args] that change its size, or set model.hf_weights = false"
                    )
                value = src[region] if region is not None else src[:]
                local.copy_(value.to(local.dtype))
                read += value.numel()
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    for part in _parts(model):
        getattr(part, "module", part).built_tensors = {}  # copied in: free them
    return read


@contextlib.contextmanager
def quiet_progress():
    """transformers' progress bars ("Writing model shards", "Loading weights") off: a command's
    output is its own one-line result."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def save_hf(
    state_dict: dict[str, torch.Tensor],
    *,
    config,
    out_dir: str,
    source_dir: str,
    hf_name,
    max_shard_size: str = "2GB",
    head: str = "lm",
    from_config=None,
) -> None:
    """Write the gathered weights (wrapper names) as an HF directory that ``from_pretrained`` loads
    (``head = 'score'``: as the one-label sequence classifier a reward model is; ``from_config``:
    the transformers model class's builder when not a causal LM, e.g. an image-text model's)."""
    with torch.device("meta"):
        hf = from_config(config) if from_config else causal_lm_from_config(config, "export --hf", head=head)
    renamed = {hf_name(k): v for k, v in state_dict.items()}
    # assign=True adopts our tensors in place of the meta ones: one copy of the weights in memory.
    missing, unexpected = hf.load_state_dict(renamed, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        hf.tie_weights()
    missing = [k for k in missing if not _is_tied_copy(hf, k)]
    if missing or unexpected:
        raise ConfigError(
            f"export --hf: the weights do not fit {type(hf).__name__}: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    os.makedirs(out_dir, exist_ok=True)
    hf.config._attn_implementation = None
    with quiet_progress():
        hf.save_pretrained(out_dir, max_shard_size=max_shard_size)
    _ensure_index(out_dir)
    for name in TOKENIZER_FILES:
        src = os.path.join(source_dir, name)
        if os.path.isfile(src) and not os.path.exists(os.path.join(out_dir, name)):
            shutil.copy(src, out_dir)


def _ensure_index(out_dir: str) -> None:
    """An index even for a single file (save_pretrained writes one only when it shards), so every
    export has the same layout and tools that read the index find it."""
    index, single = os.path.join(out_dir, INDEX), os.path.join(out_dir, "model.safetensors")
    if os.path.isfile(index) or not os.path.isfile(single):
        return
    with safe_open(single, "pt") as f:
        names = list(f.keys())
    weight_map = dict.fromkeys(names, "model.safetensors")
    with open(index, "w") as f:
        json.dump({"metadata": {"total_size": os.path.getsize(single)}, "weight_map": weight_map}, f, indent=2)


def _is_tied_copy(hf: nn.Module, key: str) -> bool:
    """Whether ``key`` is a tied alias of a loaded parameter (e.g. lm_head.weight of a tied model)."""
    params = dict(hf.named_parameters(remove_duplicate=False))
    target = params.get(key)
    return target is not None and not target.is_meta
