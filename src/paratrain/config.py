"""Typed run configuration: nested dataclasses, TOML files and ``--set`` overrides.

Precedence, stated once: defaults < config file < ``--set section.key=value`` (left to right).
Every field carries its documentation in ``metadata["doc"]``; ``paratrain config --keys``
prints them. Any bad input raises :class:`ConfigError`, which the CLI turns into one line on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
import tomllib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal


class ConfigError(ValueError):
    """Bad user input: the message is one line naming the key and the fix."""


def opt(default: Any, doc: str) -> Any:
    """A config field with a default and its documentation (a table of keys: a dataclass default)."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    if dataclasses.is_dataclass(default):
        return field(default_factory=lambda: dataclasses.replace(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class RunConfig:
    out_dir: str = opt("runs/default", "Directory for config.toml, metrics.jsonl, summary.json, plots and weights.")
    seed: int = opt(0, "Seed of the model init and of the sampler; the run is a pure function of it.")
    steps: int = opt(100, "Number of optimiser steps.")
    max_samples: int = opt(
        0, "Also stop once this many samples are consumed (a sample budget, e.g. with batch.adaptive); 0 = no limit."
    )
    progress: bool = opt(True, "Show a progress bar on rank 0.")
    log_all_ranks: bool = opt(False, "Print log lines from every rank, not only rank 0.")
    save_model: bool = opt(True, "Write the final full weights to out_dir/model.safetensors.")
    keyed_random: bool = opt(
        True,
        "Draw every random number from the sample it belongs to: a dataset's __getitem__ runs with torch's, numpy's and Python's global RNGs seeded from (seed, epoch, index), and dropout masks come from (seed, epoch, index, module, position), so a run is the same on every layout (docs/randomness.md). false: each rank's own RNG streams (not layout-exact).",
    )
    layout_dependent: bool = opt(
        False,
        "Accept a run whose math depends on the layout (what the start-of-run probe finds: BatchNorm, random draws outside the keyed path, a loss over the batch) instead of stopping with exit 2 (docs/layout-probe.md).",
    )
    probe: bool = opt(
        True,
        "Run the start-of-run layout probe: before the first step, the first micro-batch's loss whole and split in two halves on each process, forward only; a difference (BatchNorm, random draws outside the keyed path, a loss over the batch) stops the run with exit 2 naming the first module that differs, unless run.layout_dependent = true (docs/layout-probe.md).",
    )
    bitwise: bool = opt(
        False,
        "Make the weights after every step the same bits on any number of processes (DDP, FSDP2, HSDP) and any accumulation: each backward runs on run.bitwise_grain rows and the gradients are summed in one fixed binary tree over the global batch (docs/bitwise.md). Costs smaller matmuls, a gather of the gradients instead of DDP's all-reduce or FSDP2's reduce-scatter, and the optimiser's for-loop; refuses the layouts not built for it (docs/support.md).",
    )
    bitwise_grain: int = opt(
        0,
        "Rows of each forward and backward under run.bitwise (required there, > 0): every layout's micro-batch must be a multiple of it, and the grains per rank and the data-parallel ranks powers of two.",
    )
    overwrite: bool = opt(
        False,
        "Let `paratrain train` start over in an out_dir that holds another run's outputs (metrics, weights, checkpoints), removing them first; otherwise it is refused unless the run resumes (--resume). `paratrain train --overwrite` sets it.",
    )


@dataclass
class LoraConfig:
    """``[model.lora]``: PEFT's LoRA adapters (docs/lora.md). Off while target_modules is empty."""

    r: int = opt(8, "LoRA rank of each adapter (PEFT's r); > 0.")
    alpha: float = opt(8.0, "LoRA scaling numerator (PEFT's lora_alpha): the update is B @ A x alpha / r.")
    dropout: float = opt(
        0.0,
        "Dropout on the adapters' input (PEFT's lora_dropout), in [0, 1); its masks are keyed by the sample (run.keyed_random, docs/randomness.md).",
    )
    target_modules: list | str = opt(
        [],
        "Layers that get adapters: module names (['q_proj', 'v_proj'] match any module whose name ends with them), globs ('layers.*.mlp.*_proj'), or 'all-linear' (every linear layer but the output layer). Empty: LoRA off.",
    )
    modules_to_save: list = opt(
        [],
        "Modules trained in full beside the adapters (PEFT's modules_to_save, e.g. ['lm_head']); the rest of the model is frozen.",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.target_modules)

    @staticmethod
    def unknown_key(key: str, name: str) -> str | None:
        """The one line for a key PEFT's LoraConfig has and [model.lora] does not (None: not PEFT's)."""
        if name in LORA_PEFT_NAMES:
            return f"{key}.{name} is PEFT's name; write {key}.{LORA_PEFT_NAMES[name]} instead"
        try:
            import peft  # optional (paratrain[lora]); only to name its options in this message
        except ImportError:
            return None
        if name in {f.name for f in dataclasses.fields(peft.LoraConfig)}:
            return (
                f"{key}.{name} is a PEFT LoraConfig option paratrain does not support yet; remove it"
                " (supported: r, alpha, dropout, target_modules, modules_to_save)"
            )
        return None


# PEFT's LoraConfig fields under the names [model.lora] gives them (a PEFT name gets a pointer).
LORA_PEFT_NAMES = {"lora_alpha": "alpha", "lora_dropout": "dropout"}


@dataclass
class ModelConfig:
    name: str = opt("gpt", "Built-in model: 'gpt'. Ignored when factory is set.")
    factory: str = opt("", "User model as 'package.module:function'; called with [model.args] as keyword arguments.")
    args: dict = opt(
        {},
        "Keyword arguments for the model builder (e.g. n_layer, d_model for gpt; moe = {n_experts, top_k, ...} for its mixture of experts, docs/moe.md); with hf, fields of its config.json to override (e.g. num_hidden_layers).",
    )
    hf: str = opt(
        "",
        "A local directory of a transformers causal LM (config.json, optionally *.safetensors and tokenizer files); replaces name/factory. Never a hub name.",
    )
    hf_weights: bool | str = opt(
        "auto",
        "With hf: true loads the directory's safetensors weights (each rank reads only its shards), false initialises from run.seed, 'auto' loads them when present.",
    )
    head: Literal["lm", "score"] = opt(
        "lm",
        "With hf: 'lm', the causal LM's output layer; 'score', a one-label score head as transformers' AutoModelForSequenceClassification (num_labels = 1) builds it, for a reward model (loss.name = 'reward'; docs/preference.md). A directory without its weights gets it initialised from run.seed.",
    )
    vision: Literal["train", "freeze"] = opt(
        "train",
        "With hf holding an image-text model (LLaVA): 'train' trains its vision tower and projector with the language model, 'freeze' keeps them as loaded (docs/vision-language.md).",
    )
    lora: LoraConfig = opt(
        LoraConfig(),
        "[model.lora]: LoRA fine-tuning with PEFT's adapters on model.hf or the built-in GPT; the base weights are frozen (docs/lora.md).",
    )


@dataclass
class DataConfig:
    name: str = opt(
        "stdlib_bytes",
        "Built-in dataset: 'stdlib_bytes' (byte-level LM on Python's standard library), 'tokens' (a corpus made by `paratrain prepare`; args path or sources, block_size), or 'prompts' (prompt rows for loss.name = 'grpo'; args path, tokenizer, max_prompt_length: docs/grpo.md).",
    )
    factory: str = opt(
        "", "User dataset as 'package.module:function' returning a map-style Dataset of (input, target)."
    )
    args: dict = opt({}, "Keyword arguments for the dataset builder (e.g. block_size, max_bytes).")
    shuffle: bool = opt(True, "Shuffle the samples each epoch with a permutation drawn from (seed, epoch).")
    workers: int = opt(
        0,
        "Loader worker processes that prepare the next steps' micro-batches ahead of time (0 = in the training process). The samples are the same for any value.",
    )
    prefetch: int = opt(2, "Steps each loader worker prepares ahead (with data.workers > 0).")
    val_factory: str = opt(
        "",
        "Validation set of a user dataset as 'package.module:function' (called with [data.args] like data.factory); empty: the builder's split='val' set.",
    )


@dataclass
class LossConfig:
    name: str = opt(
        "cross_entropy",
        "'cross_entropy', 'mse', 'info_nce' (in-batch negatives over the global batch: docs/batch-math.md), 'preference' (DPO and its variants over pairs, [preference]: docs/preference.md), 'reward' (a reward model's Bradley-Terry loss over pairs, with model.head = 'score'), 'distill' (a student against a frozen teacher, [distill]), 'grpo' (reinforcement learning on the policy's own completions, [rl]: docs/grpo.md), or 'package.module:function' returning (sum_of_item_losses, item_count).",
    )
    ignore_index: int = opt(-100, "Targets equal to this are not counted (cross_entropy and user losses).")
    over: Literal["items", "global_batch"] = opt(
        "items",
        "What a 'package.module:function' loss sees: 'items' (each micro-batch's output, returning (sum_of_item_losses, item_count)) or 'global_batch' (the outputs of the whole global batch, returning their loss's mean: in-batch negatives, computed exactly by the gradient cache; docs/batch-math.md). 'info_nce' is over the global batch.",
    )
    temperature: float = opt(
        0.05, "The built-in info_nce's temperature (cosines are divided by it) when the model returns no logit scale."
    )
    chunk_size: int = opt(
        0,
        "Positions per chunk of the built-in cross_entropy: the loss takes the model's last hidden states and runs the output layer and the loss chunk by chunk (recomputed in the backward), so the [tokens, vocab] float32 logits never exist at once. 0: the model computes all logits (built-in GPT and model.hf support it).",
    )


PREFERENCE_LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo", "sigmoid_norm", "simpo", "orpo", "kto")


@dataclass
class PreferenceConfig:
    loss_type: str = opt(
        "sigmoid",
        "With loss.name = 'preference': 'sigmoid' (DPO), 'robust', 'hinge', 'ipo', 'sigmoid_norm' (DPO on mean token log-probabilities), 'simpo' or 'orpo' (no reference), or 'kto' (on an unpaired corpus, prepare --format unpaired); docs/preference.md.",
    )
    beta: float = opt(
        0.1,
        "The preference losses' beta (the KL strength of DPO, the reward scale of SimPO, ORPO's odds-ratio weight).",
    )
    label_smoothing: float = opt(
        0.0, "The probability that a pair's label is flipped (cDPO, robust DPO, SimPO); in [0, 0.5)."
    )
    gamma: float = opt(0.5, "SimPO's target reward margin.")
    desirable_weight: float = opt(1.0, "KTO's weight of a desirable example's loss.")
    undesirable_weight: float = opt(1.0, "KTO's weight of an undesirable example's loss.")
    reference: str = opt(
        "",
        "The reference model: 'adapters_off' (the policy with its LoRA adapters off), 'initial' (a frozen copy of the model as built, model.hf's weights), or a transformers model directory; '' = adapters_off with LoRA, else initial.",
    )
    precompute: bool = opt(
        False,
        "Compute the reference's log-probabilities once, before the first step, for every training and validation pair, into preference.store; the reference model is then dropped.",
    )
    store: str = opt(
        "",
        "The folder of the precomputed reference (keyed by the pair: reusable by runs of the same pairs and reference, which compute only the pairs it lacks); '' = run.out_dir/reference_store.",
    )


@dataclass
class DistillConfig:
    teacher: str = opt(
        "",
        "With loss.name = 'distill': the frozen teacher, a transformers model directory of the student's vocabulary.",
    )
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = opt(
        "forward_kl",
        "Per target token: 'forward_kl' KL(teacher || student), 'reverse_kl' KL(student || teacher), or 'jsd' (the generalised Jensen-Shannon divergence of GKD, weighted by beta); docs/preference.md#distillation.",
    )
    temperature: float = opt(1.0, "Both models' logits are divided by it before the softmax.")
    beta: float = opt(0.5, "'jsd''s weight of the teacher in the mixture, in (0, 1).")
    top_k: int = opt(
        0, "> 0: the divergence over the teacher's k most likely tokens (renormalised); 0: the whole vocabulary."
    )


RL_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "token_mean", "seq_mean_token_sum", "seq_mean_token_mean")


@dataclass
class RLConfig:
    group_size: int = opt(
        4,
        "With loss.name = 'grpo': completions generated per prompt (the group whose rewards set each one's advantage); batch.global_batch_size counts completions (docs/grpo.md).",
    )
    max_new_tokens: int = opt(16, "Tokens generated per completion at most (a stop token ends it sooner).")
    temperature: float = opt(
        1.0, "Sampling temperature; the policy's log-probabilities are taken at it too (as TRL's are)."
    )
    top_k: int = opt(0, "Sample among the k most likely tokens (0: all).")
    top_p: float = opt(1.0, "Sample among the most likely tokens whose probabilities sum to top_p (1: all).")
    stop: list = opt(
        [],
        "Token ids that end a completion (kept in it, as a target); [] = the tokenizer's end-of-sequence token (a newline byte on bytes).",
    )
    kv_cache: bool = opt(
        True,
        "Sample with a KV cache (transformers' own with model.hf, the built-in GPT's own): one position per new token. false reruns the whole row buffer per token: slower, the same tokens.",
    )
    generation_batch_size: int = opt(
        0,
        "Rows (completions) one sampler call generates on one rank; 0 = all of the rank's rows of an optimiser step (TRL's default). The tokens do not depend on it (keyed draws); a smaller one holds a smaller KV cache, a larger one takes fewer, wider forwards.",
    )
    engine: str = opt(
        "builtin",
        "Where completions come from (docs/engines.md): 'builtin' (the trainer's model and keyed draws: exact), 'vllm' (a `vllm serve` over HTTP, rl.engine_args url, model, weights_dir), or 'package.module:factory' / 'file.py:factory' returning an engine with sample(prompts, keys, params) -> (tokens, logps) and sync(model). Another engine than the built-in always recomputes the trainer's log-probabilities and logs logp_gap and logp_gap_mean.",
    )
    engine_args: dict = opt(
        {}, "Keyword arguments of rl.engine's factory (for 'vllm': url, model, weights_dir, timeout_s, concurrency)."
    )
    check_logps: bool = opt(
        False,
        "Recompute the completions' log-probabilities after sampling even where no step needs them (on-policy, rl.beta = 0), to log logp_gap (the sampler against the trainer); off-policy steps and beta > 0 always recompute.",
    )
    steps_per_generation: int = opt(
        1, "Optimiser steps on one generation's completions (the generation covers that many global batches)."
    )
    epochs_per_generation: int = opt(1, "Passes over one generation's completions (GRPO's mu).")
    loss_type: str = opt(
        "grpo",
        "'grpo' (= 'seq_mean_token_mean'), 'dr_grpo' (token sum / (completions x max_new_tokens)), 'dapo' (= 'bnpo' = 'token_mean': token sum / completion tokens), or 'seq_mean_token_sum'; every normaliser over the optimiser step's global batch (docs/grpo.md).",
    )
    advantage: Literal["group", "rloo"] = opt(
        "group",
        "The baseline a completion's reward is compared with: 'group', its group's mean (GRPO); 'rloo', the mean of the other G - 1 completions of its group (RLOO, Ahmadian et al. 2024), i.e. G / (G - 1) times the group-centred reward. rl.scale_rewards applies after either.",
    )
    scale_rewards: Literal["group", "none"] = opt(
        "group",
        "'group': advantages divided by the group's reward standard deviation (GRPO); 'none': only centred (Dr. GRPO).",
    )
    epsilon: float = opt(0.2, "The importance ratio is clipped to [1 - epsilon, 1 + epsilon_high].")
    epsilon_high: float = opt(0.0, "The ratio's upper clip (DAPO's clip-higher); 0 = epsilon.")
    beta: float = opt(0.0, "Weight of the KL to the reference (k3 estimator, per token); 0: no reference model is run.")
    reference: str = opt(
        "",
        "The KL's reference with beta > 0: 'adapters_off' (the policy with its LoRA adapters off), 'initial' (a frozen copy of the model as built), or a transformers model directory (e.g. the SFT model the run started from); '' = adapters_off with LoRA, else initial.",
    )
    rewards: list = opt(
        ["exact_match"],
        "Reward functions, summed with reward_weights: 'exact_match' (the completion equals the row's answer_field), 'format' (matches format_pattern), or 'package.module:function' / 'path/to/file.py:function' called as TRL calls one, fn(prompts, completions, **row_fields) -> list of floats.",
    )
    reward_weights: list = opt([], "One weight per reward function; [] = 1 each.")
    answer_field: str = opt("answer", "The prompt row's field that 'exact_match' compares the completion with.")
    format_pattern: str = opt("", "The regular expression a completion must fully match for 'format''s reward of 1.")
    overlong_buffer: int = opt(
        0,
        "The 'overlong' reward's buffer L (DAPO's soft overlong punishment): 0 for a completion of at most max_new_tokens - L tokens, falling linearly to -1 at max_new_tokens; > 0 and < max_new_tokens when rl.rewards names 'overlong'.",
    )
    environment: str = opt(
        "",
        "Multi-turn episodes (docs/multi-turn.md): 'package.module:factory' or 'file.py:factory' returning an environment (reset(row), step(messages) -> (observation messages, done)), called as factory(tools=[the rl.tools functions]); '' with rl.tools set: the built-in tool environment; '' without: single-turn GRPO.",
    )
    tools: list = opt(
        [],
        "Tools the model may call: 'package.module:function' or 'file.py:function', plain Python functions with type hints and a Google-style docstring (their schemas go to the chat template's tools=); tool calls are parsed from the model's turn (Qwen2/Hermes <tool_call>{...}</tool_call>).",
    )
    max_turns: int = opt(4, "Assistant turns per episode at most (multi-turn); the episode ends there, truncated.")
    max_episode_tokens: int = opt(
        0,
        "The model's and the observations' tokens of one episode after its prompt at most (multi-turn); the episode ends there, truncated; 0 = 4 x max_new_tokens.",
    )
    tool_timeout_s: float = opt(
        10.0,
        "A tool call running longer than this answers the model with a timeout error (the tool runs in a daemon thread, left to finish on its own).",
    )
    async_steps: int = opt(
        0,
        "Asynchronous rounds (docs/async-rl.md): round r is sampled with the weights at the start of round max(r - async_steps, 0), fixed by the config, never by timing; with whole weights (one process, DDP) it is sampled on a copy in a background thread while earlier rounds train. 0: every round samples with the current weights.",
    )
    importance: Literal["none", "token_truncate", "sequence_mask"] = opt(
        "sequence_mask",
        "With rl.async_steps > 0 or another rl.engine than 'builtin', the weight of the sampler's completions, from rho = pi_old / pi_sampler (pi_old: the trainer's policy at the round's start): 'sequence_mask' (rho of the whole completion, 0 above importance_cap: TRL's default), 'token_truncate' (each token's rho capped at importance_cap: truncated IS, Yao et al. 2025), 'none'.",
    )
    importance_cap: float = opt(3.0, "The cap C of rl.importance (TRL's default 3.0); > 0.")


@dataclass
class BatchConfig:
    global_batch_size: int = opt(
        32, "Samples per optimiser step over all data-parallel ranks; the math depends on it, not on the layout."
    )
    micro_batch_size: int | str = opt(
        0,
        "Samples per forward/backward on one rank; 0 means the whole per-rank batch (no accumulation); 'auto' picks the largest that fits in memory (see `paratrain find-batch`).",
    )
    memory_margin: float = opt(
        0.1, "Safety margin of micro_batch_size = 'auto' and find-batch: use at most (1 - margin) of the memory budget."
    )
    memory_gib: float = opt(
        0.0,
        "Per-rank memory budget in GiB for 'auto' and find-batch; 0 = the CUDA device's memory, or on CPU the available RAM / local processes.",
    )
    adaptive: bool = opt(
        False,
        "Grow the global batch during training while the gradient noise scale exceeds it (McCandlish et al. 2018), by raising accumulation.",
    )
    max_global_batch_size: int = opt(0, "Upper bound of the adaptive global batch; 0 = 8 x global_batch_size.")
    norm_group: int = opt(
        32,
        "BatchNorm's statistics are over fixed groups of this many consecutive samples of the global batch (or the whole global batch when smaller), the same on every layout; the model's BatchNorm1d/2d/3d and SyncBatchNorm are converted (docs/batch-math.md). 0: torch's own BatchNorm over each micro-batch, which depends on the layout (the start-of-run probe stops such a run).",
    )
    adapt_every: int = opt(10, "Steps between two decisions of the adaptive batch.")
    noise_ema: float = opt(0.95, "Decay of the exponential moving averages of the gradient noise-scale estimators.")


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd"] = opt("adamw", "Optimiser: 'adamw' or 'sgd' (momentum).")
    lr: float = opt(3e-4, "Peak learning rate.")
    weight_decay: float = opt(0.1, "Decoupled weight decay, applied to matrices (dim >= 2) only.")
    beta1: float = opt(0.9, "AdamW beta1 (SGD momentum).")
    beta2: float = opt(0.95, "AdamW beta2.")
    eps: float = opt(1e-8, "AdamW epsilon.")
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = opt(
        "auto",
        "The optimiser's kernels: 'fused' (one kernel over every tensor) or 'foreach' (batched ops), both for plain tensors only (DDP); 'for-loop' (one tensor at a time, any layout); 'auto': fused where every parameter is a plain tensor, else (and under run.bitwise) for-loop. foreach equals for-loop bit for bit, fused may differ in the last bit (docs/data-parallel.md).",
    )
    schedule: Literal["cosine", "linear", "constant"] = opt(
        "cosine", "Decay after warmup: 'cosine', 'linear' or 'constant'."
    )
    warmup_steps: int = opt(10, "Linear warmup steps from 0 to lr.")
    min_lr_ratio: float = opt(0.1, "Final learning rate as a fraction of lr (cosine and linear).")
    grad_clip: float = opt(
        1.0, "Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."
    )
    lr_scaling: Literal["none", "linear", "sqrt", "adascale"] = opt(
        "none",
        "Scale lr with the global batch B relative to reference_batch_size: 'linear' (B/ref), 'sqrt', or 'adascale' (the gain of Johnson et al. 2020 from the gradient noise scale); applied under the warmup, at start and whenever B changes.",
    )
    reference_batch_size: int = opt(0, "Global batch at which optim.lr was tuned; 0 = batch.global_batch_size.")


@dataclass
class ParallelConfig:
    dp_replicate: int = opt(
        -1, "Replicated data-parallel degree (DDP); -1 fills what the other degrees leave of the world size."
    )
    dp_shard: int = opt(
        1,
        "Sharded data-parallel degree (FSDP2); -1 fills what tp and pp leave of the world size (dp_replicate is then 1 unless set).",
    )
    tp: int = opt(1, "Tensor-parallel degree.")
    pp: int = opt(1, "Pipeline-parallel degree.")
    cp: int = opt(
        1,
        "Context-parallel degree: each sequence split over cp ranks (head-tail chunks); built-in GPT and model.hf, block_size divisible by 2 x cp (docs/context-parallel.md).",
    )
    cp_attention: Literal["auto", "ring", "alltoall"] = opt(
        "auto",
        "Context parallel's attention: 'ring' (K/V chunks passed around the cp ranks, any head count), 'alltoall' (Ulysses: heads traded for the sequence; needs the heads divisible by cp x tp) or 'auto' (all-to-all where the heads per tp rank divide by cp and each row is one document, else the ring).",
    )
    ep: int = opt(
        1,
        "Expert-parallel degree (docs/moe.md): a mixture-of-experts model's experts are split over groups of ep data-parallel ranks (borrowed from dp, which it must divide, as must model.args.moe.n_experts); tokens travel to their experts by all_to_all.",
    )
    # --- sharded data parallel, tensor parallel, activation checkpointing ---
    reshard_after_forward: bool = opt(
        True,
        "FSDP2: free the gathered parameters after each block's forward (true: ZeRO-3-like, least memory; false: ZeRO-2-like, keeps them until backward, one all-gather less per block, and skips gradient sync on early micro-batches).",
    )
    cpu_offload: bool = opt(
        False,
        "FSDP2: keep sharded parameters, gradients and optimiser state in CPU memory (CPUOffloadPolicy); needs parallel.dp_shard > 1.",
    )
    sequence_parallel: bool = opt(
        False,
        "Tensor parallel: also shard the norms and the residual stream along the sequence (Megatron-LM sequence parallelism); needs parallel.tp > 1.",
    )
    loss_parallel: bool = opt(
        True,
        "Tensor parallel, built-in GPT with the built-in cross_entropy: compute the loss on vocabulary-sharded logits instead of gathering them.",
    )
    tp_plan: dict = opt(
        {},
        "Tensor-parallel plan for a user model: module-name pattern (fnmatch, e.g. 'blocks.*.fc1') -> a style: 'colwise', 'rowwise', 'colwise_gather', 'sequence', 'rowwise_to_sequence' or 'sequence_to_colwise' (see the README).",
    )
    tp_plan_factory: str = opt(
        "",
        "Tensor-parallel plan for a user model as 'package.module:function(model, tp_mesh) -> {fqn: ParallelStyle}'.",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = opt(
        "none",
        "Recompute activations in backward, per block of model.layers: 'full' saves only each block's input; 'selective' keeps matmul and attention outputs and recomputes the rest (op-level SAC).",
    )
    # Pipeline parallel (distributed/pipeline_parallel.py).
    pp_schedule: Literal["gpipe", "1f1b", "interleaved1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"] = opt(
        "1f1b",
        "Pipeline schedule: 'gpipe', '1f1b', 'interleaved1f1b', 'looped_bfs', 'interleaved_zb', 'zbv' or 'dualpipev'.",
    )
    pp_microbatches: int = opt(
        0, "Pipeline micro-batches each micro-batch is split into; 0 picks the fewest the schedule needs."
    )
    pp_virtual_stages: int = opt(
        0, "Stages per pipeline rank; 0 means 1 for gpipe/1f1b and 2 for the multi-stage schedules."
    )
    pp_split_points: list = opt(
        [],
        "Block indices where a new pipeline stage starts (pp x virtual - 1 of them); [] balances by parameter count.",
    )


@dataclass
class DistConfig:
    backend: Literal["auto", "gloo", "nccl"] = opt(
        "auto", "Process-group backend; 'auto' is nccl (with gloo for CPU tensors) on CUDA, gloo on CPU."
    )
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "Device; 'auto' is cuda when available.")
    timeout_s: float = opt(600.0, "Collective timeout in seconds.")
    cpu_threads: int = opt(
        0,
        "Intra-op CPU threads of each process (torch.set_num_threads); 0 = 1 per process when the job has more than one process, torch's default (one per core) for a one-process job. The same on every node whatever its number of processes; OMP_NUM_THREADS does not change it (docs/configuration.md).",
    )


@dataclass
class MetricsConfig:
    tensorboard: bool = opt(
        False, "Also write TensorBoard event files into out_dir/tensorboard (needs the 'tensorboard' extra)."
    )
    plot: bool = opt(True, "Write out_dir/metrics.png (loss and throughput) at the end.")
    # --- experiment trackers and per-rank statistics (observability/trackers.py, rank_stats.py) ---
    wandb: bool = opt(
        False,
        "Also log to Weights & Biases from rank 0 (needs the 'wandb' extra): the resolved config, every metrics row, the summary.",
    )
    wandb_project: str = opt("paratrain", "W&B project of the run.")
    wandb_run_name: str = opt("", "W&B run name; empty = the last folder of run.out_dir.")
    wandb_tags: list = opt([], "W&B tags of the run, e.g. ['baseline', 'tp2'].")
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = opt(
        "auto",
        "W&B mode: 'online' only when asked; 'auto' is online when an API key is configured (WANDB_API_KEY), else offline (files under out_dir/wandb, upload later with `wandb sync`); never waits on the network unasked.",
    )
    mlflow: str = opt(
        "",
        "MLflow tracking URI to also log to from rank 0 (needs the 'mlflow' extra), e.g. 'file:/path/mlruns' (no server) or 'http://host:5000'; empty = off.",
    )
    mlflow_experiment: str = opt("paratrain", "MLflow experiment name of the run.")
    rank_stats_every: int = opt(
        50,
        "Every this many steps gather each rank's step time, data time and memory (one small all-gather) and name the slowest rank; 0 = never (rows then carry rank 0's memory only).",
    )
    straggler_ratio: float = opt(
        1.2,
        "A rank whose step time exceeds the median over ranks times this is a straggler: logged and named in the row.",
    )


@dataclass
class ProfileConfig:
    steps: str = opt(
        "",
        "Optimiser steps to trace with torch.profiler, e.g. '10-12' or '5' (1-based, inclusive); one Chrome/Perfetto trace per rank under out_dir/profile/; empty = off.",
    )
    record_shapes: bool = opt(True, "Record the input shapes of each operator in the trace.")
    profile_memory: bool = opt(True, "Record tensor allocations and frees in the trace (the memory timeline).")
    with_stack: bool = opt(False, "Record Python stacks of each operator (bigger traces).")
    memory_snapshot: bool = opt(
        False,
        "CUDA only: record allocator history and write torch.cuda.memory._snapshot() pickles under out_dir/profile/ for the peak step and on an out-of-memory error (open them at pytorch.org/memory_viz).",
    )


@dataclass
class CommConfig:
    compression: Literal["none", "bf16", "fp16", "powersgd"] = opt(
        "none",
        "Data-parallel gradient reduce: 'none' (fp32), 'bf16'/'fp16' (halved bytes), 'powersgd' (low-rank, DDP only).",
    )
    powersgd_rank: int = opt(4, "PowerSGD matrix approximation rank (higher: more bytes, closer to exact).")
    powersgd_start_step: int = opt(10, "Optimiser steps of plain all-reduce before PowerSGD starts (its warm start).")
    bucket_mb: float = opt(25.0, "DDP gradient bucket size in MiB.")


@dataclass
class PrecisionConfig:
    dtype: Literal["fp32", "bf16", "fp16"] = opt(
        "fp32",
        "Compute dtype: autocast (or FSDP2's param dtype) with fp32 master weights; fp16 adds a gradient scaler.",
    )
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = opt(
        "fp32", "Gradient reduce dtype under FSDP2 (comm.compression = 'bf16'/'fp16' sets it too)."
    )
    fp16_init_scale: float = opt(
        65536.0,
        "fp16 only: the GradScaler's initial loss scale (halved at each overflow, doubled after 2000 clean steps).",
    )


@dataclass
class TrainConfig:
    compile: bool = opt(
        False,
        "torch.compile each block (model.layers, else the whole model); falls back with a warning where the platform can't.",
    )


@dataclass
class HardwareConfig:
    peak_flops: float = opt(
        0.0, "Peak FLOP/s of one device at the training dtype, for MFU; 0 takes compute_bench's figure if given."
    )
    compute_bench: str = opt(
        "",
        "JSON written by `paratrain bench compute --json FILE`; its matmul FLOP/s is the MFU peak when peak_flops is 0.",
    )


@dataclass
class CheckpointConfig:
    interval: int = opt(0, "Save a checkpoint every this many optimiser steps; 0 turns periodic saves off.")
    at_end: bool = opt(False, "Also save a checkpoint after the last step.")
    dir: str = opt("", "Folder of the checkpoints (one step-N folder each); empty means <run.out_dir>/checkpoints.")
    keep: int = opt(2, "Keep only the newest this many complete checkpoints; 0 keeps them all.")
    async_save: bool = opt(
        False, "Write checkpoints in the background (dcp.async_save); training waits only while the state is copied."
    )
    resume: str = opt(
        "",
        "'' starts at step 0; 'latest' continues from the newest complete checkpoint in dir (step 0 if there is none and run.out_dir's metrics.jsonl records no step; with recorded steps it is refused: --overwrite starts over); or a checkpoint path.",
    )
    on_error: Literal["stop", "warn"] = opt(
        "stop",
        "A save that fails (full or unwritable folder): 'stop' ends the run (exit 1) with one line, 'warn' logs it and trains on; previous checkpoints stay complete either way.",
    )
    exit_code_on_preempt: int = opt(
        0,
        "Exit code after SIGTERM stopped the run with a checkpoint (e.g. a code your scheduler requeues on); docs/resilience.md.",
    )
    preempt_grace_s: float = opt(
        0.0,
        "After SIGTERM, exit at once (no new checkpoint) if the step and the save take longer than this; 0 = no limit. Set it below your scheduler's grace period.",
    )


@dataclass
class EvalConfig:
    interval: int = opt(
        0,
        "Validation loss every this many optimiser steps and after the last one, logged as val_loss; 0 = off.",
    )
    samples: int = opt(
        0,
        "The fixed validation set: the first this many samples of the validation split, a multiple of batch.global_batch_size; 0 = all of it, rounded down to such a multiple.",
    )
    micro_batch_size: int = opt(
        0,
        "Samples per forward on one rank during validation; 0 = the training micro-batch (must be it under parallel.pp > 1).",
    )


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# ----------------------------------------------------------------------------- loading


def _suggest(name: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(sorted(choices))}"


def _check_type(key: str, value: Any, tp: Any) -> Any:
    """Return value converted to tp, or raise ConfigError naming key."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key} = {value!r} is not allowed; use one of {', '.join(map(repr, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _check_type(key, value, arm)
            except ConfigError:
                pass
        names = " or ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(tp))
        raise ConfigError(f"{key} = {value!r} has the wrong type; expected {names}")
    if dataclasses.is_dataclass(tp):  # a table of keys inside a section, e.g. [model.lora]
        return _check_table(key, value, tp)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r} has the wrong type; expected an integer")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{key} = {value!r} has the wrong type ({type(value).__name__}); expected {tp.__name__}")
    return value


def _check_table(key: str, value: Any, tp: type) -> Any:
    """A TOML table (or an instance) -> the dataclass ``tp``; keys it omits keep their defaults."""
    if isinstance(value, tp):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{key} = {value!r} must be a table ([{key}] or {key}.KEY = value)")
    hints = typing.get_type_hints(tp)
    out = tp()
    for name, item in value.items():
        if name not in hints:
            hint = getattr(tp, "unknown_key", lambda *_: None)(key, name)
            raise ConfigError(hint or f"unknown config key '{key}.{name}'; {_suggest(name, hints)}")
        setattr(out, name, _check_type(f"{key}.{name}", item, hints[name]))
    return out


# Keys that moved: one place for each setting, and a pointer from the old name.
MOVED_KEYS = {"parallel.ddp_bucket_mb": "comm.bucket_mb"}


def _apply(cfg: Config, section: str, key: str, value: Any, where: str) -> None:
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    if section not in sections:
        raise ConfigError(f"unknown config section '{section}' in {where}; {_suggest(section, sections)}")
    sub = getattr(cfg, section)
    hints = typing.get_type_hints(type(sub))
    if f"{section}.{key}" in MOVED_KEYS:
        raise ConfigError(f"'{section}.{key}' in {where} has moved; write {MOVED_KEYS[f'{section}.{key}']} instead")
    if key not in hints:
        raise ConfigError(f"unknown config key '{section}.{key}' in {where}; {_suggest(key, hints)}")
    setattr(sub, key, _check_type(f"{section}.{key}", value, hints[key]))


def _parse_literal(text: str) -> Any:
    """A --set value is a TOML literal; a bare word that is not one is taken as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_config(path: str | os.PathLike | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Build a Config from defaults, an optional TOML file and ``section.key=value`` overrides."""
    cfg = Config()
    if path is not None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(
                f"config file '{path}' not found; pass the path of a TOML file such as configs/debug.toml"
            )
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file '{path}' is not valid TOML ({e}); fix the syntax at that line")
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"'{section}' in {path} must be a [section] table; valid sections: "
                    + ", ".join(f.name for f in dataclasses.fields(cfg))
                )
            for key, value in table.items():
                _apply(cfg, section, key, value, path)
    for item in overrides:
        dotted, sep, text = item.partition("=")
        if not sep or "." not in dotted:
            raise ConfigError(f"--set '{item}' is malformed; write --set section.key=value")
        section, _, key = dotted.strip().partition(".")
        value = _parse_literal(text.strip())
        if "." in key:  # a key inside a table field, e.g. model.args.n_layer=2
            key, _, sub_key = key.partition(".")
            current = getattr(getattr(cfg, section, None), key, None)
            if dataclasses.is_dataclass(current):  # a key of a table, e.g. model.lora.r=16
                value = {**{f.name: getattr(current, f.name) for f in dataclasses.fields(current)}, sub_key: value}
            elif isinstance(current, dict):
                value = {**current, sub_key: value}
            elif hasattr(getattr(cfg, section, None), key):
                raise ConfigError(f"--set '{item}': {section}.{key} is not a table; write --set {section}.{key}=value")
        _apply(cfg, section, key, value, "--set")
    validate(cfg)
    return cfg


def parse_steps(text: str) -> tuple[int, int]:
    """'10-12' -> (10, 12); '5' -> (5, 5). Steps are 1-based like the step column of metrics.jsonl."""
    first, sep, last = text.strip().partition("-")
    try:
        a, b = int(first), int(last) if sep else int(first)
    except ValueError:
        a = b = 0
    if a < 1 or b < a:
        raise ConfigError(f"profile.steps = {text!r} is malformed; write a step range such as '10-12' or one step '5'")
    return a, b


def validate(cfg: Config) -> None:
    """Checks of single values; checks that need the world size live with the batch arithmetic."""

    def positive(key: str, value: float, allow_zero: bool = False) -> None:
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{key} = {value} must be {bound}")

    positive("run.steps", cfg.run.steps)
    positive("run.max_samples", cfg.run.max_samples, allow_zero=True)
    positive("run.bitwise_grain", cfg.run.bitwise_grain, allow_zero=True)
    positive("batch.global_batch_size", cfg.batch.global_batch_size)
    if isinstance(cfg.batch.micro_batch_size, str):
        if cfg.batch.micro_batch_size != "auto":
            raise ConfigError(
                f"batch.micro_batch_size = {cfg.batch.micro_batch_size!r} is not allowed; use an integer >= 0 or 'auto'"
            )
    else:
        positive("batch.micro_batch_size", cfg.batch.micro_batch_size, allow_zero=True)
    if not 0 <= cfg.batch.memory_margin < 1:
        raise ConfigError(f"batch.memory_margin = {cfg.batch.memory_margin} must be within [0, 1)")
    positive("batch.memory_gib", cfg.batch.memory_gib, allow_zero=True)
    positive("batch.adapt_every", cfg.batch.adapt_every)
    if not 0 <= cfg.batch.noise_ema < 1:
        raise ConfigError(f"batch.noise_ema = {cfg.batch.noise_ema} must be within [0, 1)")
    if cfg.batch.max_global_batch_size and cfg.batch.max_global_batch_size < cfg.batch.global_batch_size:
        raise ConfigError(
            f"batch.max_global_batch_size = {cfg.batch.max_global_batch_size} is below"
            f" batch.global_batch_size = {cfg.batch.global_batch_size}; raise it or set 0 (8x)"
        )
    positive("optim.reference_batch_size", cfg.optim.reference_batch_size, allow_zero=True)
    positive("optim.lr", cfg.optim.lr, allow_zero=True)  # 0: the weights stay (e.g. a pretrained loss check)
    positive("optim.grad_clip", cfg.optim.grad_clip, allow_zero=True)
    positive("optim.warmup_steps", cfg.optim.warmup_steps, allow_zero=True)
    positive("data.workers", cfg.data.workers, allow_zero=True)
    positive("data.prefetch", cfg.data.prefetch)
    positive("eval.interval", cfg.eval.interval, allow_zero=True)
    positive("eval.samples", cfg.eval.samples, allow_zero=True)
    positive("eval.micro_batch_size", cfg.eval.micro_batch_size, allow_zero=True)
    if cfg.eval.samples % cfg.batch.global_batch_size:
        raise ConfigError(
            f"eval.samples = {cfg.eval.samples} is not a multiple of batch.global_batch_size ="
            f" {cfg.batch.global_batch_size} (validation runs in global batches); round it"
        )
    positive("dist.timeout_s", cfg.dist.timeout_s)
    positive("dist.cpu_threads", cfg.dist.cpu_threads, allow_zero=True)
    positive("comm.bucket_mb", cfg.comm.bucket_mb)
    positive("comm.powersgd_rank", cfg.comm.powersgd_rank)
    positive("comm.powersgd_start_step", cfg.comm.powersgd_start_step, allow_zero=True)
    positive("precision.fp16_init_scale", cfg.precision.fp16_init_scale)
    positive("hardware.peak_flops", cfg.hardware.peak_flops, allow_zero=True)
    positive("checkpoint.interval", cfg.checkpoint.interval, allow_zero=True)
    positive("checkpoint.keep", cfg.checkpoint.keep, allow_zero=True)
    positive("checkpoint.preempt_grace_s", cfg.checkpoint.preempt_grace_s, allow_zero=True)
    if not 0 <= cfg.checkpoint.exit_code_on_preempt <= 255:
        raise ConfigError(
            f"checkpoint.exit_code_on_preempt = {cfg.checkpoint.exit_code_on_preempt} must be within 0 .. 255"
        )
    positive("metrics.rank_stats_every", cfg.metrics.rank_stats_every, allow_zero=True)
    if cfg.metrics.straggler_ratio < 1:
        raise ConfigError(f"metrics.straggler_ratio = {cfg.metrics.straggler_ratio} must be >= 1 (e.g. 1.2)")
    if cfg.profile.steps:
        parse_steps(cfg.profile.steps)
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio = {cfg.optim.min_lr_ratio} must be within [0, 1]")
    for name in ("tp", "pp"):
        positive(f"parallel.{name}", getattr(cfg.parallel, name))
    if cfg.parallel.dp_shard == 0 or cfg.parallel.dp_shard < -1:
        raise ConfigError(f"parallel.dp_shard = {cfg.parallel.dp_shard} must be >= 1, or -1 to fill the world size")
    if cfg.parallel.tp_plan_factory:
        resolve_callable(cfg.parallel.tp_plan_factory, "parallel.tp_plan_factory")
    if cfg.parallel.dp_replicate == 0 or cfg.parallel.dp_replicate < -1:
        raise ConfigError(
            f"parallel.dp_replicate = {cfg.parallel.dp_replicate} must be >= 1, or -1 to fill the world size"
        )
    for key, ref in (
        ("model.factory", cfg.model.factory),
        ("data.factory", cfg.data.factory),
        ("data.val_factory", cfg.data.val_factory),
    ):
        if ref:
            resolve_callable(ref, key)
    validate_lora(cfg.model.lora)
    if ":" in cfg.loss.name:  # a function, or an objectives.registry.Plugin (it has an objective)
        user = resolve_callable(cfg.loss.name, "loss.name", allow=object)
        if not callable(user) and not hasattr(user, "objective"):
            raise ConfigError(
                f"loss.name = {cfg.loss.name!r} is neither a function nor an objectives.registry.Plugin; point it at one"
            )
    # A name without a colon is a built-in's: objectives/registry.py plugin_of refuses an unknown
    # one (preflight.check_run), so that a new built-in is one registry line, not two.
    validate_distill(cfg)
    if (cfg.loss.name == "reward") != (cfg.model.head == "score"):
        raise ConfigError(
            "a reward model pairs loss.name = 'reward' with model.head = 'score' (a one-label score head);"
            f" got loss.name = {cfg.loss.name!r} and model.head = {cfg.model.head!r}: set both or neither"
        )
    if cfg.model.head == "score" and not cfg.model.hf:
        raise ConfigError(
            "model.head = 'score' builds a transformers sequence classifier; set model.hf to its directory"
        )
    validate_preference(cfg.preference)
    validate_rl(cfg.rl)
    if cfg.batch.norm_group < 0:
        raise ConfigError(f"batch.norm_group = {cfg.batch.norm_group} must be >= 0 (0: torch's own BatchNorm)")
    if cfg.loss.temperature <= 0:
        raise ConfigError(f"loss.temperature = {cfg.loss.temperature} must be > 0")


def validate_distill(cfg: Config) -> None:
    """[distill]'s single values (the teacher directory is read when it is built, build/frozen.py)."""
    d = cfg.distill
    if cfg.loss.name == "distill" and not d.teacher:
        raise ConfigError(
            "loss.name = 'distill' needs a teacher: set distill.teacher to a transformers model directory"
        )
    if d.temperature <= 0:
        raise ConfigError(f"distill.temperature = {d.temperature} must be > 0 (1: the models' own distributions)")
    if not 0 < d.beta < 1:
        raise ConfigError(f"distill.beta = {d.beta} must be within (0, 1)")
    if d.top_k < 0:
        raise ConfigError(f"distill.top_k = {d.top_k} must be >= 0 (0: the whole vocabulary)")


def validate_preference(p: PreferenceConfig) -> None:
    """[preference]'s single values (the reference model is checked when it is built, build/frozen.py)."""
    if p.loss_type not in PREFERENCE_LOSS_TYPES:
        raise ConfigError(
            f"preference.loss_type = {p.loss_type!r} is unknown; use one of {', '.join(PREFERENCE_LOSS_TYPES)}"
        )
    if p.beta <= 0:
        raise ConfigError(f"preference.beta = {p.beta} must be > 0 (e.g. 0.1)")
    if not 0 <= p.label_smoothing < 0.5:
        raise ConfigError(f"preference.label_smoothing = {p.label_smoothing} must be within [0, 0.5)")


def validate_rl(r: RLConfig) -> None:
    """[rl]'s single values (the batch's fit to groups is checked with the layout, preflight)."""
    if r.loss_type not in RL_LOSS_TYPES:
        raise ConfigError(f"rl.loss_type = {r.loss_type!r} is unknown; use one of {', '.join(RL_LOSS_TYPES)}")
    for key, value in (
        ("group_size", r.group_size),
        ("max_new_tokens", r.max_new_tokens),
        ("steps_per_generation", r.steps_per_generation),
        ("epochs_per_generation", r.epochs_per_generation),
    ):
        if value < 1:
            raise ConfigError(f"rl.{key} = {value} must be >= 1")
    if r.generation_batch_size < 0:
        raise ConfigError(
            f"rl.generation_batch_size = {r.generation_batch_size} must be >= 0 (0: a rank's rows of a whole step)"
        )
    if r.group_size < 2:
        raise ConfigError(
            f"rl.group_size = {r.group_size} must be >= 2: an advantage compares a completion with its group"
        )
    if r.temperature <= 0:
        raise ConfigError(f"rl.temperature = {r.temperature} must be > 0 (1: the model's own distribution)")
    if r.top_k < 0 or not 0 < r.top_p <= 1:
        raise ConfigError(f"rl.top_k = {r.top_k} must be >= 0 and rl.top_p = {r.top_p} within (0, 1]")
    if r.epsilon <= 0 or r.epsilon_high < 0 or r.beta < 0:
        raise ConfigError("rl.epsilon must be > 0, rl.epsilon_high and rl.beta >= 0 (e.g. 0.2, 0.28, 0.04)")
    if not r.rewards:
        raise ConfigError("rl.rewards is empty; name at least one reward function (e.g. ['exact_match'])")
    if "overlong" in r.rewards and not 0 < r.overlong_buffer < r.max_new_tokens:
        raise ConfigError(
            f"rl.rewards names 'overlong' but rl.overlong_buffer = {r.overlong_buffer} is not within (0, rl.max_new_tokens"
            f" = {r.max_new_tokens}); set the tokens before the limit where the penalty starts (DAPO: a quarter of it)"
        )
    if r.reward_weights and len(r.reward_weights) != len(r.rewards):
        raise ConfigError(
            f"rl.reward_weights has {len(r.reward_weights)} weights for {len(r.rewards)} rl.rewards; give one each"
            " or none (1 each)"
        )
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in r.stop):
        raise ConfigError(f"rl.stop = {r.stop!r} must be a list of token ids (ints >= 0)")
    if r.max_turns < 1 or r.max_episode_tokens < 0 or not r.tool_timeout_s > 0:
        raise ConfigError(
            f"rl.max_turns = {r.max_turns} must be >= 1, rl.max_episode_tokens = {r.max_episode_tokens} >= 0 (0: 4 x"
            f" max_new_tokens) and rl.tool_timeout_s = {r.tool_timeout_s} > 0"
        )
    if "overlong" in r.rewards and (r.environment or r.tools):
        raise ConfigError(
            "rl.rewards names 'overlong', which measures one completion against rl.max_new_tokens, but an episode of"
            " rl.environment / rl.tools holds several turns; drop it or write a reward of the episode's length"
        )
    if r.engine not in ("builtin", "vllm") and ":" not in r.engine:
        raise ConfigError(
            f"rl.engine = {r.engine!r} is unknown; use 'builtin', 'vllm' or 'package.module:factory' (docs/engines.md)"
        )
    if not all(isinstance(t, str) and ":" in t for t in r.tools):
        raise ConfigError(f"rl.tools = {r.tools!r} must list 'package.module:function' or 'file.py:function' strings")
    if r.async_steps < 0:
        raise ConfigError(
            f"rl.async_steps = {r.async_steps} must be >= 0 (0: every round sampled with the current weights)"
        )
    if r.async_steps and r.engine != "builtin":
        raise ConfigError(
            f"rl.async_steps = {r.async_steps} with rl.engine = {r.engine!r}: stale rounds are sampled on a copy of"
            " the trainer's weights, which another engine does not sample with; use rl.engine = 'builtin' or"
            " rl.async_steps = 0"
        )
    if not r.importance_cap > 0:
        raise ConfigError(f"rl.importance_cap = {r.importance_cap} must be > 0 (TRL's default: 3.0)")


def validate_lora(lora: LoraConfig) -> None:
    """[model.lora]'s single values (the modules it names are checked on the built model, models/lora.py)."""
    if lora.r <= 0:
        raise ConfigError(f"model.lora.r = {lora.r} must be > 0 (the adapters' rank, e.g. 8)")
    if lora.alpha <= 0:
        raise ConfigError(f"model.lora.alpha = {lora.alpha} must be > 0 (e.g. 2 x model.lora.r)")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"model.lora.dropout = {lora.dropout} must be within [0, 1)")
    targets = lora.target_modules
    if isinstance(targets, str) and targets != "all-linear":
        raise ConfigError(
            f"model.lora.target_modules = {targets!r} is a string; use 'all-linear' or a list of names or globs"
            " (e.g. ['q_proj', 'v_proj'])"
        )
    for key, names in (
        ("target_modules", targets if isinstance(targets, list) else []),
        ("modules_to_save", lora.modules_to_save),
    ):
        bad = [n for n in names if not isinstance(n, str) or not n]
        if bad:
            raise ConfigError(f"model.lora.{key} = {names!r} must list module names (strings)")
    if lora.modules_to_save and not lora.enabled:
        raise ConfigError(
            "model.lora.modules_to_save is set but model.lora.target_modules is empty (LoRA off);"
            " name the layers that get adapters, e.g. ['q_proj', 'v_proj'] or 'all-linear'"
        )


