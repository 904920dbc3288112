"""What composes with what: the features a layout can combine, and the combinations refused.

One declarative table instead of checks spread over the code. ``FEATURES`` names each feature a
user can turn on, how to tell that a config has it, and the settings that turn it on (its
levels), which is all the combination sweep needs (src/paratrain/testing/sweep.py): a feature declared here is
swept against one process in every pair with the others. ``REFUSALS`` lists the combinations
this version cannot run exactly; ``check_support`` (called by preflight.check_run before any
process starts) raises the first one that a config meets as one line naming the fix, and
``docs/support.md`` is rendered from the same table (``render_support``, checked by
tests/distributed/test_sweep.py). A check of one component's own values (a degree that does not divide, a bad schedule
name) stays with that component; only combinations of features live here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from paratrain.config import Config, ConfigError
from paratrain.distributed.layout_checks import ZERO_BUBBLE
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.models.hf.vision import is_vision_dir
from paratrain.objectives.registry import BUILTIN, Plugin, plugin_of

Check = Callable[[Config, ParallelDims], bool]
# A refused combination's test and line also read the run's plug-in: the one loss.name names or
# the one passed to train(loss=...), resolved once (check_support), so both are seen alike.
RunCheck = Callable[[Config, ParallelDims, Plugin], bool]


@dataclass(frozen=True)
class Feature:
    """A feature a layout can turn on.

    ``on``: whether a config (with its resolved degrees) has it. ``levels``: settings that turn
    it on, by name (``--set`` overrides of a small GPT on a 4-rank world at most); the sweep
    picks one level per feature, or leaves the feature off. ``math``: the feature changes what
    is computed (a model or data option, not a layout), so the sweep's one-process reference
    has it too. ``tolerance``: the relative difference from one process the feature is allowed
    (float rounding of a reduction in another order; bf16 rounding for the bf16 ones).
    ``triples``: the sweep covers every triple of the features so marked (the parallel degrees,
    the loss options and the objectives, where interactions hide), not only every pair.
    """

    name: str
    doc: str
    on: Check
    levels: dict[str, tuple[str, ...]] = field(default_factory=dict)
    math: bool = False
    tolerance: float = 1e-4
    triples: bool = False


def _noise_probe(cfg: Config) -> bool:
    return cfg.batch.adaptive or cfg.optim.lr_scaling == "adascale"


def gpt_moe(cfg: Config) -> bool:
    return cfg.model.args.get("moe") is not None and not (cfg.model.hf or cfg.model.factory)


def _degree(name: str, doc: str, levels: dict[str, tuple[str, ...]] | None = None, **kw) -> Feature:
    """A parallel degree: on above 1, swept at 2 (or at ``levels``), in the triples."""
    levels = levels or {"2": (f"parallel.{name}=2",)}
    return Feature(name, doc, lambda c, d: getattr(d, name) > 1, levels, triples=True, **kw)


FEATURES: dict[str, Feature] = {
    f.name: f
    for f in (
        _degree("dp_replicate", "replicated data parallel (DDP; HSDP's outer dimension with dp_shard)", tolerance=1e-5),
        _degree("dp_shard", "sharded data parallel (FSDP2)"),
        _degree(
            "tp",
            "tensor parallel (DTensor), with or without sequence parallel",
            {"2": ("parallel.tp=2",), "2+sp": ("parallel.tp=2", "parallel.sequence_parallel=true")},
        ),
        _degree(
            "pp",
            "pipeline parallel, by schedule",
            {s: ("parallel.pp=2", f"parallel.pp_schedule='{s}'") for s in ("1f1b", "gpipe", "interleaved1f1b", "zbv")},
        ),
        _degree(
            "cp",
            "context parallel, by attention",
            {a: ("parallel.cp=2", f"parallel.cp_attention='{a}'") for a in ("ring", "alltoall")},
        ),
        _degree("ep", "expert parallel (needs a mixture of experts)"),
        Feature(
            "moe",
            "the built-in GPT's mixture of experts",
            lambda c, d: gpt_moe(c),
            {"4x2": ("model.args.moe={n_experts = 4, top_k = 2}",)},
            math=True,
            # A router's top-k turns a rounding difference in its scores into another expert's
            # output: the sweep saw 1.2e-4 in grad_norm at dp 2 x tp 2 x ep 2 (3 steps, lr 0.5).
            tolerance=5e-4,
            triples=True,
        ),
        Feature(
            "accumulation",
            "gradient accumulation (micro-batches of one sample)",
            lambda c, d: (
                c.batch.micro_batch_size != "auto"
                and c.batch.global_batch_size // max(d.dp, 1) > c.batch.micro_batch_size
            ),
            {"mbs1": ("batch.micro_batch_size=1",)},
        ),
        Feature(
            "activation_checkpointing",
            "activation checkpointing",
            lambda c, d: c.parallel.activation_checkpointing != "none",
            {m: (f"parallel.activation_checkpointing='{m}'",) for m in ("full", "selective")},
        ),
        Feature(
            "compile",
            "torch.compile of each block",
            lambda c, d: c.train.compile,
            {"on": ("train.compile=true",)},
        ),
        Feature(
            "chunked_loss",
            "the chunked cross-entropy (loss.chunk_size)",
            lambda c, d: c.loss.chunk_size > 0,
            {"16": ("loss.chunk_size=16",)},
            triples=True,
        ),
        Feature(
            "loss_parallel",
            "the loss on vocabulary-sharded logits (needs tp)",
            lambda c, d: c.parallel.loss_parallel and d.tp > 1,
            {"on": ("parallel.loss_parallel=true",)},
            triples=True,
        ),
        Feature(
            "packing",
            "packed documents (block-diagonal attention) or one document per row",
            lambda c, d: c.data.args.get("packing", "stream") != "stream",
            {p: (f"data.args.packing='{p}'",) for p in ("documents", "padded")},
            math=True,
        ),
        Feature(
            "lora",
            "LoRA adapters",
            lambda c, d: c.model.lora.enabled,
            {"qv": ("model.lora.target_modules=['q_proj', 'v_proj']",)},
            math=True,
        ),
        Feature(
            "bf16",
            "bf16 mixed precision",
            lambda c, d: c.precision.dtype == "bf16",
            {"on": ("precision.dtype='bf16'",)},
            math=True,
            tolerance=2e-2,
        ),
        Feature(
            "compression",
            "bf16 gradient compression",
            lambda c, d: c.comm.compression != "none",
            {"bf16": ("comm.compression='bf16'",)},
            tolerance=2e-2,
        ),
    )
}


@dataclass(frozen=True)
class Refusal:
    """A combination this version does not run: ``features`` together, ``when`` a config meets
    it, ``message`` the one line that names it and the fix, ``doc`` the reason for the docs."""

    features: tuple[str, ...]
    when: RunCheck
    message: Callable[[Config, ParallelDims, Plugin], str]
    doc: str


def _probe_name(cfg: Config) -> str:
    return "batch.adaptive = true" if cfg.batch.adaptive else "optim.lr_scaling = 'adascale'"


def _cp_refusal(name: str, what: str, when: Callable[[Config], bool]) -> Refusal:
    return Refusal(
        ("cp", name),
        lambda c, d, p: d.cp > 1 and when(c),
        lambda c, d, p: f"parallel.cp with {what} is not supported yet; set parallel.cp = 1 or drop {what}",
        "not built into the context-parallel attention yet (docs/context-parallel.md)",
    )


def _user(plugin: Plugin) -> bool:
    """A plug-in that is not one of ours: a user's, named by loss.name or passed to train()."""
    return plugin is not BUILTIN.get(plugin.name)


