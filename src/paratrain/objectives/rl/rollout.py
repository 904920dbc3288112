"""The generation phase of reinforcement learning (``loss.name = 'grpo'``, docs/grpo.md).

Every ``steps_per_generation x epochs_per_generation`` optimiser steps (a *round*), each
data-parallel rank takes its share of the next ``steps_per_generation`` global batches of prompts
(``batch.global_batch_size / rl.group_size`` prompts each, in the sampler's order, split over the
ranks like any global batch), generates ``G = rl.group_size`` completions per prompt with the
current policy, scores them (paratrain/objectives/rl/rewards.py), and turns each group's rewards into
advantages. Optimiser step ``s`` of the round then trains on the completions of the prompts of
global batch ``s mod steps_per_generation``: whole groups, the same completions on every layout.

**Sampling keyed by the sample.** Completion ``j`` of a prompt draws its uniforms from the key
``(run seed, epoch, prompt index, j)`` (paratrain/randomness.py), one per position, and picks
its token by inverting the cumulative distribution of ``softmax(logits / temperature)`` (after
top-k and top-p) at that uniform. The draws are made on the CPU whatever the device, so a
completion's tokens depend on its logits alone, never on the rank, the generation batch or how
many tokens other rows drew: the rollouts are the same token for token on every layout (up to a
flip where a uniform lands within float rounding of a boundary of the distribution).

**The sampler is the trainer's model.** It runs as the training step runs it (its
parallelisms: FSDP2, tensor parallel, DDP's module). It keeps a KV cache (``rl.kv_cache``: the
model's ``new_cache``, transformers' own for ``model.hf``, models/gpt/model.py's KVCache for
the built-in GPT): one forward of the prompts, then one position per new token, each row at its
own position with its prompt's padding masked out. With ``rl.kv_cache = false`` (or a model
without ``new_cache``) each token reruns the whole row buffer
``[prompt | completion so far | padding]``, as wide as the generation batch's longest prompt
plus ``max_new_tokens``; causal attention makes the padding after a row's last token invisible
to it. A generation batch is ``rl.generation_batch_size`` rows, by default all of a rank's rows
of a step. The step trains on the same rows cut into micro-batches. Where a step needs the old
policy's log-probabilities (a round of several steps) or the reference's (``rl.beta > 0``), the
round first recomputes them with the training forward, micro-batch for micro-batch, and logs the
largest difference from the sampler's (``logp_gap``: float rounding with the cache); an
on-policy step without a KL skips that, as TRL does, unless ``rl.check_logps``. Ranks whose
forward holds collectives (FSDP2, tensor parallel) agree on when every completion has stopped.

**Another engine** (``rl.engine``, objectives/rl/engine.py) may take the built-in sampler's
place (:meth:`Rollouts.draw` is the one call); its log-probabilities go where the built-in's go
(``training_rows``' ``old``), and the round then always recomputes the trainer's and logs the gap.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from paratrain.config import ConfigError, RLConfig
from paratrain.objectives.policy_gradient import PolicyGradientLoss, Rollout, token_logps, token_weights
from paratrain.objectives.rl.engine import SamplingParams, build_engine, checked
from paratrain.objectives.rl.rewards import Rewards
from paratrain.objectives.rl.stale import StaleRounds, test_delays
from paratrain.randomness import key_of, site_of, uniform

log = logging.getLogger("paratrain")

SAMPLE_SITE = site_of("rollout.sample")


def completion_keys(prompt_keys: torch.Tensor, group_size: int) -> torch.Tensor:
    """The keys of a group's completions, prompt-major: completion ``j`` of prompt ``k`` is row
    ``k G + j``, keyed by ``(prompt key, j)``."""
    return torch.tensor([key_of(k, j) for k in prompt_keys.tolist() for j in range(group_size)], dtype=torch.int64)


def filtered_probs(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """``softmax(logits)`` ``(B, V)`` with the tokens outside top-k and top-p set to 0."""
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # the mass of the more likely tokens
        drop = (before >= top_p).scatter(-1, order, before >= top_p)
        probs = probs.masked_fill(drop, 0.0)
    return probs


def pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token ``(B,)`` whose cumulative probability first exceeds ``u`` ``(B,)`` of the mass."""
    cdf = probs.double().cumsum(-1)
    tokens = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return tokens.clamp(max=probs.shape[-1] - 1)


