"""Asynchronous rounds (``rl.async_steps = k``, docs/async-rl.md): which weights sample which round.

Round ``r`` is sampled with the weights at the start of round ``max(r - k, 0)``: the first
``k + 1`` rounds with the initial weights, then each round with the weights ``k`` rounds older
than the ones that train on it. This is fixed by the config, never by timing, so a round's
completions are a function of its prompts' keys and those weights alone, whatever the relative
speeds of generation and training (peers let the timing decide: TRL's ``AsyncGRPOTrainer``,
verl's fully-async recipe, prime-rl's ``max_async_level`` sample with whatever weights were synced
last).

At the start of round ``r`` (before it trains) :meth:`StaleRounds.take` hands over round ``r``
and starts round ``r + k`` with a snapshot of the current weights:

- **whole weights** (one process, DDP): the snapshot is a copy of the sampler module (``k`` copies
  in turn), and round ``r + k`` is sampled on it by one background thread while rounds
  ``r .. r + k - 1`` train. The copy holds no collective, so the thread never meets training's.
- **sharded weights** (FSDP2, tensor parallel): the sampler's forward holds collectives on the
  training group, which a second thread would interleave with training's. Round ``r + k`` is then
  sampled at once, in the main thread, with the live model: at this point its weights are the
  snapshot's. The same completions, no overlap.

A resume would need the weights of ``k`` rounds back, which a checkpoint does not hold: refused.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from torch import nn

from paratrain.config import ConfigError

# Test-only: PARATRAIN_TEST_DELAY="generate=0.3,train=0.1" sleeps that many seconds before each
# round's sampling and each training step, to show the completions do not depend on timing
# (tests/distributed/test_async_rl.py). Not a setting: nothing else reads it.
DELAY_ENV = "PARATRAIN_TEST_DELAY"


def test_delays() -> dict[str, float]:
    spec = os.environ.get(DELAY_ENV, "")
    return {k: float(v) for k, v in (part.split("=") for part in spec.split(",") if part)}


class StaleRounds:
    """Round ``r``'s completions, sampled with the weights at the start of round ``max(r - k, 0)``
    (module docstring). ``overlap``: sample on copies of ``live`` in a background thread."""

    def __init__(self, k: int, *, live: Callable[[], nn.Module], overlap: bool, rounds: int):
        self.k, self.live, self.overlap, self.rounds = k, live, overlap, rounds
        self.pending: dict[int, Future | tuple] = {}
        self.copies: list[nn.Module] = []
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="paratrain-rollouts") if overlap else None
        self.started = False

    def take(self, r: int, job: Callable[[int, nn.Module | None], tuple]) -> tuple:
        """Round ``r``'s result. ``job(j, sampler)`` samples round ``r + j`` with ``sampler``, a
        snapshot copy, or None for the live model (sharded weights)."""
        if not self.started:
            if r:
                raise ConfigError(
                    f"the run resumes at round {r} with rl.async_steps = {self.k}, whose rounds are sampled with the"
                    f" weights of {self.k} round(s) before, which a checkpoint does not hold; resume with"
                    " rl.async_steps = 0 or start the run anew"
                )
            self.started = True
            sampler = self._snapshot(0)
            for j in range(min(self.k + 1, self.rounds)):  # rounds 0 .. k: the initial weights
                self._launch(j, lambda j=j: job(j, sampler))
            return self._result(0)
        result = self._result(r)  # first: its snapshot slot is free once round r is sampled
        if r + self.k < self.rounds:  # no round past the run's end
            sampler = self._snapshot(r % self.k)
            self._launch(r + self.k, lambda: job(self.k, sampler))
        return result

    def _snapshot(self, slot: int) -> nn.Module | None:
        """The current weights in copy ``slot`` (None without overlap: the live model holds them
        until the round is sampled, which happens at once). A copy is free again once the rounds
        it sampled are taken: round ``r + k``'s is round ``r``'s slot (``r mod k``)."""
        if not self.overlap:
            return None
        live = self.live()
        if slot == len(self.copies):
            twin = copy.deepcopy(live).eval().requires_grad_(False)
            for p in twin.parameters():
                p.grad = None
            self.copies.append(twin)
        self.copies[slot].load_state_dict(live.state_dict())
        return self.copies[slot]

    def _launch(self, r: int, fn: Callable[[], tuple]) -> None:
        self.pending[r] = self.pool.submit(fn) if self.overlap else fn()

    def _result(self, r: int) -> tuple:
        out = self.pending.pop(r)
        return out.result() if isinstance(out, Future) else out