def _named(cfg: Config, plugin: Plugin) -> str:
    """How a line names the run's loss: by ``loss.name``, or as the object passed to train()
    (which then takes loss.name's place: a built-in name that is not this plug-in)."""
    if plugin is BUILTIN.get(cfg.loss.name) or ":" in cfg.loss.name:
        return f"loss.name = {cfg.loss.name!r}"
    return f"the loss passed to train() ({plugin.name!r})"


def _preference(plugin: Plugin) -> bool:
    """A loss the memory estimate and the noise probe do not price (its plug-in's ``priced``: a
    pair per row and a reference, a teacher: objectives/preference.py, distill.py)."""
    return not plugin.priced


def _grpo(plugin: Plugin) -> bool:
    """A loss that generates its rows from prompts (its plug-in's ``rows``: GRPO; a user's never
    does, objectives/registry.py)."""
    return not _user(plugin) and plugin.rows == "prompts"


def _plugin_refusals() -> tuple[Refusal, ...]:
    """The refusals the plug-ins declare (objectives/registry.py ``Plugin.refuses``, ``pipeline``):
    a row per built-in's refused degree, one for a user's refused degrees, and one for an
    objective without pipeline hooks."""
    rows = [
        Refusal(
            (ours.name, degree),
            lambda c, d, p, ours=ours, degree=degree: p is ours and getattr(d, degree) > 1,
            lambda c, d, p, degree=degree, why=why: _refused_line(c, d, p, degree, why),
            why,
        )
        for ours in BUILTIN.values()
        for degree, why in ours.refuses
    ]
    rows.append(
        Refusal(
            ("a user's objective", "the degrees it refuses"),
            lambda c, d, p: _user(p) and _refused_by(p, d) is not None,
            lambda c, d, p: _refused_line(c, d, p, *_refused_by(p, d)),
            "its plug-in declares them (Plugin.refuses, docs/objectives.md)",
        )
    )
    rows.append(
        Refusal(
            ("an objective without pipeline hooks", "pp"),
            lambda c, d, p: d.pp > 1 and p.objective is not None and not p.pipeline,
            lambda c, d, p: (
                f"{_named(c, p)}: its objective declares no pipeline hooks (Objective.pipeline_rows,"
                " objectives/base.py; Plugin(pipeline=True)); set parallel.pp = 1 or give it them (docs/objectives.md)"
            ),
            "the schedule runs the loss per piece of rows on the last stage: an objective declares how (docs/objectives.md)",
        )
    )
    return tuple(rows)