def full_logits(output) -> torch.Tensor:
    return output.full_tensor() if isinstance(output, DTensor) else output


@torch.no_grad()
def sample(
    model: nn.Module,
    prompts: torch.Tensor,
    lengths: torch.Tensor,
    keys: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop: tuple[int, ...] = (),
    agree: bool = False,
    autocast=None,
    cached: bool = False,
    live: torch.Tensor | None = None,
    wrap=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Completions of ``prompts`` ``(B, P)`` (row ``i``'s ids in its first ``lengths[i]``), drawn
    with row ``i``'s uniforms from ``keys[i]``: the tokens ``(B, N)`` (-1 after a completion's
    stop token, which is kept), their log-probabilities under ``softmax(logits / temperature)``
    ``(B, N)`` and the completions' lengths ``(B,)``. ``agree``: the ranks' forwards hold
    collectives, so every rank runs as many of them (one all-reduce per token).

    ``cached``: the model takes a KV cache (its ``new_cache()``, and ``cache=`` / ``key_mask=`` in
    its forward: models/hf/model.py, models/gpt/model.py): one forward of the prompts, then one
    of a single position per token, each row's new token at its own position and its prompt's
    padding masked out. Else each token reruns the whole buffer
    ``[prompt | completion so far | padding]``. ``live`` ``(B,)``: the rows that sample (default
    all); a dead row's forwards run beside the others (episodes.py: a rank with no episode left
    keeps step with ranks that agree).

    ``wrap(ids, positions)``: the rows' input as an image-text model takes it (data/prompts.py
    ``image_batch``: the ids with each row's images; positions -1 on padding). With the cache, the
    prompts' forward holds the images, whose features then sit in the cache as the prompt's keys
    and values, computed once; without it, every token's forward of the whole buffer holds them."""
    device = prompts.device
    rows, p = prompts.shape
    u = uniform(keys, SAMPLE_SITE, max_new_tokens).to(device)  # on the CPU: the same on any device
    tokens = torch.full((rows, max_new_tokens), -1, dtype=torch.long, device=device)
    logps = torch.zeros(rows, max_new_tokens, device=device)
    live = torch.ones(rows, dtype=torch.bool, device=device) if live is None else live.clone()
    where = torch.arange(rows, device=device)
    stops = torch.tensor(list(stop), dtype=torch.long, device=device)
    lengths = lengths.to(device)

    def forward(*args, **kwargs):
        if autocast is None:
            return full_logits(model(*args, **kwargs))
        with autocast:
            return full_logits(model(*args, **kwargs))

    if cached:
        cache = model.new_cache()
        mask = (torch.arange(p, device=device)[None] < lengths[:, None]).long()
        at = torch.arange(p, device=device).expand(rows, p)
        first = prompts if wrap is None else wrap(prompts, torch.where(mask.bool(), at, -1))
        logits = forward(first, at, cache=cache, key_mask=mask)
    else:
        buffer = torch.zeros(rows, p + max_new_tokens, dtype=torch.long, device=device)
        buffer[:, :p] = prompts
        at = torch.arange(p + max_new_tokens, device=device).expand(rows, -1)
        whole = lambda: buffer if wrap is None else wrap(buffer, at)  # noqa: E731 - causal: the padding after is unseen
        logits = forward(whole())
    logits = logits[where, lengths - 1]
    for t in range(max_new_tokens):
        logits = logits.float() / temperature
        token = pick(filtered_probs(logits, top_k=top_k, top_p=top_p), u[:, t])
        # the trainer's formula (token_logps), so the two agree to the last bit where the logits do
        logp = logits.gather(-1, token[:, None])[:, 0] - logits.logsumexp(-1)
        tokens[:, t] = torch.where(live, token, -1)
        logps[:, t] = torch.where(live, logp, 0.0)
        feed = torch.where(live, token, 0)
        if len(stops):
            live &= ~torch.isin(token, stops)
        if t + 1 == max_new_tokens or not _any_live(live, agree):
            break
        if cached:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            logits = forward(feed[:, None], (lengths + t)[:, None], cache=cache, key_mask=mask)[:, -1]
        else:
            buffer[where, lengths + t] = feed
            logits = forward(whole())[where, lengths + t]
    return tokens, logps, (tokens >= 0).sum(-1)


