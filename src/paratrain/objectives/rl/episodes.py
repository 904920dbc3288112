"""Multi-turn episodes: GRPO's generation phase when ``rl.environment`` or ``rl.tools`` is set
(docs/multi-turn.md); single-turn GRPO (objectives/rl/rollout.py) never comes here.

An episode is one completion of a group: the opening conversation (objectives/rl/env.py
``opening``) rendered by the tokenizer's chat template with the tools' schemas and the generation
prompt, then turns of the model and the environment's answers, until the environment says done
or a limit ends it.

**Keyed turns.** Turn ``t`` of completion ``j`` of a prompt draws its uniforms from the
completion's key (rollout.py ``completion_keys``) for ``t = 0``, so an episode's first turn is
the single-turn completion of the same rendered prompt, and from ``key_of(that key, TURN_SITE, t)``
after. The environment is a function of the conversation, so an episode is a function of its
sample alone: the same on every layout, whatever rank or generation batch holds it.

**The row is the conversation as generated.** Its ids are ``[prompt | turn 1 | observation 1 |
turn 2 | ...]``: the model's own tokens as sampled, and each observation's tokens from the chat
template's re-rendering of the conversation with the environment's messages appended, as the text
that follows the conversation so far (with the generation prompt of the next turn). That text must
begin with the conversation so far as rendered before: a template that renders earlier turns
differently once later ones exist (Qwen3 drops earlier turns' reasoning) would make the row a
conversation the model never saw, and is refused in one line. The step scores the model's own
tokens only: the prompt's and the observations' positions hold -1 (policy_gradient.py), and
``old`` the sampler's log-probabilities of the model's tokens.

**Limits.** ``rl.max_turns`` assistant turns and ``rl.max_episode_tokens`` tokens after the prompt
(the model's and the observations'): a turn cut by the token limit, a last turn that the
environment would answer, or an observation that leaves no room for one more token of the model
ends the episode there (``truncated`` in rollouts.jsonl; the observation is not appended), and the
reward scores the conversation that exists.

**Ranks that agree.** Where the forward holds collectives (FSDP2, tensor parallel), the ranks
agree on whether any episode is still running before each turn, and a rank whose episodes have
all ended samples one dead row, so that every rank runs as many forwards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.config import ConfigError, RLConfig
from paratrain.objectives.policy_gradient import Rollout, token_weights
from paratrain.objectives.rl.env import build_environment, load_tools, opening, step
from paratrain.objectives.rl.rollout import advantages, completion_keys
from paratrain.randomness import key_of, site_of

TURN_SITE = site_of("rollout.sample.turn")


def turn_keys(keys: torch.Tensor, turn: int) -> torch.Tensor:
    """The keys of turn ``turn`` of the episodes keyed ``keys``: their own at turn 0."""
    if turn == 0:
        return keys
    return torch.tensor([key_of(k, TURN_SITE, turn) for k in keys.tolist()], dtype=torch.int64)


class Episode:
    """One episode as it runs: its conversation, its ids and which of them the model sampled."""

    def __init__(self, messages: list[dict], text: str, ids: list[int]):
        self.messages, self.opening = messages, len(messages)
        self.text, self.prompt_text = text, text  # the conversation rendered so far; the prompt's
        self.ids, self.prompt_len = ids, len(ids)
        self.logps: dict[int, float] = {}  # position in ids of a sampled token -> its log-probability
        self.turns, self.done, self.truncated = 0, False, False

    @property
    def used(self) -> int:
        return len(self.ids) - self.prompt_len


class Episodes:
    """The run's environment, tools and tokenizer; :meth:`rollouts` is ``Rollouts._step_rollouts``
    for multi-turn runs."""

    # logged per step beside the rewards, as means over the round's episodes: the assistant turns,
    # and the share of episodes that a limit ended
    metrics = ("turns", "truncated")

    def __init__(self, cfg: RLConfig, dataset):
        self.cfg = cfg
        self.tokenizer = getattr(dataset, "tokenizer", None)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(
                "rl.environment / rl.tools need a tokenizer with a chat template (data.args.tokenizer or model.hf's);"
                " the built-in GPT on bytes has none"
            )
        self.tools = load_tools(cfg.tools)
        self.env = build_environment(cfg, self.tools)
        self.max_tokens = cfg.max_episode_tokens or 4 * cfg.max_new_tokens

    def render(self, messages: list[dict]) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=self.tools or None, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:  # noqa: BLE001 - jinja's error on a role or message the template refuses
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            roles = [m.get("role") for m in messages]
            raise ConfigError(
                f"the chat template cannot render the conversation {roles} ({first}); use a template that knows"
                " the environment's roles (e.g. 'tool')"
            ) from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def start(self, row: dict) -> Episode:
        messages = opening(self.env, row)
        text = self.render(messages)
        return Episode(messages, text, self.encode(text))

    def rollouts(self, ro, meta: torch.Tensor, prompt_keys: torch.Tensor, micro_batch_size: int):
        """This rank's episodes of one global batch (``ro``: the :class:`Rollouts`): micro-batches,
        their keys, and the statistics and rows of rollouts.jsonl, as ``_step_rollouts``."""
        cfg, g = self.cfg, self.cfg.group_size
        index = meta[:, 0].repeat_interleave(g)
        keys = completion_keys(prompt_keys, g)
        rows_ = [ro.dataset.rows[int(i)] for i in index]
        episodes = [self.start(row) for row in rows_]
        generation = cfg.generation_batch_size or len(episodes)
        for a in range(0, len(episodes), generation):
            self._generate(ro, episodes[a : a + generation], keys[a : a + generation])

        fields = {k: [r.get(k) for r in rows_] for k in rows_[0] if k != "prompt"}
        fields["completion_ids"] = [e.ids[e.prompt_len :] for e in episodes]
        total, columns = ro.rewards(
            [e.messages[: e.opening] for e in episodes], [e.messages[e.opening :] for e in episodes], fields
        )
        rewards = torch.tensor(total, dtype=torch.float64)
        advantage, std = advantages(rewards, g, scale=cfg.scale_rewards, baseline=cfg.advantage)
        own = torch.tensor([len(e.logps) for e in episodes])
        weights = token_weights(ro.objective.loss_type, own)
        spans = [(a, a + micro_batch_size) for a in range(0, len(episodes), micro_batch_size)]
        batches = [episode_rows(episodes[a:b], advantage[a:b], weights[a:b]) for a, b in spans]
        stats = torch.tensor(
            [len(episodes), len(episodes) // g, rewards.sum().item(), std.sum().item(), float(own.sum())]
            + [sum(c) for c in columns]
            + [float(sum(e.turns for e in episodes)), float(sum(e.truncated for e in episodes))],
            dtype=torch.float64,
        )
        written = [
            {
                "prompt_index": int(index[i]),
                "completion": i % g,
                "tokens": e.ids[e.prompt_len :],
                "own": [int(p in e.logps) for p in range(e.prompt_len, len(e.ids))],
                "text": e.text[len(e.prompt_text) :],
                "messages": e.messages[e.opening :],
                "turns": e.turns,
                "truncated": e.truncated,
                "reward": total[i],
                "advantage": float(advantage[i]),
            }
            for i, e in enumerate(episodes)
        ]
        return batches, [keys[a:b] for a, b in spans], {"stats": stats, "written": written}

    def _generate(self, ro, episodes: list[Episode], keys: torch.Tensor) -> None:
        cfg = self.cfg
        for turn in range(cfg.max_turns):
            live = [i for i, e in enumerate(episodes) if not e.done]
            if ro.agree:  # every rank runs as many turns, hence forwards (module docstring)
                flag = torch.tensor([float(bool(live))])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if not flag.item():
                    return
            elif not live:
                return
            rows = live or [0]  # a rank with nothing left samples one dead row beside the others
            tokens, logps = ro.draw([episodes[i].ids for i in rows], turn_keys(keys[rows], turn), live=bool(live))
            for r, i in enumerate(live):
                n = int((tokens[r] >= 0).sum())
                self._turn(
                    episodes[i], tokens[r, :n].tolist(), logps[r, :n].tolist(), ro.stop, last=turn + 1 == cfg.max_turns
                )

    def _turn(self, e: Episode, tokens: list[int], logps: list[float], stop: tuple, *, last: bool) -> None:
        """Append one sampled turn to ``e``, then the environment's answer unless the episode ends."""
        room = self.max_tokens - e.used
        cut = len(tokens) > room
        tokens, logps = tokens[:room], logps[:room]
        for t, lp in zip(tokens, logps, strict=True):
            e.logps[len(e.ids)] = lp
            e.ids.append(t)
        e.turns += 1
        body = tokens[:-1] if tokens and tokens[-1] in stop else tokens
        e.messages.append({"role": "assistant", "content": self.tokenizer.decode(body, skip_special_tokens=False)})
        e.text += self.tokenizer.decode(tokens, skip_special_tokens=False)
        if cut:
            e.done = e.truncated = True
            return
        observation, done = step(self.env, e.messages)
        if done:
            e.done = True
            return
        if last or e.used >= self.max_tokens:
            e.done = e.truncated = True
            return
        text = self.render(e.messages + list(observation))
        if not text.startswith(e.text):
            at = next((k for k, (x, y) in enumerate(zip(text, e.text)) if x != y), min(len(text), len(e.text)))
            raise ConfigError(
                "the chat template renders the earlier turns differently once the environment's answer is appended"
                f" (they differ at character {at}: {e.text[at : at + 20]!r} became {text[at : at + 20]!r}); multi-turn"
                " training needs a template whose rendering of a conversation begins with that of its beginning"
            )
        ids = self.encode(text[len(e.text) :])
        if e.used + len(ids) >= self.max_tokens:  # no room left for a token of the model
            e.done = e.truncated = True
            return
        e.messages.extend(dict(m) for m in observation)
        e.ids.extend(ids)
        e.text = text


def episode_rows(
    episodes: list[Episode], advantage: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, Rollout]:
    """A micro-batch's inputs ``(B, L)`` (each episode's ids, then 0s) and its Rollout: each of the
    model's own tokens scored at the position before it, every other position -1."""
    width = max(len(e.ids) for e in episodes)
    inputs = torch.zeros(len(episodes), width, dtype=torch.long)
    target = Rollout(
        torch.full((len(episodes), width), -1, dtype=torch.long),
        *(torch.zeros(len(episodes), width, dtype=torch.float64) for _ in range(5)),
    )
    for i, e in enumerate(episodes):
        inputs[i, : len(e.ids)] = torch.tensor(e.ids)
        for p, lp in e.logps.items():
            target.tokens[i, p - 1] = e.ids[p]
            target.old[i, p - 1] = lp
            target.behaviour[i, p - 1] = lp
            target.advantage[i, p - 1] = float(advantage[i])
            target.weight[i, p - 1] = float(weights[i])
    return inputs, target