def _refused_line(cfg: Config, dims: ParallelDims, plugin: Plugin, degree: str, why: str) -> str:
    return (
        f"{_named(cfg, plugin)} does not run with parallel.{degree} = {getattr(dims, degree)}:"
        f" {why}; set parallel.{degree} = 1"
    )


def _refused_by(plugin: Plugin, dims: ParallelDims) -> tuple[str, str] | None:
    """The first degree > 1 that ``plugin`` refuses, with its reason."""
    return next(((k, why) for k, why in plugin.refuses if getattr(dims, k, 1) > 1), None)


def _over_batch(cfg: Config, plugin: Plugin) -> bool:
    """A loss over the whole global batch (objectives/batch_loss.py, the gradient cache)."""
    return plugin.over_batch or cfg.loss.over == "global_batch"


def _over_batch_refusal(degree: str) -> Refusal:
    # Tensor parallel composes: every tp rank holds the whole outputs of its data-parallel rank's
    # rows and backpropagates the same cached gradient of them.
    return Refusal(
        ("loss over the global batch", degree),
        lambda c, d, p: _over_batch(c, p) and getattr(d, degree) > 1,
        lambda c, d, p: (
            f"{_named(c, p)} (over the whole global batch) runs on data parallel (DDP, FSDP2), tensor parallel"
            f" and accumulation only, not with parallel.{degree} = {getattr(d, degree)}; set parallel.{degree} = 1"
            " (docs/batch-math.md)"
        ),
        "the gradient cache gathers every output of the global batch on each rank: not built for this degree yet",
    )


def _bitwise(name: str, when: RunCheck, what: str, fix: str, why: str) -> Refusal:
    """A feature run.bitwise (distributed/bitwise.py, docs/bitwise.md) is not built for yet."""
    return Refusal(
        ("bitwise", name),
        lambda c, d, p: c.run.bitwise and when(c, d, p),
        lambda c, d, p: (
            f"run.bitwise = true does not run with {what(c, d, p) if callable(what) else what} ({why}); {fix}"
        ),
        why,
    )


def _bitwise_degree(degree: str, why: str) -> Refusal:
    return _bitwise(
        degree,
        lambda c, d, p: getattr(d, degree) > 1,
        lambda c, d, p: f"parallel.{degree} = {getattr(d, degree)}",
        f"set parallel.{degree} = 1 or run.bitwise = false",
        why,
    )


