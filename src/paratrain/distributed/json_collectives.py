"""Broadcast and all-gather JSON between ranks as byte tensors, instead of pickled objects.

``broadcast_object_list``/``all_gather_object``/``gather_object`` pickle what they carry and
unpickle what arrives over the transport (gloo/NCCL, unauthenticated). Ranks of one job trust
each other, but where the payload is plain data, JSON in a uint8 tensor does the same job with
no path from a socket to ``pickle.loads``. Two collectives each: the lengths, then the bytes.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def _encode(obj, device: torch.device) -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else torch.empty(0, dtype=torch.uint8)
    )


def _decode(t: torch.Tensor):
    return json.loads(bytes(t.cpu().tolist()).decode())


def broadcast_json(obj, *, src: int = 0, group=None, device: torch.device | str = "cpu"):
    """``obj`` (JSON types) from global rank ``src`` to every rank of ``group``; returns it on every rank."""
    device = torch.device(device)
    mine = _encode(obj, device) if dist.get_rank() == src else None
    size = torch.tensor([0 if mine is None else mine.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    buf = mine if mine is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    return _decode(buf)


def all_gather_json(obj, *, group=None, device: torch.device | str = "cpu") -> list:
    """Every rank's ``obj`` (JSON types), in rank order of ``group``."""
    device = torch.device(device)
    mine = _encode(obj, device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    bufs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(bufs, padded, group=group)
    return [_decode(b[: int(s.item())]) for b, s in zip(bufs, sizes)]
