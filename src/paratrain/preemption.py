"""Preemption: SIGTERM stops the run after the current step, with a checkpoint.

Slurm (``--signal``, ``scancel``), Kubernetes (pod deletion, node drain) and cloud spot
reclaims all send SIGTERM, then SIGKILL after a grace period. A worker that receives it only
sets a flag. The flag rides the step's own reduce of ``[loss_sum, item_count]`` as a third
element (step.launch_totals, read after the backward; a SUM of 0/1 flags is as good as a MAX), over pp x dp, or the
whole world when tp > 1, so every rank stops after the *same* step even when only one node (or
one tensor-parallel peer) was signalled, with no collective and no host sync of its own. They
save a synchronous checkpoint and exit (see docs/resilience.md).

A second SIGTERM (more than ``_DEBOUNCE_S`` after the first: ``scancel`` signals the launcher and
the workers at once, and the launcher forwards its own) or the end of
``checkpoint.preempt_grace_s`` ends the process at once with code 143 (128 + SIGTERM). That never
damages an earlier checkpoint: a save writes a new ``step-N`` folder whose manifest comes last,
so a half-written one is merely incomplete and ``--resume`` skips it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger("paratrain")

EXIT_NOW = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM
_DEBOUNCE_S = 2.0  # a copy of the same SIGTERM (launcher forward + scancel) is not a "second" one


class Preemption:
    """This rank's SIGTERM handler and the stop every rank agrees on. Every method is called on every rank."""

    def __init__(self, *, grace_s: float):
        self.grace_s = grace_s
        self.requested_at: float | None = None  # monotonic time of the first SIGTERM
        self.stopped_at_step: int | None = None  # the step the ranks agreed to stop after
        self._timer: threading.Timer | None = None
        self._previous = None
        if threading.current_thread() is threading.main_thread():  # signal handlers live there only
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def requested(self) -> bool:
        """Did this rank get SIGTERM? (The step reads it just before its reduce.)"""
        return self.requested_at is not None

    def _on_sigterm(self, signum, frame) -> None:
        now = time.monotonic()
        if self.requested_at is None:
            self.requested_at = now
            log.warning(
                "SIGTERM: stopping after the current step with a checkpoint (grace %s; a second SIGTERM exits at once)",
                f"{self.grace_s:g} s" if self.grace_s > 0 else "unlimited",
            )
            if self.grace_s > 0:
                self._timer = threading.Timer(
                    self.grace_s, self._exit_now, args=("checkpoint.preempt_grace_s ran out",)
                )
                self._timer.daemon = True
                self._timer.start()
        elif now - self.requested_at > _DEBOUNCE_S:
            self._exit_now("a second SIGTERM")

    @staticmethod
    def _exit_now(why: str) -> None:
        # os._exit: no cleanup that could block (a collective, a background save); the previous
        # checkpoint is complete and untouched, a half-written one has no manifest.
        print(f"paratrain: error: {why}: exiting without a new checkpoint (exit code {EXIT_NOW})", file=sys.stderr)
        sys.stderr.flush()
        os._exit(EXIT_NOW)

    def should_stop(self, step: int, *, agreed: bool) -> bool:
        """After optimiser step ``step``: do the ranks stop now? ``agreed`` is the step's reduced
        flag (StepResult.stop), the same on every rank, so this is True on every rank or on none."""
        if agreed:
            self.stopped_at_step = step
            log.warning("preemption: every rank stops after step %d and saves a checkpoint", step)
        return agreed

    def close(self) -> None:
        """Restore the previous SIGTERM handler; the grace timer keeps running until the process exits."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def forward_to_children(signum: int) -> list[int]:
    """Send ``signum`` to this process's direct children (torchrun's workers); returns their pids.

    Linux /proc: the launcher runs the elastic agent in-process and its workers are its children.
    """
    me, children = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'.
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me:
            try:
                os.kill(int(entry), signum)
                children.append(int(entry))
            except ProcessLookupError:
                pass
    return children
