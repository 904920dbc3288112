"""Hang detection: name the ranks that did not arrive at a collective, and what each rank last entered.

A collective whose peers never arrive fails after ``dist.timeout_s`` with a transport error that
names no rank ("Timed out waiting 600000ms for recv operation"). What this module adds, at the
cost of one store write per rank every few seconds:

- The flight recorder. torch 2.13 records every collective of every backend, gloo included, in a
  per-process ring buffer when ``TORCH_FR_BUFFER_SIZE`` is set before the process group is made
  (``TORCH_NCCL_TRACE_BUFFER_SIZE`` is the NCCL-only older name). Each entry carries the group,
  the collective's sequence number in that group and its name (e.g. ``gloo:all_reduce``).
- A heartbeat thread per rank that publishes, in the job's TCPStore, the time as JSON signed with
  the job secret (store_auth; a value that fails the check is refused, never decoded). It keeps
  beating while the main thread is stuck in a collective or in user code (both release the GIL),
  and stops when the process dies.
- On a collective failure, :func:`watch_collectives` asks every rank (a counter in the store) for
  the last collective it entered in each group; each heartbeat thread answers at its next beat
  from its flight recorder. A rank whose last sequence number in the failed group is below the
  failing rank's never entered that collective; a rank whose heartbeat stopped is dead or
  frozen. The error says both, plus the last collective of every rank.

The recorder is read only when asked, never on every beat: torch 2.13's dump reads parts of the
recorder outside its lock (``getPgConfigJson`` and ``getPgStatusJson`` iterate maps that a new
process group inserts into), a data race with a main thread that makes groups. A CI run whose
beats dumped the recorder every interval lost a rank to SIGSEGV in a job of eleven successive
runs (test_randomness); the race is the one native call the beat made beside training, though
not proven the cause. When a rank answers, its main thread is stuck or failed, not making groups.

Checkpoint saves add ``dist.monitored_barrier(wait_all_ranks=True)`` (gloo), which names missing
ranks by itself (see paratrain.checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time

import torch
import torch.distributed as dist

from paratrain.distributed.store_auth import SECRET_ENV, TamperedValue, signed_get, signed_set

log = logging.getLogger("paratrain")

_KEY = "paratrain/heartbeat/{rank}"
# How many diagnoses have asked for the ranks' last collectives: store.add makes it one atomic
# counter however many ranks fail at once, and a beat reads it with add(0), one round trip.
_ASKED = "paratrain/heartbeat/asked"


class CollectiveTimeout(RuntimeError):
    """A collective failed (timeout or lost peer); the message names the ranks behind it."""


def enable_flight_recorder(entries: int = 256) -> None:
    """Ask torch to record collectives (every backend); must run before init_process_group."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(entries))


def last_collectives() -> dict[str, dict]:
    """This rank's last collective entered per process group, from the flight recorder ({} if off)."""
    try:
        trace = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True))
    except Exception:  # noqa: BLE001 - recorder off or unavailable: diagnose with less
        return {}
    last: dict[str, dict] = {}
    for e in trace.get("entries", []):
        pg = e.get("process_group") or [str(e.get("pg_id", "?"))]
        key = str(pg[0])
        if key not in last or e.get("collective_seq_id", 0) >= last[key]["seq"]:
            last[key] = {
                "seq": int(e.get("collective_seq_id", 0)),
                "op": e.get("profiling_name", "?"),
                "group": pg[-1] if len(pg) > 1 else key,
                "t": int(e.get("time_created_ns", 0)),
            }
    return last


def _describe(entry: dict | None) -> str:
    if not entry:
        return "no collective recorded"
    return f"{entry['op']} #{entry['seq']} on group {entry['group']}"