# run.bitwise (issue 59): one process, accumulation, DDP, FSDP2 and HSDP. Each row below is a sum
# over samples whose order the grain tree does not fix yet, or a feature not checked bit for bit.
BITWISE_REFUSALS: tuple[Refusal, ...] = (
    _bitwise(
        "fsdp low precision",
        lambda c, d, p: d.dp_shard > 1 and c.precision.dtype != "fp32",
        lambda c, d, p: f"parallel.dp_shard = {d.dp_shard} and precision.dtype = {c.precision.dtype!r}",
        "use precision.dtype = 'fp32' or parallel.dp_replicate (DDP)",
        "not checked bit for bit: FSDP2 casts the gathered parameters where one process runs autocast",
    ),
    _bitwise(
        "optimizer kernel",
        lambda c, d, p: c.optim.implementation in ("fused", "foreach"),
        lambda c, d, p: f"optim.implementation = {c.optim.implementation!r}",
        "set optim.implementation = 'auto' (the loop under run.bitwise)",
        "FSDP2's shards take no fused kernel, and the fused one rounds otherwise than the loop",
    ),
    _bitwise_degree("tp", "a tensor-parallel matmul sums over ranks in the collective's order"),
    _bitwise_degree("pp", "the pipeline schedule cuts the rows itself, not into grains"),
    _bitwise_degree("cp", "context-parallel attention sums over ranks in the collective's order"),
    _bitwise_degree("ep", "the experts' gradients are reduced outside the grain tree"),
    _bitwise(
        "compression",
        lambda c, d, p: c.comm.compression != "none",
        lambda c, d, p: f"comm.compression = {c.comm.compression!r}",
        "set comm.compression = 'none'",
        "the ranks' gradients are gathered exactly as computed, not compressed",
    ),
    _bitwise(
        "fp16",
        lambda c, d, p: c.precision.dtype == "fp16",
        "precision.dtype = 'fp16'",
        "use precision.dtype = 'bf16' or 'fp32'",
        "its loss scale is not checked bit for bit yet",
    ),
    _bitwise(
        "compile",
        lambda c, d, p: c.train.compile,
        "train.compile = true",
        "set train.compile = false",
        # Checked: compiled runs agree bit for bit across layouts (1 process x16, x4 accumulation 4,
        # 2 ranks x4; 6 steps, no validation). But validation at a layout's own micro-batch can
        # make torch.compile recompile the blocks for dynamic shapes, whose kernels may round otherwise.
        "a validation at the layout's micro-batch may recompile the blocks for dynamic shapes",
    ),
    _bitwise(
        "batch size adjustment",
        lambda c, d, p: _noise_probe(c) or c.batch.micro_batch_size == "auto",
        lambda c, d, p: _probe_name(c) if _noise_probe(c) else "batch.micro_batch_size = 'auto'",
        "give batch.micro_batch_size as a multiple of run.bitwise_grain and keep the batch fixed",
        "the micro-batch must be a multiple of the grain chosen before the run",
    ),
    # Accepted (docs/bitwise.md): the preference pairs and the reward model (a pair's terms are its
    # row's), KTO (its z0 summed over the global batch's rows gathered in order), distillation (a
    # token's teacher logits are its row's) and a loss over the global batch (the gradient cache's
    # gradient of each output is taken from the whole batch gathered in global order, the same
    # tensor on every layout): each objective runs per grain, its own forwards too.
    _bitwise(
        "grpo",
        lambda c, d, p: _grpo(p),
        lambda c, d, p: _named(c, p),
        "use an objective over the data set's rows",
        "its completions are generated and scored in batches of each rank's prompts, not checked bit for bit",
    ),
    _bitwise(
        "a user's objective",
        lambda c, d, p: _user(p) and p.objective is not None,
        lambda c, d, p: f"{_named(c, p)} (a plug-in with its own objective)",
        "use a (sum, count) loss per row",
        "its terms are its own: whether a grain's gradient is its rows' own is not known",
    ),
    _bitwise(
        "reference store",
        lambda c, d, p: p.objective is not None and c.preference.precompute,
        "preference.precompute = true",
        "set preference.precompute = false (the reference then runs per grain)",
        "the store computes the reference per micro-batch, not per grain",
    ),
    _bitwise(
        "pad_to",
        lambda c, d, p: bool(c.data.args.get("pad_to")),
        lambda c, d, p: f"data.args.pad_to = {c.data.args.get('pad_to')}",
        "set data.args.pad_to = 0 (rows of block_size, its default under run.bitwise)",
        "a preference row's width is its micro-batch's longest pair",
    ),
    _bitwise(
        "moe",
        lambda c, d, p: gpt_moe(c),
        "model.args.moe",
        "use a dense model",
        "the balance loss's statistics are a sum over the micro-batch's tokens",
    ),
    _bitwise(
        "packing padded",
        lambda c, d, p: c.data.args.get("packing") == "padded",
        "data.args.packing = 'padded'",
        "use data.args.packing = 'documents' (the same losses)",
        "a padded row's width depends on its micro-batch",
    ),
)


def _vision(cfg: Config) -> bool:
    """model.hf holds an image-text model (models/hf/vision.py)."""
    return bool(cfg.model.hf) and is_vision_dir(cfg.model.hf)


def _vision_refusal(feature: str, when: RunCheck, what: str, fix: str, why: str) -> Refusal:
    """What issue 57's first slice (image-text SFT on the data-parallel layouts) does not run yet."""
    return Refusal(
        ("vision-language model", feature),
        lambda c, d, p: _vision(c) and when(c, d, p),
        lambda c, d, p: f"{what} with an image-text model.hf is not supported yet ({why}); {fix}",
        f"not in the first slice of image-text training (issue 57): {why}",
    )


def refuse_image_estimate(cfg: Config, command: str) -> None:
    """``paratrain plan`` / ``find-batch`` of image-text preference pairs: one line (the estimate's
    probe micro-batches are the widest image rows, batch/measure.py; a pair's are not chosen yet)."""
    if _vision(cfg) and plugin_of(cfg.loss).rows == "pairs":
        raise ConfigError(
            f"{command} does not estimate image-text preference pairs yet (issue 57: their probe rows are not"
            " chosen by their images); give batch.micro_batch_size as a number and the layout as parallel.* keys"
        )


