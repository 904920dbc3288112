"""A few wall-clock lines per worker start in ``run.out_dir/events.jsonl``: where a restart's time goes.

An elastic restart (a node lost or joining, ``--max-restarts``) costs seconds that metrics.jsonl
cannot show: the failed collective, the agent's rendezvous, a new process importing torch and
joining the process group, the checkpoint load, the first step. Each worker appends one JSON
line per milestone, with ``time.time()`` (comparable across processes on one host, and across
hosts as far as their clocks agree), its rank, pid, world size and
``TORCHELASTIC_RESTART_COUNT``:

    worker_start         the process's creation (from /proc: interpreter start and imports included)
    train_called         trainer.train entered (imports done)
    process_group_ready  init_process_group returned
    checkpoint_loaded    the resume is done (``step``: the checkpoint's, or null; ``load_s``)
    first_step_done      this process's first optimiser step is done (``step``)
    worker_failed        an exception left the loop (``error``: its first line): how a peer's death is noticed

That is six lines per start and rank at most, written with one ``open(..., "a")`` each, never
in the steady loop. ``benchmarks/resilience/elastic_recovery.py`` reads them to split a node's death into
detection, rendezvous, restart, load and first step (docs/resilience.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import time

EVENTS_FILE = "events.jsonl"
# When the command started (time.time()): set by the launcher, inherited by its workers, so every
# start-up line counts from the moment the user pressed enter (issue 60: nothing was printed
# for the first 50 s of a two-process run on a loaded machine).
STARTED_AT = "PARATRAIN_STARTED_AT"


@contextlib.contextmanager
def command_started():
    """The command starts now (unless a launcher above it said so first): its workers, which
    inherit the environment, count from here. Gone afterwards: a caller's environment in this
    process is left as it was."""
    if STARTED_AT in os.environ:
        yield
        return
    os.environ[STARTED_AT] = repr(time.time())
    try:
        yield
    finally:
        os.environ.pop(STARTED_AT, None)


def startup(what: str) -> str:
    """A start-up line: the seconds since the command started (a worker started some other
    way, e.g. by torchrun: since its own process started), then what happens now."""
    at = os.environ.get(STARTED_AT)
    try:
        t0 = float(at) if at else process_start_time()
    except ValueError:
        t0 = None
    return f"start {time.time() - t0 if t0 is not None else 0.0:5.1f}s  {what}"


def process_start_time() -> float | None:
    """When this process was created, on the ``time.time()`` clock (Linux /proc; None elsewhere).

    /proc/self/stat gives the start in clock ticks since boot (10 ms resolution); /proc/uptime
    the seconds since boot now. Their difference is the process's age (``btime`` in /proc/stat
    would only give whole seconds).
    """
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class EventLog:
    """Appends milestone lines to ``out_dir/events.jsonl``; a failure to write is ignored (timings
    must never stop a run)."""

    def __init__(self, out_dir: str, *, rank: int, world_size: int):
        self.path = os.path.join(out_dir, EVENTS_FILE)
        self.fields = {
            "rank": rank,
            "pid": os.getpid(),
            "world_size": world_size,
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        }

    def record(self, event: str, *, t: float | None = None, **fields) -> None:
        line = json.dumps({"event": event, "time": time.time() if t is None else t, **self.fields, **fields})
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "a") as f:  # one short write per line: lines of ranks do not interleave
                f.write(line + "\n")
        except OSError:
            pass


def read_events(out_dir: str) -> list[dict]:
    """Every line of ``out_dir/events.jsonl``, in file order ([] when there is none)."""
    path = os.path.join(out_dir, EVENTS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