class HangWatch:
    """The heartbeat of one rank and the diagnosis of a failed collective."""

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, timeout_s: float, secret: str = ""):
        self.store, self.rank, self.world_size = store, rank, world_size
        # Without $PARATRAIN_JOB_SECRET (plain torchrun, srun) the MAC only guards against accidents: still
        # JSON only, so a forged heartbeat can at worst mislead the diagnosis, never run code.
        self.secret = secret
        self.interval_s = max(0.2, min(10.0, timeout_s / 4))
        self._stop = threading.Event()
        self._answer: dict = {}  # the last answer to a diagnosis: {'last': ..., 'answered': n}
        self._asked = 0  # the request this rank's diagnosis made (ask): an older answer is stale
        self._thread = threading.Thread(target=self._run, name="paratrain-heartbeat", daemon=True)

    def start(self) -> HangWatch:
        self.beat(answer=False)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and wait for a beat in progress: no store write may outlive the run, whose
        end lets rank 0 (the store's host) exit."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 60)  # a beat is one store write: ms, unless the store is gone
            if self._thread.is_alive():
                log.warning("paratrain: the heartbeat of rank %d did not stop within a minute", self.rank)

    def beat(self, *, answer: bool = True) -> None:
        """Publish this rank's time; if a diagnosis has asked since the last answer, its last collectives too."""
        asked = self.store.add(_ASKED, 0) if answer else 0
        if asked > self._answer.get("answered", 0):
            self._answer = {"last": last_collectives(), "answered": asked}
        # The answer rides on every later beat too: a diagnosis may read between two beats.
        payload = {"time": time.time(), "pid": os.getpid(), **self._answer}
        signed_set(self.store, self.secret, _KEY.format(rank=self.rank), payload)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - the store went away: the job is ending
                return

    def heartbeats(self) -> dict[int, dict | None]:
        out: dict[int, dict | None] = {}
        for r in range(self.world_size):
            key = _KEY.format(rank=r)
            try:
                out[r] = signed_get(self.store, self.secret, key) if self.store.check([key]) else None
            except TamperedValue:
                log.error(
                    "paratrain: refused the heartbeat of rank %d (store key %s): fails the job-secret check", r, key
                )
                out[r] = None
            except Exception:  # noqa: BLE001
                out[r] = None
        return out

    def ask(self) -> dict[int, dict | None]:
        """Every rank's heartbeat once its thread has answered this request (or two beats have passed)."""
        try:
            asked = self._asked = self.store.add(_ASKED, 1)
        except Exception:  # noqa: BLE001 - the store is gone too
            return {}
        deadline = time.monotonic() + 2 * self.interval_s + 1
        while True:
            beats = self.heartbeats()
            pending = [r for r, hb in beats.items() if r != self.rank and (hb or {}).get("answered", 0) < asked]
            if not pending or time.monotonic() > deadline:
                return beats
            time.sleep(0.1)

    def diagnose(self, error: BaseException) -> str:
        """One paragraph: what failed on this rank, which ranks did not arrive, each rank's last collective."""
        mine = last_collectives()
        beats = self.ask()
        beats[self.rank] = {"time": time.time(), "last": mine, "answered": self._asked}
        # The failed collective: this rank's most recent entry (the recorder logs it on entry).
        failed_group, failed = max(mine.items(), key=lambda kv: kv[1]["t"], default=(None, None))
        now = time.time()
        missing, dead, lines = [], [], []
        for r in range(self.world_size):
            hb = beats.get(r)
            if hb is None:
                dead.append(r)
                lines.append(f"rank {r}: no heartbeat")
                continue
            age = now - hb["time"]
            if hb.get("answered", 0) < self._asked:  # its heartbeat thread did not answer within two beats
                dead.append(r)
                lines.append(f"rank {r}: did not answer (heartbeat {age:.0f} s old: dead or frozen?)")
                continue
            last = hb["last"]
            entry = last.get(failed_group) if failed_group is not None else None
            if age > 3 * self.interval_s + 1:
                dead.append(r)
            if failed is not None and r != self.rank and (entry is None or entry["seq"] < failed["seq"]):
                missing.append(r)
            last_any = max(last.values(), key=lambda e: e["t"], default=None)
            lines.append(
                f"rank {r}: last entered {_describe(entry or last_any)}"
                + (f" (heartbeat {age:.0f} s old: dead or frozen?)" if r in dead else "")
            )
        head = f"rank {self.rank}: collective {_describe(failed)} failed ({str(error).splitlines()[0][:200]})"
        if missing:
            head += f"; ranks that did not arrive: {missing}"
        if dead:
            head += f"; ranks without a recent heartbeat: {dead}"
        if failed is None:
            head += "; set TORCH_FR_BUFFER_SIZE before the process group is made to name the collective"
        return head + "\n  " + "\n  ".join(lines)


def _is_collective_failure(e: BaseException) -> bool:
    if isinstance(e, CollectiveTimeout):
        return False
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("Timed out", "timed out", "gloo", "NCCL", "Connection reset", "monitoredBarrier")
    )


@contextlib.contextmanager
def watch_collectives(*, rank: int, world_size: int, timeout_s: float):
    """Beat while the block runs; turn a collective failure inside it into a CollectiveTimeout that names ranks."""
    if world_size == 1 or not dist.is_initialized():
        yield None
        return
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a group made without a store we can reach
        yield None
        return
    watch = HangWatch(
        store, rank=rank, world_size=world_size, timeout_s=timeout_s, secret=os.environ.get(SECRET_ENV, "")
    ).start()
    try:
        yield watch
    except BaseException as e:
        if _is_collective_failure(e):
            message = watch.diagnose(e)
            log.error("paratrain: %s", message)
            raise CollectiveTimeout(message) from e
        raise
    finally:
        watch.stop()