def refuse_unpriced_estimate(cfg: Config, command: str) -> None:
    """``paratrain plan`` / ``find-batch`` of a loss the memory estimate does not price: one line,
    as ``batch.micro_batch_size = 'auto'`` of it is refused below (the estimate once ran their step
    anyway and ended in a traceback: a preference pair's count on fake tensors, GRPO's rollout rows)."""
    plugin = plugin_of(cfg.loss)
    if _preference(plugin):
        why = "a pair per row, a reference or a teacher"
    elif _grpo(plugin):
        why = "the generation of its completions"
    else:
        return
    raise ConfigError(
        f"{command} does not estimate loss.name = {cfg.loss.name!r} yet (the memory estimate does not price {why});"
        " give batch.micro_batch_size as a number and the layout as parallel.* keys"
    )


VISION_REFUSALS = (
    *(
        _vision_refusal(
            degree,
            lambda c, d, p, degree=degree: getattr(d, degree) > 1,
            f"parallel.{degree} > 1",
            f"set parallel.{degree} = 1 (dp_replicate and dp_shard run it exactly)",
            why,
        )
        for degree, why in (
            ("pp", "a pipeline stage would need the image features of its rows"),
            ("cp", "the image tokens of a row cannot be split over ranks yet"),
            ("ep", "no mixture-of-experts image-text family is wired"),
        )
    ),
    _vision_refusal(
        "tp sequence_parallel",
        lambda c, d, p: d.tp > 1 and c.parallel.sequence_parallel,
        "parallel.sequence_parallel = true",
        "set parallel.sequence_parallel = false (parallel.tp itself runs exactly)",
        "the image features are scattered into the whole sequence, and the language model's plan keeps it replicated",
    ),
    _vision_refusal(
        "lora dropout in the vision tower",
        lambda c, d, p: c.model.lora.enabled and c.model.lora.dropout > 0 and c.model.vision != "freeze",
        "model.lora.dropout > 0 with adapters in the vision tower (model.vision = 'train')",
        "set model.vision = 'freeze' (adapters in the decoder only) or model.lora.dropout = 0",
        "the keyed dropout masks follow a row's tokens, and the tower's rows are images",
    ),
    _vision_refusal(
        "objectives without image rows",
        lambda c, d, p: not p.images,
        "loss.name other than 'cross_entropy', 'preference' or 'grpo'",
        "use one of them, or a plug-in that declares Plugin(images=True) (docs/objectives.md)",
        "the objective's plug-in does not declare image rows (Plugin.images): distillation and reward models read none yet",
    ),
    _vision_refusal(
        "grpo engine",
        lambda c, d, p: _grpo(p) and c.rl.engine != "builtin",
        "rl.engine other than 'builtin'",
        "set rl.engine = 'builtin' (the keyed sampler generates from the images)",
        "the engine interface hands an engine token ids only, not a prompt's images",
    ),
    _vision_refusal(
        "grpo multi-turn",
        lambda c, d, p: _grpo(p) and bool(c.rl.environment or c.rl.tools),
        "rl.environment or rl.tools",
        "set rl.environment = '' and rl.tools = [] (single-turn GRPO on images runs)",
        "an episode's later turns are rebuilt from token ids, which do not carry the prompt's images",
    ),
    _vision_refusal(
        "grpo async",
        lambda c, d, p: _grpo(p) and c.rl.async_steps > 0,
        "rl.async_steps > 0",
        "set rl.async_steps = 0",
        "the stale rounds' weight copy of an image-text model is not checked yet",
    ),
    _vision_refusal(
        "model.head score",
        lambda c, d, p: c.model.head != "lm",
        "model.head = 'score'",
        "use model.head = 'lm'",
        "no score head on an image-text model",
    ),
    _vision_refusal(
        "compile",
        lambda c, d, p: c.train.compile,
        "train.compile",
        "set train.compile = false",
        "image rows are padded to each micro-batch's longest, and each width compiles again",
    ),
)