class BuiltinEngine:
    """``rl.engine = 'builtin'``: :func:`sample` with the trainer's model as it is laid out (the
    engine interface of objectives/rl/engine.py). ``sync`` does nothing: it samples with the
    trainer's weights themselves, or a stale round's copy of them (``sampler()``, stale.py)."""

    def __init__(self, sampler, *, device: torch.device, agree: bool, autocast, kv_cache: bool):
        self.sampler = sampler  # () -> the module to sample with: Rollouts._sampler
        self.device, self.agree, self.autocast, self.kv_cache = (
            device,
            agree,
            autocast,
            kv_cache,
        )  # autocast(): the step's

    def sync(self, model: nn.Module) -> None:
        pass

    def sample(
        self, prompts: list[list[int]], keys: torch.Tensor, params: SamplingParams, *, live: bool = True, wrap=None
    ):
        """``live = False``: the rows only keep step with ranks that still sample (episodes.py);
        ``wrap``: the rows' images (:func:`sample`)."""
        model = self.sampler()
        lengths = torch.tensor([len(p) for p in prompts])
        ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)  # right-padded with 0, as the loader's
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.as_tensor(p, dtype=torch.long)
        tokens, logps, _ = sample(
            model,
            ids.to(self.device),
            lengths,
            keys,
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            stop=params.stop,
            agree=self.agree,
            autocast=self.autocast(),
            cached=self.kv_cache and hasattr(model, "new_cache"),
            live=None if live else torch.zeros(len(prompts), dtype=torch.bool, device=self.device),
            wrap=wrap,
        )
        return tokens.cpu(), logps.cpu()


def _any_live(live: torch.Tensor, agree: bool) -> bool:
    flag = live.any().to(torch.float32).reshape(1)
    if agree:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def advantages(
    rewards: torch.Tensor, group_size: int, *, scale: str, baseline: str = "group"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage ``(n,)`` from the rewards ``(n,)`` of consecutive groups: its
    reward minus its group's mean (``baseline = 'rloo'``: minus the mean of the group's other
    completions, G / (G - 1) times as much), divided by the group's standard deviation (Bessel's,
    as TRL's ``std``) plus 1e-4 when ``scale = 'group'``; and each group's standard deviation.
    Each group alone: torch's reductions over a (groups, G) tensor round by its number of rows (a
    rank's share), 1e-15 apart, which rollouts.jsonl would show; one group's are the same bits."""
    if rewards.numel() > group_size:
        parts = [advantages(g, group_size, scale=scale, baseline=baseline) for g in rewards.view(-1, group_size)]
        return torch.cat([a for a, _ in parts]), torch.cat([s for _, s in parts])
    grouped = rewards.double().view(-1, group_size)
    std = grouped.std(-1, keepdim=True)
    if baseline == "rloo":  # r_i - (sum - r_i) / (G - 1), written as such
        centred = grouped - (grouped.sum(-1, keepdim=True) - grouped) / (group_size - 1)
    else:
        centred = grouped - grouped.mean(-1, keepdim=True)
    if scale == "group":
        centred = centred / (std + 1e-4)
    return centred.reshape(-1), std.reshape(-1)


def training_rows(
    prompts: torch.Tensor,
    lengths: torch.Tensor,
    tokens: torch.Tensor,
    sampler_logps: torch.Tensor,
    advantage: torch.Tensor,
    weights: torch.Tensor,
) -> tuple[torch.Tensor, Rollout]:
    """The rows the step trains on: inputs ``(B, P + N)`` = ``[prompt | completion | 0s]`` and
    their :class:`~paratrain.objectives.policy_gradient.Rollout`, each completion token scored at
    the position before it. ``old`` holds the sampler's log-probabilities until the recomputation
    replaces them; ``ref`` holds 0 until the reference's are written."""
    rows, p = prompts.shape
    n = tokens.shape[1]
    inputs = torch.zeros(rows, p + n, dtype=torch.long)
    target = Rollout(
        torch.full((rows, p + n), -1, dtype=torch.long),
        *(torch.zeros(rows, p + n, dtype=torch.float64) for _ in range(5)),
    )
    for i in range(rows):
        k, c = int(lengths[i]), int((tokens[i] >= 0).sum())
        inputs[i, :k] = prompts[i, :k]
        inputs[i, k : k + c] = tokens[i, :c]
        target.tokens[i, k - 1 : k - 1 + c] = tokens[i, :c]
        target.old[i, k - 1 : k - 1 + c] = sampler_logps[i, :c].double()
        target.behaviour[i, k - 1 : k - 1 + c] = sampler_logps[i, :c].double()
        target.advantage[i, k - 1 : k - 1 + c] = float(advantage[i])
        target.weight[i, k - 1 : k - 1 + c] = float(weights[i])
    return inputs, target


