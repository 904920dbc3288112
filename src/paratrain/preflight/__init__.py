"""Every preflight check that needs only the config and the world size.

``check_run`` runs in the launcher (``paratrain train``/``verify``/``find-batch``) before any
process starts, and again in each worker before anything is built, so an impossible layout is
one clear line (ConfigError, exit code 2) instead of a failure deep inside a collective.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

import torch
from torch import nn

from paratrain.batch.plan import BatchPlan, plan_batch
from paratrain.config import Config, ConfigError
from paratrain.data.datasets import dataset_builder
from paratrain.data.packing import IGNORE_INDEX
from paratrain.data.tokens import resolve_model_vocab, resolve_packing, tokens_meta
from paratrain.distributed.layout_checks import (
    check_compression,
    check_grains,
    check_parallel_layout,
    check_pp_layout,
    check_untied,
)
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.models import build, resolve, spec_of
from paratrain.models.hf import check_hf_moe_layout, hf_is_moe
from paratrain.models.lora import import_peft
from paratrain.models.spec import ModelSpec
from paratrain.objectives.registry import Plugin, builtin_of, check_known, plugin_of
from paratrain.precision import check_precision
from paratrain.preflight.support import check_support, gpt_moe

log = logging.getLogger("paratrain")


def check_run(
    cfg: Config,
    world_size: int,
    *,
    model: nn.Module | None = None,
    spec: ModelSpec | None = None,
    loss: Callable | Plugin | None = None,
) -> tuple[ParallelDims, BatchPlan]:
    """Every check that needs only the config and the world size: run before any process starts.

    ``model``: a model object passed to ``train`` instead of the config's builder (pipeline checks count its blocks).
    ``loss``: a loss function or Plugin passed to ``train``: the run's plug-in in loss.name's place,
    checked as the one loss.name names would be (its refused degrees, its flags in support.py's rows).
    ``spec``: that model's spec when ``model`` only stands in for it (``paratrain plan`` passes a
    parameter-free stand-in with the real block count, not to walk an 8B model per layout).
    Fills ``model.args.vocab_size`` of the built-in GPT from a prepared corpus's meta.json (so
    every command and the written config.toml see the size the model is built with).
    """
    check_paths(cfg)
    check_known(cfg.loss)  # an unknown loss.name, in one line (a loss passed to train() is checked when built)
    resolve(cfg.model)
    dataset_builder(cfg.data)
    resolve_model_vocab(cfg.model, cfg.data)
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    check_compression(cfg.comm, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp, pp=dims.pp)
    check_precision(cfg.precision, dp_shard=dims.dp_shard, tp=dims.tp, pp=dims.pp, compression=cfg.comm.compression)
    check_parallel_layout(dims, parallel=cfg.parallel)
    mbs = cfg.batch.micro_batch_size
    # 'auto' is resolved in the job (batch/auto.py); until then the plan is the whole per-rank batch.
    plan = plan_batch(
        global_batch_size=cfg.batch.global_batch_size, micro_batch_size=0 if mbs == "auto" else mbs, dp=dims.dp
    )
    check_feature_combinations(cfg, dims, plugin_of(cfg.loss, loss))
    if dims.cp > 1 or cfg.model.args.get("moe") is not None:  # the model's own checks of cp and ep
        check_degrees(cfg, dims, spec or spec_of(cfg.model, model))
    check_packing(cfg, dims)
    if dims.cp > 1:
        check_cp_rows(cfg, dims, spec or spec_of(cfg.model, model))
    eval_plan = check_eval(cfg, dims, plan)
    if cfg.run.bitwise:  # after the refusals of support.py: data parallel and accumulation only
        check_grains(
            grain=cfg.run.bitwise_grain,
            micro_batch_size=plan.micro_batch_size,
            per_rank=plan.per_rank_batch_size,
            dp=dims.dp,
            eval_micro_batch_size=eval_plan.micro_batch_size,
        )
    check_rl(cfg, dims, plan)
    if dims.tp > 1 or dims.pp > 1:
        meta_model, spec = model_on_meta(cfg, model, spec)
        check_model_layout(cfg, spec, tp=dims.tp)
        if dims.pp > 1:
            check_pp_layout_of(cfg, dims, plan, model=meta_model, spec=spec)
    elif not cfg.model.factory:
        check_model_layout(cfg, spec or spec_of(cfg.model, model), tp=1)
    return dims, plan


def check_rl(cfg: Config, dims: ParallelDims, plan: BatchPlan) -> None:
    """``loss.name = 'grpo'`` (docs/grpo.md): a step's global batch is whole groups of completions,
    each data-parallel rank holds whole groups, the data are prompts, a checkpoint falls between
    generation rounds."""
    plugin = builtin_of(cfg.loss)  # a user's loss never generates (objectives/registry.py)
    if plugin is None or plugin.rows != "prompts":
        if cfg.data.name == "prompts" and not cfg.data.factory:
            raise ConfigError(
                f"data.name = 'prompts' holds prompts to generate from, which loss.name = {cfg.loss.name!r} cannot"
                " train on; set loss.name = 'grpo' (docs/grpo.md)"
            )
        return
    r, gbs = cfg.rl, plan.global_batch_size
    if cfg.data.name != "prompts" or cfg.data.factory:
        raise ConfigError("loss.name = 'grpo' generates from prompts: set data.name = 'prompts' (docs/grpo.md)")
    if gbs % r.group_size or (gbs // r.group_size) % dims.dp:
        raise ConfigError(
            f"batch.global_batch_size = {gbs} must be whole groups of rl.group_size = {r.group_size} completions, as"
            f" many on each of the {dims.dp} data-parallel rank(s): a multiple of {r.group_size * dims.dp}"
        )
    if cfg.eval.interval:
        raise ConfigError(
            "loss.name = 'grpo' has no validation loss yet (its reward is logged every step); set eval.interval = 0"
        )
    rounds = r.steps_per_generation * r.epochs_per_generation
    if cfg.checkpoint.interval and cfg.checkpoint.interval % rounds:
        raise ConfigError(
            f"checkpoint.interval = {cfg.checkpoint.interval} must be a multiple of a generation round's {rounds}"
            " steps (rl.steps_per_generation x rl.epochs_per_generation): a round's completions are not saved"
        )


def check_paths(cfg: Config) -> None:
    """run.out_dir, checkpoint.dir and preference.store must be folders (or creatable): no file on
    their way (a store on a file stopped the precompute in a FileExistsError traceback)."""
    store = cfg.preference.store if cfg.preference.precompute else ""
    for key, path in (
        ("run.out_dir", cfg.run.out_dir),
        ("checkpoint.dir", cfg.checkpoint.dir),
        ("preference.store", store),
    ):
        if not path:
            continue
        if os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"{key} = {path!r} is a file, not a folder; choose a folder path")
        parent = os.path.dirname(os.path.abspath(path))
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise ConfigError(f"{key} = {path!r} lies under the file {parent!r}; choose a folder path")


def model_on_meta(
    cfg: Config, model: nn.Module | None, spec: ModelSpec | None = None
) -> tuple[nn.Module | None, ModelSpec]:
    """The model (built on the meta device: no memory) and its spec, for checks that look inside it.

    A factory that cannot run on meta gives (None, its default spec): the job checks at start.
    """
    if model is not None:
        return model, spec or spec_of(cfg.model, model)
    try:
        with torch.device("meta"):
            return build(cfg.model)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a factory that cannot run on meta: checked at start instead
        log.debug("cannot build the model on the meta device (%s); checked at start instead", e)
        return None, spec_of(cfg.model)


def check_model_layout(cfg: Config, spec: ModelSpec, *, tp: int) -> None:
    """The model's own checks (its spec's) and what the data asks of it."""
    user_plan = bool(cfg.parallel.tp_plan or cfg.parallel.tp_plan_factory)
    if tp > 1 and not user_plan:
        if spec.tp_plan is None:
            raise ConfigError(
                f"parallel.tp = {tp} needs a tensor-parallel plan for model.factory ="
                f" {cfg.model.factory!r}; set a [parallel.tp_plan] table or parallel.tp_plan_factory"
            )
        if spec.check_layout is not None:
            spec.check_layout(cfg.model.args, tp=tp, sequence_parallel=cfg.parallel.sequence_parallel)
    block = cfg.data.args.get("block_size")
    if spec.context_length is not None and isinstance(block, int):
        context = spec.context_length(cfg.model.args)
        if context is not None and block > context:
            raise ConfigError(
                f"data.args.block_size = {block} is longer than the model's context"
                f" model.args.block_size = {context}; make them equal"
            )


def check_pp_layout_of(
    cfg: Config, dims: ParallelDims, plan: BatchPlan, *, model: nn.Module | None, spec: ModelSpec
) -> None:
    """check_pp_layout for a whole Config: counts the blocks of ``model`` (None: unknown until start)."""
    n_blocks = None
    if model is not None:
        blocks = spec.blocks(model)
        if not blocks:
            raise ConfigError(
                f"parallel.pp > 1 needs a model whose blocks are in a '{spec.blocks_attr}'"
                f" ModuleList/ModuleDict/Sequential ({type(model).__name__} has none);"
                " restructure the model or set parallel.pp = 1"
            )
        n_blocks = len(blocks)
        check_untied(model, blocks_attr=spec.blocks_attr)
    check_pp_layout(
        cfg.parallel,
        pp=dims.pp,
        micro_batch_size=plan.micro_batch_size,
        accum_steps=plan.accum_steps,
        n_blocks=n_blocks,
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
    )


def check_feature_combinations(cfg: Config, dims: ParallelDims, plugin: Plugin | None = None) -> None:
    """Combinations of features this version cannot run exactly: refused, never run wrongly
    (the table of support.py, for the run's ``plugin``), then the checks of one component's own values."""
    check_support(cfg, dims, plugin)
    if cfg.model.lora.enabled:
        import_peft()
    if cfg.model.hf:  # a transformers mixture of experts (models/hf/moe.py); nothing for a dense one
        check_hf_moe_layout(cfg, tp=dims.tp, pp=dims.pp, cp=dims.cp, ep=dims.ep, dp_shard=dims.dp_shard)


def check_degrees(cfg: Config, dims: ParallelDims, spec: ModelSpec) -> None:
    """What the model's args ask of the cp and ep degrees: its spec's own check (models/spec.py)."""
    if spec.check_degrees is not None:
        spec.check_degrees(cfg.model.args, dims=dims, parallel=cfg.parallel)


def check_packing(cfg: Config, dims: ParallelDims) -> None:
    """Packed documents (data/packing.py): what reads them, and what this version refuses."""
    meta = tokens_meta(cfg.data)
    if meta is None:
        return
    packing = resolve_packing(cfg.data.args.get("packing", ""), meta)
    if packing == "stream":
        return
    if meta.get("document_format") in ("preference", "unpaired"):
        resolve_pad_to(cfg, dims)
    if cfg.loss.ignore_index != IGNORE_INDEX:
        raise ConfigError(
            f"loss.ignore_index = {cfg.loss.ignore_index}: packed documents mark what is not a target with"
            f" {IGNORE_INDEX}; set loss.ignore_index = {IGNORE_INDEX}"
        )
    if cfg.model.factory:
        raise ConfigError(
            f"data.args.packing = {packing!r} feeds (batch, 2, T) token and position ids, which the built-in GPT and"
            " model.hf read; a model.factory model does not (yet): use one of those"
        )


def resolve_pad_to(cfg: Config, dims: ParallelDims) -> None:
    """A preference corpus's rows end at their micro-batch's longest pair (data/preference.py),
    rounded up to ``data.args.pad_to``: by default 8, a multiple of tp with sequence parallel (each
    tp rank holds an equal part of the sequence) and of 2 x cp with context parallel (a row is cut
    into 2 x cp chunks), and 0 (rows of block_size, one shape, one graph) under train.compile and
    pipeline parallel (whose schedule runs one shape), and for a mixture of experts, whose balance
    loss and expert counts take every position of a row (models/gpt/moe.py sequence_balance_loss):
    a row cut to its micro-batch's longest pair would change them with the micro-batch size.
    Written into ``data.args`` so that config.toml records it."""
    sp = dims.tp if dims.tp > 1 and cfg.parallel.sequence_parallel else 1
    parts = math.lcm(sp, 2 * dims.cp if dims.cp > 1 else 1)
    pad_to = cfg.data.args.get("pad_to")
    moe = hf_is_moe(cfg) if cfg.model.hf else gpt_moe(cfg)
    if pad_to is None:
        one_shape = cfg.train.compile or dims.pp > 1 or cfg.run.bitwise  # bitwise: a grain's shape is fixed
        cfg.data.args = {**cfg.data.args, "pad_to": 0 if one_shape or moe else math.lcm(8, parts)}
    elif not isinstance(pad_to, int) or isinstance(pad_to, bool) or pad_to < 0:
        raise ConfigError(f"data.args.pad_to = {pad_to!r} must be an integer >= 0 (0: every row block_size wide)")
    elif pad_to and moe:
        raise ConfigError(
            f"data.args.pad_to = {pad_to} with a mixture of experts: its balance loss counts every position of a"
            " row, so rows cut to their micro-batch's longest pair would change it with the micro-batch size;"
            " set data.args.pad_to = 0 (rows of block_size)"
        )
    elif pad_to and dims.pp > 1:
        # A pipeline schedule runs the shapes of its first step's pieces (its stages' buffers).
        raise ConfigError(
            f"data.args.pad_to = {pad_to} with parallel.pp = {dims.pp}: pipeline stages run one row width;"
            " set data.args.pad_to = 0 (rows of block_size)"
        )
    elif pad_to % parts:
        why = " and ".join(
            w for w, on in ((f"tp = {sp} (sequence parallel)", sp > 1), (f"2 x cp = {2 * dims.cp}", dims.cp > 1)) if on
        )
        raise ConfigError(
            f"data.args.pad_to = {pad_to}: rows must split into equal parts over {why};"
            f" use a multiple of {parts}, or 0 (rows of block_size)"
        )


def check_cp_rows(cfg: Config, dims: ParallelDims, spec: ModelSpec) -> None:
    """Context parallel (docs/context-parallel.md): each row splits into 2 x cp equal chunks. The
    row is the data's block size, or the model's context length (its spec) when the data sets none."""
    block = cfg.data.args.get("block_size")
    if block is None and spec.context_length is not None:
        block = spec.context_length(cfg.model.args)
    if block is None:
        block = cfg.model.args.get("block_size")
    m = 2 * dims.cp
    if isinstance(block, int) and block % m:
        low = block - block % m
        sizes = f"{low} or {low + m}" if low else f"{m}"
        raise ConfigError(
            f"data.args.block_size = {block} is not divisible by 2 x parallel.cp = {m} (each row is split into"
            f" {m} chunks); use block_size {sizes}"
        )


def check_eval(cfg: Config, dims: ParallelDims, plan: BatchPlan) -> BatchPlan:
    """The batch plan of validation (also when [eval] is off: `paratrain eval` may still use it).

    Validation runs the configured global batch in eval.micro_batch_size pieces; a pipeline
    schedule is built for one micro-batch size, so there it must be the training one.
    """
    mbs = cfg.eval.micro_batch_size
    if dims.pp > 1 and mbs not in (0, plan.micro_batch_size):
        raise ConfigError(
            f"eval.micro_batch_size = {mbs} differs from the training micro-batch {plan.micro_batch_size};"
            " with parallel.pp > 1 set it to 0 (the pipeline schedule has one micro-batch size)"
        )
    try:
        return plan_batch(
            global_batch_size=cfg.batch.global_batch_size, micro_batch_size=mbs or plan.micro_batch_size, dp=dims.dp
        )
    except ConfigError:
        raise ConfigError(
            f"eval.micro_batch_size = {mbs} does not divide the per-rank batch"
            f" {cfg.batch.global_batch_size // dims.dp}; set it to a divisor of it, or 0"
        ) from None