REFUSALS: tuple[Refusal, ...] = (
    *VISION_REFUSALS,
    *(_over_batch_refusal(degree) for degree in ("pp", "cp", "ep")),
    Refusal(
        ("loss over the global batch", "noise_probe"),
        lambda c, d, p: _over_batch(c, p) and _noise_probe(c),
        lambda c, d, p: (
            f"{_named(c, p)} is over the whole global batch, which {_probe_name(c)}'s per-micro-batch"
            " gradient-noise probe does not see; turn it off"
        ),
        "the gradient-noise probe reads a micro-batch's own gradient, which a loss over the whole batch does not have",
    ),
    Refusal(
        ("preference", "noise_probe"),
        lambda c, d, p: _preference(p) and _noise_probe(c),
        lambda c, d, p: (
            f"{_named(c, p)} with {_probe_name(c)} is not supported: the gradient-noise probe"
            " runs an item loss; turn it off"
        ),
        "the gradient-noise probe splits a micro-batch's item loss; these losses run a second model",
    ),
    # Its objective computes its own terms: no item loss for the probe to split (it stopped in
    # AttributeError: 'SampleNLL' object has no attribute 'loss_fn', named or passed alike).
    Refusal(
        ("a user's objective", "noise_probe"),
        lambda c, d, p: _user(p) and p.objective is not None and _noise_probe(c),
        lambda c, d, p: (
            f"{_named(c, p)} (a plug-in with its own objective) with {_probe_name(c)} is not supported: the"
            " gradient-noise probe runs an item loss; turn it off"
        ),
        "the gradient-noise probe splits a micro-batch's item loss; an objective computes its own terms",
    ),
    Refusal(
        ("preference", "auto micro-batch"),
        lambda c, d, p: _preference(p) and c.batch.micro_batch_size == "auto",
        lambda c, d, p: (
            f"{_named(c, p)} with batch.micro_batch_size = 'auto' is not supported: the estimate"
            " does not price this loss (a pair per row, a reference or a teacher) yet; give batch.micro_batch_size as a number"
        ),
        "the memory estimate does not price these losses (a pair per row, a reference or a teacher) yet",
    ),
    *_plugin_refusals(),
    # The sampler's forwards of one new token cannot be cut along the sequence over the tp ranks.
    Refusal(
        ("grpo", "tp+sp"),
        lambda c, d, p: _grpo(p) and d.tp > 1 and c.parallel.sequence_parallel,
        lambda c, d, p: (
            "loss.name = 'grpo' with parallel.sequence_parallel = true is not supported: the sampler's one-token"
            " forwards cannot be split along the sequence; set parallel.sequence_parallel = false"
        ),
        "the sampler feeds one new token per forward, which sequence parallelism cannot split over the tp ranks",
    ),
    Refusal(
        ("grpo", "batch size adjustment"),
        lambda c, d, p: _grpo(p) and (_noise_probe(c) or c.batch.micro_batch_size == "auto"),
        lambda c, d, p: (
            "loss.name = 'grpo' keeps batch.global_batch_size fixed (a whole number of groups per step) and does not"
            " price generation in the memory estimate; set batch.adaptive = false, optim.lr_scaling other than"
            " 'adascale' and batch.micro_batch_size to a number"
        ),
        "a step's global batch is whole groups of completions of one generation; the memory estimate does not"
        " price the generation phase yet",
    ),
    Refusal(
        ("fused_optimizer", "dp_shard", "tp", "ep"),
        # optim.py: torch 2.13 runs neither kernel on these layouts' CPU DTensors (mixed lists).
        lambda c, d, p: (
            c.optim.implementation in ("fused", "foreach")
            and (d.fsdp_enabled or d.tp > 1 or (bool(c.model.hf) and d.ep > 1))
        ),
        lambda c, d, p: (
            f"optim.implementation = {c.optim.implementation!r} takes plain tensors only (DDP), and this"
            " layout shards parameters (FSDP2, tp, cp or ep); set optim.implementation = 'auto' or 'for-loop'"
        ),
        "torch 2.13 runs neither kernel on CPU DTensors; `auto` or `for-loop` does",
    ),
    # The gradient-noise probe reads each rank's gradient after its first micro-batch.
    Refusal(
        ("noise_probe", "pp"),
        lambda c, d, p: _noise_probe(c) and d.pp > 1,
        lambda c, d, p: (
            f"{_probe_name(c)} cannot measure the gradient noise across pipeline stages;"
            " set parallel.pp = 1 or turn it off"
        ),
        "the gradient-noise probe reads each rank's own gradient after its first micro-batch, which a stage does not hold",
    ),
    Refusal(
        ("noise_probe", "dp_shard"),
        lambda c, d, p: _noise_probe(c) and d.dp_shard > 1,
        lambda c, d, p: (
            f"{_probe_name(c)} needs each rank's own gradient, which FSDP2 (parallel.dp_shard ="
            f" {d.dp_shard}) reduce-scatters or keeps unsharded; use parallel.dp_replicate"
        ),
        "FSDP2 reduce-scatters each rank's gradient; DDP keeps it",
    ),
    Refusal(
        ("noise_probe", "fp16"),
        lambda c, d, p: _noise_probe(c) and c.precision.dtype == "fp16",
        lambda c, d, p: (
            f"{_probe_name(c)} with precision.dtype = 'fp16' would read loss-scaled gradients;"
            " use precision.dtype = 'bf16'"
        ),
        "the probe would read loss-scaled gradients",
    ),
    # Under sequence parallel a block's linear layers see DTensor inputs, which the replicated
    # half of an adapter (a plain module) cannot take (docs/lora.md).
    Refusal(
        ("lora", "tp+sp"),
        lambda c, d, p: c.model.lora.enabled and d.tp > 1 and c.parallel.sequence_parallel,
        lambda c, d, p: (
            "model.lora with parallel.sequence_parallel = true is not supported yet; set"
            " parallel.sequence_parallel = false (tensor parallel itself is supported)"
        ),
        "an adapter's replicated half cannot take sequence-parallel DTensor inputs (docs/lora.md)",
    ),
    Refusal(
        ("ep", "no moe"),
        lambda c, d, p: d.ep > 1 and not c.model.hf and not gpt_moe(c),
        lambda c, d, p: (
            "parallel.ep > 1 needs the built-in GPT with a mixture of experts (model.args.moe); set parallel.ep = 1"
        ),
        "expert parallel shards experts; a dense model has none (model.hf checks its own, models/hf/moe.py)",
    ),
    Refusal(
        ("pp", "auto micro-batch"),
        lambda c, d, p: d.pp > 1 and c.batch.micro_batch_size == "auto",
        lambda c, d, p: (
            "batch.micro_batch_size = 'auto' cannot estimate a pipeline step yet;"
            " set batch.micro_batch_size to a number with parallel.pp > 1"
        ),
        "the memory estimate does not model a pipeline step yet",
    ),
    # Not tested: the split weight pass of these schedules would have to find the auxiliary
    # loss's path too.
    Refusal(
        ("moe", "pp zero-bubble"),
        lambda c, d, p: gpt_moe(c) and d.pp > 1 and c.parallel.pp_schedule in ZERO_BUBBLE,
        lambda c, d, p: (
            f"model.args.moe with parallel.pp_schedule = '{c.parallel.pp_schedule}' is not supported"
            " yet; use 'gpipe', '1f1b', 'interleaved1f1b' or 'looped_bfs'"
        ),
        "the split weight pass would have to follow the auxiliary loss's path too; not tested",
    ),
    Refusal(
        ("moe", "noise_probe"),
        lambda c, d, p: gpt_moe(c) and _noise_probe(c),
        lambda c, d, p: f"model.args.moe with {_probe_name(c)} is not supported yet; turn it off (see docs/moe.md)",
        "not tested together (docs/moe.md)",
    ),
    # A pipeline stage is built for the shapes of the first step's inputs (torch.distributed.
    # pipelining infers them once); padded rows take the width of each batch's longest document.
    Refusal(
        ("pp", "packing padded"),
        lambda c, d, p: d.pp > 1 and c.data.args.get("packing") == "padded",
        lambda c, d, p: (
            "parallel.pp with data.args.packing = 'padded' is not supported: padded rows change"
            " width every batch, a pipeline stage runs one shape; use data.args.packing = 'documents'"
            " (the same losses)"
        ),
        "pipeline stages run one input shape; padded rows are as wide as each batch's longest document",
    ),
    # The context-parallel attention's backward (distributed/context_parallel.py) is one pass with
    # its ring or all-to-all exchanges; a zero-bubble schedule splits each backward into input and
    # weight passes, and the sweep found the gradients wrong (pp zbv x cp ring: 2% at step 1).
    Refusal(
        ("cp", "pp zero-bubble"),
        lambda c, d, p: d.cp > 1 and d.pp > 1 and c.parallel.pp_schedule in ZERO_BUBBLE,
        lambda c, d, p: (
            f"parallel.cp with parallel.pp_schedule = '{c.parallel.pp_schedule}' is not supported yet"
            " (the context-parallel attention's backward is not split into input and weight passes);"
            " use 'gpipe', '1f1b', 'interleaved1f1b' or 'looped_bfs'"
        ),
        "the context-parallel attention's backward is not split into a zero-bubble schedule's input and weight passes",
    ),
    # torch 2.13's AOTAutograd asserts on the saved parameters of a compiled, fully checkpointed
    # tensor-parallel block ("expected all tensors_saved_with_vc_check to be Tensors": the saved
    # values hold the DeviceMesh), in a pipeline stage (gpipe, zbv) and without one (world 2, tp 2).
    Refusal(
        ("compile", "tp", "activation_checkpointing full"),
        lambda c, d, p: c.train.compile and d.tp > 1 and c.parallel.activation_checkpointing == "full",
        lambda c, d, p: (
            "train.compile with parallel.tp > 1 and parallel.activation_checkpointing = 'full' is not supported"
            " (torch 2.13 cannot run the compiled blocks' backward there); drop one of them, e.g."
            " parallel.activation_checkpointing = 'selective'"
        ),
        "torch 2.13's compiled backward of fully checkpointed tensor-parallel blocks fails",
    ),
    # torch.compile specialises on the row width; padded rows change it every micro-batch, so each
    # width is another compile, and past dynamo's recompile limit the sweep saw a RecursionError.
    Refusal(
        ("compile", "packing padded"),
        lambda c, d, p: c.train.compile and c.data.args.get("packing") == "padded",
        lambda c, d, p: (
            "train.compile with data.args.packing = 'padded' is not supported: padded rows change width"
            " every micro-batch and each width compiles again; use data.args.packing = 'documents' (the same losses)"
        ),
        "compiled blocks specialise on the row width, which padded rows change every micro-batch",
    ),
    # Sequence parallel splits each row's positions evenly over the tp ranks; a padded row is as
    # long as its batch's longest document, often not a multiple of tp.
    Refusal(
        ("tp+sp", "packing padded"),
        lambda c, d, p: d.tp > 1 and c.parallel.sequence_parallel and c.data.args.get("packing") == "padded",
        lambda c, d, p: (
            "parallel.sequence_parallel = true with data.args.packing = 'padded' is not supported:"
            " padded rows take the width of each batch's longest document, which sequence parallel cannot"
            " split evenly; use data.args.packing = 'documents' (the same losses)"
        ),
        "padded rows have any width; sequence parallel splits it evenly over the tp ranks",
    ),
    # Expert dispatch exchanges its split sizes inside the block; torch's selective checkpointing
    # finds a different sequence of ops when it replays the block and stops the backward.
    Refusal(
        ("ep", "activation_checkpointing selective"),
        lambda c, d, p: d.ep > 1 and c.parallel.activation_checkpointing == "selective",
        lambda c, d, p: (
            "parallel.activation_checkpointing = 'selective' with parallel.ep > 1 is not supported yet;"
            " use parallel.activation_checkpointing = 'full' (or 'none')"
        ),
        "the expert all-to-all replays differently under torch's selective checkpointing; `full` works",
    ),
    _cp_refusal("tp+sp", "parallel.sequence_parallel", lambda c: c.parallel.sequence_parallel),
    _cp_refusal("model.factory", "model.factory", lambda c: bool(c.model.factory)),
    _cp_refusal(
        "flex attention", "model.args.attention = 'flex'", lambda c: c.model.args.get("attention", "sdpa") != "sdpa"
    ),
    _cp_refusal("compression", "comm.compression", lambda c: c.comm.compression != "none"),
    _cp_refusal("noise_probe", "the gradient-noise probe (batch.adaptive, adascale)", _noise_probe),
    _cp_refusal("auto micro-batch", "batch.micro_batch_size = 'auto'", lambda c: c.batch.micro_batch_size == "auto"),
    _cp_refusal("packing padded", "data.args.packing = 'padded'", lambda c: c.data.args.get("packing") == "padded"),
    *BITWISE_REFUSALS,
)


