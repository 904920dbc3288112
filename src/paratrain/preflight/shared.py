"""One ``run.out_dir`` that every node of a job sees (issue 55, item 2).

Checkpoints are written by every rank (one DCP shard each) and read, pruned and verified by rank
0; metrics.jsonl is rank 0's. On node-local disks a resume took a step whose peers' shards were
on another machine (FileNotFoundError tracebacks), a node that got rank 0 found no checkpoint and
trained from step 0, and the other node wrote the new run's shards into the old run's folders.
The contract is the simplest that holds: a job of several nodes needs one shared folder, and a
job whose nodes do not see one is refused at start, before anything is written or resumed.

The check: rank 0 writes a file of a fresh random name and content into the folder, every rank
reads it in its own configured path (two mount points of one share pass), and the verdict is
gathered so that every rank refuses alike (exit 2 on every node, none left waiting in a
collective). Then the file is removed. It runs on every job of more than one process, one node
included: a write, a read and two small collectives at start, and every
distributed run takes the same path (median 3 ms at world 2, 12 ms at world 4 on a loaded 2-core
CPU: benchmarks/resilience/shared_folder_check.py).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket

import torch

from paratrain.config import Config, ConfigError
from paratrain.distributed.json_collectives import all_gather_json, broadcast_json

TOKEN_PREFIX = ".paratrain-shared-"


def check_shared_folders(folders: dict[str, str], *, rank: int, world_size: int, device: torch.device) -> None:
    """Refuse (ConfigError on every rank) when a rank does not see rank 0's file in one of
    ``folders`` (config key -> this rank's path; empty paths are skipped)."""
    if world_size == 1:
        return
    folders = {key: path for key, path in folders.items() if path}
    token, made, error = secrets.token_hex(16), [], None
    if rank == 0:
        for key, path in folders.items():
            try:
                made += _makedirs(path)
                with open(os.path.join(path, TOKEN_PREFIX + token), "w") as f:
                    f.write(token)
            except OSError as e:
                error = f"{key} = {path!r} cannot be written ({e.strerror or e}); pick a folder you can write to"
                break
    sent = broadcast_json({"token": token, "error": error}, device=device)
    blind = (
        [] if sent["error"] else [key for key, path in folders.items() if _read(path, sent["token"]) != sent["token"]]
    )
    host, node = socket.gethostname(), os.environ.get("GROUP_RANK")  # torchrun's node rank
    where = f"node {node} (host {host}, rank {rank})" if node else f"host {host} (rank {rank})"
    verdicts = all_gather_json({"where": where, "blind": blind}, device=device)  # every rank has read: the file can go
    if rank == 0:
        for path in folders.values():
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, TOKEN_PREFIX + token))
    blind = [v for v in verdicts if v["blind"]]
    for path in reversed(made) if sent["error"] or blind else ():  # a refused job leaves no folder behind
        with contextlib.suppress(OSError):
            os.rmdir(path)
    if sent["error"]:
        raise ConfigError(sent["error"])
    if not blind:
        return
    key = blind[0]["blind"][0]
    more = f" and {len(blind) - 1} more rank(s)" if len(blind) > 1 else ""
    raise ConfigError(
        f"{key} = {folders[key]!r} is not shared between the nodes ({blind[0]['where']}{more} does not see rank 0's"
        " files); give every node one shared folder (NFS, Lustre, a mounted bucket), see docs/checkpoints.md"
    )


def _makedirs(path: str) -> list[str]:
    """Create ``path`` and its missing parents; returns those created, outermost first."""
    missing, where = [], os.path.abspath(path)
    while not os.path.exists(where) and os.path.dirname(where) != where:
        missing.append(where)
        where = os.path.dirname(where)
    os.makedirs(path, exist_ok=True)
    return missing[::-1]


def _read(path: str, token: str) -> str | None:
    try:
        with open(os.path.join(path, TOKEN_PREFIX + token)) as f:
            return f.read()
    except OSError:
        return None


def shared_folders(cfg: Config) -> dict[str, str]:
    """The folders a run's ranks write into together: run.out_dir, and checkpoint.dir when set."""
    return {"run.out_dir": cfg.run.out_dir, "checkpoint.dir": cfg.checkpoint.dir}