class Rollouts:
    """The round's completions as each step's micro-batches: GRPO's batch source (``loss.name =
    'grpo'``, objectives/registry.py), which the loop reads as it reads the step loader
    (:meth:`for_step`, :meth:`consumed_after`, :attr:`metrics`, :meth:`between_rounds`);
    :meth:`batches` generates at a round's first step."""

    def __init__(
        self,
        cfg: RLConfig,
        *,
        model: nn.Module,
        objective: PolicyGradientLoss,
        device: torch.device,
        autocast,
        loader,
        dataset,
        dp: int,
        dp_group,
        agree: bool,
        seed: int,
        out_dir: str,
        is_main: bool,
        forward_of,
        episodes=None,
        steps: int = 0,
    ):
        self.cfg, self.model, self.objective, self.loader, self.dataset = cfg, model, objective, loader, dataset
        self.device, self.autocast = device, autocast  # autocast(): the step's (precision.py), or None
        self.dp, self.dp_group, self.seed = dp, dp_group, seed
        self.rewards = Rewards(cfg)
        self.episodes = episodes  # multi-turn (rl.environment, rl.tools): episodes.py's Episodes, else None
        self.stop = tuple(cfg.stop) or ((dataset.eos_id,) if dataset.eos_id is not None else ())
        self.params = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, self.stop)
        # rl.engine (objectives/rl/engine.py): the built-in keyed sampler, or an engine that samples
        # outside the trainer's forward, whose ranks then need not agree on its forwards
        self.builtin = cfg.engine == "builtin"
        # An image-text prompt set (data/prompts.py): the sampler and the training rows carry the images.
        self.images = getattr(dataset, "processor", None) is not None
        self.agree = agree and self.builtin
        if self.builtin:
            self.engine = BuiltinEngine(
                self._sampler, device=device, agree=agree, autocast=autocast, kv_cache=cfg.kv_cache
            )
        else:
            self.engine = build_engine(cfg)
        self.round_steps = cfg.steps_per_generation * cfg.epochs_per_generation
        self.forward_of = forward_of  # step.no_grad_forward bound to the model and step context
        self.path = os.path.join(out_dir, "rollouts.jsonl") if is_main else None
        self.steps: list[tuple[list, list]] = []  # per global batch s: (micro-batches, their keys)
        self.metrics: dict = {}
        self._started = False
        # rl.async_steps = k (stale.py): round r sampled with the weights of round r - k; a background
        # thread samples on a copy where the weights are whole (agree: the forward holds collectives)
        self.stale = None
        if cfg.async_steps:
            rounds = -(-steps // self.round_steps)
            self.stale = StaleRounds(cfg.async_steps, live=self._sampler, overlap=not agree, rounds=rounds)
        self._local = threading.local()  # .sampler: the snapshot the background thread samples with
        self.delays = test_delays()

    def prompts_per_step(self, global_batch_size: int) -> int:
        return global_batch_size // self.cfg.group_size

    def for_step(self, step: int, consumed: int, global_batch_size: int, micro_batch_size: int, *, keyed: bool):
        """This rank's micro-batches for optimiser step ``step`` (0-based), whose prompts begin at
        ``consumed`` in the sampler's stream, and their row keys when ``keyed`` (the batch source's
        interface, data/loader.py StepLoader.for_step)."""
        batches, keys = self.batches(step, consumed, global_batch_size, micro_batch_size)
        return batches, keys if keyed else None

    def batches(self, step: int, consumed: int, global_batch_size: int, micro_batch_size: int):
        """This rank's micro-batches and their row keys for optimiser step ``step`` (0-based),
        whose prompts begin at ``consumed`` in the sampler's stream."""
        within = step % self.round_steps
        if self.delays:  # test-only (stale.py)
            time.sleep(self.delays.get("train", 0.0))
        if within == 0:
            self.generate(step, consumed, global_batch_size, micro_batch_size)
        elif not self.steps:
            raise ConfigError(
                f"the run resumes at step {step}, within a generation round of {self.round_steps} steps"
                " (rl.steps_per_generation x rl.epochs_per_generation), whose completions were not saved; resume"
                " from a checkpoint at a multiple of it (checkpoint.interval must be one)"
            )
        return self.steps[within % self.cfg.steps_per_generation]

    def between_rounds(self, steps_done: int) -> bool:
        return steps_done % self.round_steps == 0

    def consumed_after(self, step: int, global_batch_size: int) -> int:
        """Prompts consumed by the round's first step (the whole round's); 0 by the others."""
        if step % self.round_steps:
            return 0
        return self.prompts_per_step(global_batch_size) * self.cfg.steps_per_generation

    def generate(self, step: int, consumed: int, global_batch_size: int, micro_batch_size: int) -> None:
        t0 = time.perf_counter()
        extra = self.episodes.metrics if self.episodes is not None else ()  # multi-turn: turns, truncated
        gap = torch.zeros(1, dtype=torch.float64)
        self.engine.sync(self.model)  # once per round, on every rank (a collective where it gathers shards)
        if self.stale is None:
            self.steps, stats, written = self._sample_round(consumed, global_batch_size, micro_batch_size)
        else:  # round r + j begins j rounds of prompts later (stale.py)
            per_round = self.prompts_per_step(global_batch_size) * self.cfg.steps_per_generation
            job = lambda j, sampler: self._sample_round(  # noqa: E731
                consumed + j * per_round, global_batch_size, micro_batch_size, sampler
            )
            self.steps, stats, written = self.stale.take(step // self.round_steps, job)
        # The trainer's recomputation, without a graph: the importance ratio's denominator when a
        # round holds several steps, and the reference's log-probabilities with beta > 0. An
        # on-policy step without a KL needs neither (its ratio is exp(logp - logp.detach())), so
        # it is skipped unless rl.check_logps asks for logp_gap, as TRL skips it (old_per_token_logps).
        # Nor does a stale round's importance weight, pi_old / pi_sampler: on-policy, pi_old is the
        # step's own logp (policy_gradient.py).
        # Another engine than the built-in always recomputes, as TRL does with vLLM: its
        # log-probabilities come from other kernels, and the gap is worth a column.
        recompute = (
            not self.objective.on_policy
            or self.objective.reference is not None
            or self.cfg.check_logps
            or not self.builtin
        )
        gap_sum = torch.zeros(2, dtype=torch.float64)  # the gaps' sum and the tokens'
        for batches, keys in self.steps if recompute else ():
            most, total = self._recompute(batches, keys)
            gap, gap_sum = torch.maximum(gap, most), gap_sum + total
        if self.dp_group is not None:
            dist.all_reduce(stats, group=self.dp_group)
            dist.all_reduce(gap, op=dist.ReduceOp.MAX, group=self.dp_group)
            dist.all_reduce(gap_sum, group=self.dp_group)
        n, groups = max(stats[0].item(), 1), max(stats[1].item(), 1)
        self.metrics = {
            "reward": stats[2].item() / n,
            "reward_std": stats[3].item() / groups,
            "completion_length": stats[4].item() / n,
            **{f"reward_{name}": stats[5 + i].item() / n for i, name in enumerate(self.rewards.names)},
            **{name: stats[5 + len(self.rewards.fns) + i].item() / n for i, name in enumerate(extra)},
            **(
                {"logp_gap": gap.item(), "logp_gap_mean": (gap_sum[0] / gap_sum[1].clamp(min=1)).item()}
                if recompute
                else {}
            ),
            "generation_s": time.perf_counter() - t0,
        }
        self._write(step, written)

    def _sample_round(self, consumed: int, global_batch_size: int, micro_batch_size: int, snapshot=None):
        """A round's completions, scored: its steps' (micro-batches, keys), the summed statistics
        and the rows to write. ``snapshot``: the stale weights' copy to sample with (stale.py, a
        background thread), else the live model."""
        if self.delays:  # test-only (stale.py)
            time.sleep(self.delays.get("generate", 0.0))
        per_step = self.prompts_per_step(global_batch_size)
        steps = []
        extra = self.episodes.metrics if self.episodes is not None else ()  # multi-turn: turns, truncated
        stats = torch.zeros(5 + len(self.rewards.fns) + len(extra), dtype=torch.float64)
        written: list[list[dict]] = []
        holder = self.model if snapshot is None else snapshot
        if snapshot is not None and self.device.type == "cuda":  # a new thread starts on device 0
            torch.cuda.set_device(self.device)
        was_training = holder.training
        holder.eval()  # no dropout while sampling: the completions are the policy's own
        self._local.sampler = snapshot
        try:
            for s in range(self.cfg.steps_per_generation):
                at = consumed + s * per_step
                ((prompt_ids, meta),) = self.loader.batches(at, per_step, per_step // self.dp)
                prompt_ids = getattr(prompt_ids, "input_ids", prompt_ids)  # an image-text set's: its ids
                (prompt_keys,) = self.loader.keys(at, per_step, per_step // self.dp, seed=self.seed)
                batches, keys, rows = self._step_rollouts(prompt_ids, meta, prompt_keys, micro_batch_size)
                stats += rows["stats"]
                written.append(rows["written"])
                steps.append((batches, keys))
        finally:
            holder.train(was_training)
            self._local.sampler = None
        return steps, stats, written

    def _step_rollouts(self, prompt_ids, meta, prompt_keys, micro_batch_size: int):
        if self.episodes is not None:  # multi-turn (rl.environment, rl.tools): episodes.py
            return self.episodes.rollouts(self, meta, prompt_keys, micro_batch_size)
        g = self.cfg.group_size
        index, lengths = meta[:, 0].repeat_interleave(g), meta[:, 1].repeat_interleave(g)
        prompts = prompt_ids.repeat_interleave(g, dim=0)
        keys = completion_keys(prompt_keys, g)
        tokens, logps = [], []
        ids = [row[: int(n)].tolist() for row, n in zip(prompts, lengths, strict=True)]
        # A generation batch is rl.generation_batch_size rows (0: all of this rank's rows of the
        # step, as TRL generates a whole batch at once: fewer, wider forwards, what a GPU wants),
        # its buffer as wide as its longest prompt plus max_new_tokens (not max_prompt_length).
        # The step then trains on the same rows cut into micro-batches, each as wide as its own.
        generation = self.cfg.generation_batch_size or len(prompts)
        for a in range(0, len(prompts), generation):
            t, lp = self.draw(ids[a : a + generation], keys[a : a + generation], rows=index[a : a + generation])
            tokens.append(t)
            logps.append(lp)
        tokens, logps = torch.cat(tokens), torch.cat(logps)
        done = (tokens >= 0).sum(-1)
        rows_ = [self.dataset.rows[int(i)] for i in index]
        texts = [
            self.dataset.decode([int(x) for x in tokens[i, : int(done[i])] if int(x) not in self.stop])
            for i in range(len(tokens))
        ]
        conversational = [isinstance(r["prompt"], list) for r in rows_]
        completions = [
            [{"role": "assistant", "content": t}] if conv else t for t, conv in zip(texts, conversational, strict=True)
        ]
        fields = {k: [r.get(k) for r in rows_] for k in rows_[0] if k != "prompt"}
        fields["completion_ids"] = [tokens[i, : int(done[i])].tolist() for i in range(len(tokens))]  # as TRL
        total, columns = self.rewards([r["prompt"] for r in rows_], completions, fields)
        rewards = torch.tensor(total, dtype=torch.float64)
        advantage, std = advantages(rewards, g, scale=self.cfg.scale_rewards, baseline=self.cfg.advantage)
        weights = token_weights(self.objective.loss_type, done)
        spans = [(a, a + micro_batch_size) for a in range(0, len(prompts), micro_batch_size)]
        widths = [int(lengths[a:b].max()) for a, b in spans]
        batches = [
            training_rows(prompts[a:b, :width], lengths[a:b], tokens[a:b], logps[a:b], advantage[a:b], weights[a:b])
            for (a, b), width in zip(spans, widths, strict=True)
        ]
        if self.images:  # image-text rows: each completion trains with its prompt's images
            ends = lengths + done
            for m, ((a, b), (inputs, target)) in enumerate(zip(spans, batches, strict=True)):
                at = torch.arange(inputs.shape[1]).expand(b - a, -1)
                positions = torch.where(at < ends[a:b, None], at, -1)  # -1: padding (count_tokens, masks)
                batches[m] = (self.dataset.image_batch(inputs, positions, index[a:b]), target)
        keys_mb = [keys[a:b] for a, b in spans]
        stats = torch.tensor(
            [len(tokens), len(tokens) // g, rewards.sum().item(), std.sum().item(), float(done.sum())]
            + [sum(c) for c in columns],
            dtype=torch.float64,
        )
        written = [
            {
                "prompt_index": int(index[i]),
                "completion": i % g,
                "tokens": tokens[i, : int(done[i])].tolist(),
                "text": texts[i],
                "reward": total[i],
                "advantage": float(advantage[i]),
            }
            for i in range(len(tokens))
        ]
        return batches, keys_mb, {"stats": stats, "written": written}

    def _sampler(self) -> nn.Module:
        snapshot = getattr(self._local, "sampler", None)  # a stale round's copy (stale.py)
        if snapshot is not None:
            return snapshot
        # DDP's forward may broadcast buffers (a collective) and expects a backward: its module
        # alone samples (plain data parallel holds whole weights, so no rank needs another).
        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

    def draw(self, prompts: list[list[int]], keys: torch.Tensor, *, live: bool = True, rows=None):
        """The engine's completions of ``prompts`` keyed ``keys``: tokens and their log-probabilities
        ``(B, max_new_tokens)`` on the CPU, the sampler's (behaviour policy's) that ``training_rows``
        and ``episode_rows`` write into the Rollout. ``live = False`` (the built-in engine under
        ranks that agree): forwards that only keep step. ``rows``: the prompt-set rows of an
        image-text set, whose images the built-in sampler's forwards take."""
        if self.builtin:
            wrap = None
            if self.images and rows is not None:
                wrap = lambda ids, positions: self.dataset.image_batch(ids, positions, rows)  # noqa: E731
            t, lp = self.engine.sample(prompts, keys, self.params, live=live, wrap=wrap)
            pad = self.params.max_new_tokens - t.shape[1]
            return F.pad(t, (0, pad), value=-1), F.pad(lp, (0, pad))
        return checked(self.cfg.engine, self.engine.sample(prompts, keys, self.params), len(prompts), self.params)

    def _recompute(self, batches, keys) -> tuple[torch.Tensor, torch.Tensor]:
        """The trainer's log-probabilities of the completions (no graph), written as the old
        policy's (the importance ratio's denominator, off-policy steps) and compared with the
        sampler's; the reference's when ``rl.beta > 0``. Returns the largest gap and (the gaps'
        sum, the tokens)."""
        forward = self.forward_of(batches, keys)
        gap = torch.zeros(1, dtype=torch.float64)
        total = torch.zeros(2, dtype=torch.float64)
        reference = self.objective.reference
        for k, (_, target) in enumerate(batches):
            tokens = target.tokens.to(self.device)
            mine = token_logps(forward(k), tokens, self.cfg.temperature).double().cpu()
            mask = target.tokens >= 0
            diff = torch.where(mask, (mine - target.old).abs(), 0.0)
            gap = torch.maximum(gap, diff.amax().reshape(1))
            total += torch.stack([diff.sum(), mask.sum().double()])
            target.old = torch.where(mask, mine, 0.0)
            if reference is not None:
                ref = token_logps(reference(forward, k), tokens, self.cfg.temperature).double().cpu()
                target.ref = torch.where(mask, ref, 0.0)
        return gap, total

    def _write(self, step: int, per_step: list[list[dict]]) -> None:
        """Every completion of the round in ``out_dir/rollouts.jsonl`` (rank 0, gathered over the
        data-parallel ranks: each global batch's rows in rank order, the prompts' global order).
        The first round of a (resumed) run drops the rows of steps it redoes."""
        parts = [per_step]
        if self.dp_group is not None:
            parts = [None] * dist.get_world_size(self.dp_group)
            dist.all_gather_object(parts, per_step, group=self.dp_group)
        if self.path is None:
            return
        if not self._started:
            self._started = True
            kept = []
            if os.path.isfile(self.path):
                with open(self.path) as f:
                    kept = [line for line in f if json.loads(line)["step"] <= step]
            with open(self.path, "w") as f:
                f.writelines(kept)
        with open(self.path, "a") as f:
            for s in range(len(per_step)):
                for part in parts:
                    for r in part[s]:
                        f.write(json.dumps({"step": step + 1 + s, **r}) + "\n")