def check_support(cfg: Config, dims: ParallelDims, plugin: Plugin | None = None) -> None:
    """Raise the first refused combination ``cfg`` meets (ConfigError, one line with the fix).
    ``plugin``: the run's plug-in (preflight.check_run resolves it once, from loss.name or the
    loss passed to train()); by default the one loss.name names."""
    plugin = plugin or plugin_of(cfg.loss)
    for refusal in REFUSALS:
        if refusal.when(cfg, dims, plugin):
            raise ConfigError(refusal.message(cfg, dims, plugin))


def render_support() -> str:
    """docs/support.md: the features and the refused combinations, from the tables above."""
    lines = [
        "# What composes with what",
        "",
        "<!-- Rendered from src/paratrain/preflight/support.py (render_support); tests/distributed/test_sweep.py checks it. -->",
        "",
        "Every feature below composes with every other one unless a row of the second table refuses",
        "the combination (or a component's own check does, such as a pipeline schedule's): `paratrain",
        "train` then exits with code 2 and one line naming the fix, before any process starts. The",
        "combination sweep (`tests/distributed/test_sweep.py`, [combinations.md](combinations.md)) runs every pair",
        "of these features, and every triple of those marked for it, against one process.",
        "",
        "| feature | what it is | levels swept | tolerance against one process | in triples |",
        "|---|---|---|---|---|",
    ]
    for f in FEATURES.values():
        levels = ", ".join(f"`{name}`" for name in f.levels)
        lines.append(f"| `{f.name}` | {f.doc} | {levels} | {f.tolerance:g} | {'yes' if f.triples else ''} |")
    lines += ["", "| refused together | why |", "|---|---|"]
    for r in REFUSALS:
        lines.append(f"| {' + '.join(r.features)} | {r.doc} |")
    return "\n".join(lines) + "\n"
