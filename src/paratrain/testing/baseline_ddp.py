"""Plain hand-written torch DDP loop: the baseline of dp_overhead.py (run under torchrun).

Same model, data, global batch, micro-batching and optimiser as the paratrain config it is
given, written the way a user would without paratrain: mean loss per micro-batch divided by the
accumulation steps, no_sync on all but the last micro-batch.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from paratrain.config import load_config
from paratrain.data.datasets import build_dataset
from paratrain.models import build_model


def setup(cfg):
    """The hand-written set-up (also benchmarks/overhead/step_profile.py's): process group, DDP model, data,
    AdamW, the rank's share of the global batch; returns what the loop needs."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.run.seed)
    model = DDP(build_model(cfg.model), bucket_cap_mb=cfg.comm.bucket_mb, gradient_as_bucket_view=True)
    data = build_dataset(cfg.data)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        weight_decay=cfg.optim.weight_decay,
    )
    per_rank = cfg.batch.global_batch_size // world
    mbs = cfg.batch.micro_batch_size or per_rank
    g = torch.Generator().manual_seed(cfg.run.seed)
    return rank, model, data, opt, per_rank, mbs, per_rank // mbs, g


def main(config: str, out: str, *overrides: str) -> None:
    cfg = load_config(config, list(overrides))
    rank, model, data, opt, per_rank, mbs, accum, g = setup(cfg)
    times = []
    for step in range(cfg.run.steps):
        t0 = time.perf_counter()
        idx = torch.randint(0, len(data), (cfg.batch.global_batch_size,), generator=g).tolist()
        mine = idx[rank * per_rank : (rank + 1) * per_rank]
        for k in range(accum):
            xs, ys = zip(*(data[i] for i in mine[k * mbs : (k + 1) * mbs]))
            x, y = torch.stack(xs), torch.stack(ys)
            ctx = model.no_sync() if k < accum - 1 else torch.enable_grad()
            with ctx:
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / accum
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_val = loss.detach().clone()
        dist.all_reduce(loss_val)
        loss_val.item()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_time_s": times}, f)
    # Leave together: with gloo, a rank destroying its group after its peer has exited can hang.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