def resolve_callable(ref: str, key: str, *, allow: type | None = None) -> typing.Callable:
    """Import 'package.module:function' or 'path/to/file.py:function' (a file of one's own,
    relative to the working directory, as a recipe's reward functions), raising ConfigError with
    the fix when it fails. ``allow``: a type whose instances are taken too, callable or not (a
    user's objectives.registry.Plugin)."""
    module_name, sep, attr = ref.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key} = {ref!r} is malformed; write 'package.module:function' or 'file.py:function'")
    try:
        module = _import_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key} = {ref!r}: cannot import module '{module_name}' ({e}); check the name and PYTHONPATH")
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key} = {ref!r}: module '{module_name}' has no attribute '{attr}'; check the name")
        obj = getattr(obj, part)
    if not callable(obj) and not (allow is not None and isinstance(obj, allow)):
        raise ConfigError(f"{key} = {ref!r} is not callable; point it at a function")
    return obj


def _import_file(path: str):
    """A Python file as a module, once per process (under a name of its absolute path)."""
    full = os.path.abspath(path)
    name = "paratrain_user_" + re.sub(r"\W", "_", full)
    if name in sys.modules:
        return sys.modules[name]
    if not os.path.isfile(full):
        raise ImportError(f"no file {path!r}")
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file: its error in one line
        del sys.modules[name]
        raise ImportError(f"{type(e).__name__}: {e}") from None
    return module


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    import tomli_w

    return tomli_w.dumps(to_dict(cfg))


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def describe_keys(cfg: Config | None = None) -> str:
    """Every key with its type, default and documentation, for `paratrain config`."""
    cfg = cfg or Config()
    lines = []
    for sec in dataclasses.fields(cfg):
        lines.append(f"[{sec.name}]")
        sub = getattr(cfg, sec.name)
        hints = typing.get_type_hints(type(sub))
        for f in dataclasses.fields(sub):
            tp = hints[f.name]
            value = getattr(sub, f.name)
            if dataclasses.is_dataclass(value):  # a table: its own keys, e.g. [model.lora]
                lines.append(f"  [{sec.name}.{f.name}]\n      {f.metadata.get('doc', '')}")
                sub_hints = typing.get_type_hints(type(value))
                for g in dataclasses.fields(value):
                    lines.append(
                        f"  {f.name}.{g.name} ({_type_name(sub_hints[g.name])}) = {getattr(value, g.name)!r}"
                        f"\n      {g.metadata.get('doc', '')}"
                    )
                continue
            lines.append(f"  {f.name} ({_type_name(tp)}) = {value!r}\n      {f.metadata.get('doc', '')}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command-line flags


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """``--set SECTION.KEY=VALUE`` (repeatable): every command that reads a config, and the workers."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config key (value is a TOML literal); repeatable; wins over the file",
    )


def add_resume_argument(parser: argparse.ArgumentParser) -> None:
    """``--resume [PATH]``: ``paratrain train`` and the worker; :func:`resume_overrides` turns it into a key."""
    parser.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH",
        help="continue from the newest complete checkpoint of the run, or from PATH",
    )


def resume_overrides(resume: str | None, overrides: typing.Sequence[str] = ()) -> list[str]:
    """The ``--set`` line that ``--resume`` stands for (checkpoint.resume as a TOML string literal).

    ``--resume`` beside a ``--set checkpoint.resume=...`` that names another checkpoint is refused:
    the flag's line comes last and would win, so ``--set checkpoint.resume='/missing'`` resumed
    the newest checkpoint without a word. Both are the command line; neither is the obvious one."""
    if resume is None:
        return []
    given = [o for o in overrides if o.partition("=")[0].strip() == "checkpoint.resume"]
    if given:
        value = _parse_literal(given[-1].partition("=")[2].strip())
        # One folder written twice ('runs/x/step-4/' and 'runs/x/step-4') is one checkpoint.
        if not (isinstance(value, str) and value and os.path.normpath(value) == os.path.normpath(resume)):
            flag = "--resume" if resume == "latest" else f"--resume {resume}"
            raise ConfigError(
                f"{flag} and --set checkpoint.resume={value!r} name different checkpoints; keep one of them"
                " (--resume alone is the newest checkpoint, --resume PATH a step-N folder)"
            )
    return ["checkpoint.resume=" + json.dumps(resume)]


def check_kwargs(fn: typing.Callable, args: dict, key: str, args_key: str, accepted: typing.Iterable[str] = ()) -> None:
    """Name an unknown keyword argument of ``args_key`` before calling ``fn`` (the builder named by
    ``key``), instead of a TypeError traceback. A builder taking ``**kwargs`` accepts anything,
    unless ``accepted`` lists what it forwards them to (models/: the built-in GPT's config)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    # What a call fn(**args) can fill: not *args nor positional-only parameters.
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        if not accepted:
            return
        names = list(accepted)
    for name in args:
        if name in names:
            continue
        if not names:  # it said "accepted: " and nothing (issue 60)
            raise ConfigError(
                f"{args_key}.{name} is set, but {key} takes no arguments; remove [{args_key}] (or --set '{args_key}={{}}')"
            )
        raise ConfigError(f"{args_key}.{name} is not accepted by {key}; accepted: {', '.join(names)}")


def plain_sgd(lr: float) -> list[str]:
    """Overrides for plain SGD: no momentum, decay, clipping, warmup or schedule.

    AdamW divides each update by the gradient's own running scale and clipping rescales it, so a
    layout whose gradient is off by a constant factor trains the same losses under them. Plain SGD
    moves the weights by lr x gradient, and the logged grad_norm shows the factor from step 1.
    """
    return [
        "optim.name='sgd'",
        f"optim.lr={lr}",
        "optim.beta1=0",
        "optim.weight_decay=0",
        "optim.grad_clip=0",
        "optim.warmup_steps=0",
        "optim.schedule='constant'",
    ]
