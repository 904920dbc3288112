"""Pipeline bubble: step time of gpipe and 1f1b against the theoretical bubble (p-1)/(m+p-1).

    PYTHONPATH=src python benchmarks/parallel/pipeline_bubble.py [--pp 2 4] [--microbatches 1 2 4 8]

For each pipeline degree p, schedule and number of pipeline micro-batches m, the GPT is split
by paratrain's ``apply_pp`` into p stages (one process each, gloo on CPU or nccl on CUDA) and
one schedule run over m micro-batches of ``--batch`` samples is timed (the best of ``--steps``
runs after warm-up, each the slowest rank's time, optimiser excluded; the best, not the median,
because on a shared machine interference only ever adds time).

How the measured bubble is derived: the ideal pipeline, with no bubble, keeps every stage busy
all the time, so it takes ``m x t_stage`` where ``t_stage`` is the forward + backward time of
one micro-batch on one stage, measured on every rank in turn, alone and with no communication
(the slowest stage sets the pace, so t_stage is the maximum over ranks). The bubble is the idle share
of the measured step: ``1 - m x t_stage / T(m)``. Theory (GPipe, arXiv:1811.06965; 1F1B has
the same bubble and bounds memory instead, arXiv:2104.04473) gives ``(p - 1) / (m + p - 1)``.
The measured share also holds the point-to-point transfers and the schedule's own overhead, so
it sits a little above theory when compute per micro-batch is small; "follows" means within 25%
of the theoretical fraction (relative).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stage_time(
    part, *, first: bool, last: bool, batch: int, seq: int, d_model: int, vocab: int, device: torch.device, reps: int
) -> float:
    """Forward + backward of one micro-batch on this stage alone (no communication)."""
    import torch.nn.functional as F

    times = []
    for _ in range(reps + 1):
        if first:
            x = torch.randint(0, vocab, (batch, seq), device=device)
        else:
            x = torch.randn(batch, seq, d_model, device=device, requires_grad=True)
        _sync(device)
        t0 = time.perf_counter()
        out = part(x)
        if last:
            F.cross_entropy(
                out.reshape(-1, out.shape[-1]), torch.randint(0, vocab, (batch * seq,), device=device), reduction="sum"
            ).backward()
        else:
            out.backward(torch.randn_like(out))
        _sync(device)
        times.append(time.perf_counter() - t0)
    part.zero_grad(set_to_none=True)
    return min(times[1:])


def _rank(rank: int, world: int, port: int, args, q) -> None:
    try:
        _rank_body(rank, world, port, args, q)
    except BaseException:  # noqa: BLE001 - the parent must not wait forever
        import traceback

        q.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def _rank_body(rank: int, world: int, port: int, args, q) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from paratrain.config import LossConfig, ParallelConfig
    from paratrain.distributed.pipeline_parallel import apply_pp
    from paratrain.models.gpt import build_gpt
    from paratrain.objectives.registry import build_loss

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("pp",))
    loss = build_loss(LossConfig())
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in args.microbatches:
            if schedule == "1f1b" and m < world:
                continue  # 1F1B needs at least p micro-batches in flight (torch refuses fewer)
            cfg = ParallelConfig(pp=world, pp_schedule=schedule, pp_microbatches=m)
            torch.manual_seed(0)
            model = build_gpt(
                n_layer=world * args.blocks_per_stage,
                n_head=args.heads,
                d_model=args.d_model,
                block_size=args.seq,
                vocab_size=args.vocab,
            )
            pipe = apply_pp(model, mesh["pp"], cfg=cfg, device=device)
            pipe.build_schedule(micro_batch_size=m * args.batch, accum_steps=1, loss_fn=loss)
            pipe.loss.scale = 1.0
            x = torch.randint(0, args.vocab, (m * args.batch, args.seq), device=device)
            y = torch.randint(0, args.vocab, (m * args.batch, args.seq), device=device)
            times = []
            for i in range(args.warmup + args.steps):
                dist.barrier()
                _sync(device)
                t0 = time.perf_counter()
                pipe.schedule.step(
                    *((x,) if pipe.has_first else ()), target=y if pipe.has_last else None, return_outputs=False
                )
                _sync(device)
                dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                pipe.zero_grad(set_to_none=True)
                pipe.loss.sums, pipe.loss.counts = [], []
                if i >= args.warmup:
                    times.append(dt.item())
            # One rank at a time, so that on a CPU host the probe does not share cores with the
            # other stages' probes (which would inflate t_stage and hide the bubble).
            t_stage = torch.zeros((), dtype=torch.float64)
            for r in range(world):
                dist.barrier()
                if r == rank:
                    t_stage.fill_(
                        max(
                            _stage_time(
                                part,
                                first=st.is_first,
                                last=st.is_last,
                                batch=args.batch,
                                seq=args.seq,
                                d_model=args.d_model,
                                vocab=args.vocab,
                                device=device,
                                reps=args.steps,
                            )
                            for part, st in zip(pipe.parts, pipe.stages)
                        )
                    )
            dist.all_reduce(t_stage, op=dist.ReduceOp.MAX)
            # The same probe on all ranks at once: if it is much slower than alone, the stages
            # share cores and cannot overlap, so no pipeline can beat running them in turn.
            dist.barrier()
            t_together = torch.tensor(
                max(
                    _stage_time(
                        part,
                        first=st.is_first,
                        last=st.is_last,
                        batch=args.batch,
                        seq=args.seq,
                        d_model=args.d_model,
                        vocab=args.vocab,
                        device=device,
                        reps=args.steps,
                    )
                    for part, st in zip(pipe.parts, pipe.stages)
                ),
                dtype=torch.float64,
            )
            dist.all_reduce(t_together, op=dist.ReduceOp.MAX)
            rows.append((schedule, world, m, min(times), t_stage.item(), t_together.item() / t_stage.item()))
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def main() -> int:
    import torch.multiprocessing as mp

    from paratrain.distributed.process_group import free_port

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--pp", type=int, nargs="+", default=None, help="pipeline degrees (default 2, and 4 with >= 4 cores)"
    )
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--batch", type=int, default=4, help="samples per pipeline micro-batch")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--blocks-per-stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed schedule runs and stage probes (best of)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    cores = os.cpu_count() or 1
    pps = args.pp or ([2, 4] if cores >= 4 else [2])
    if args.device == "cuda" and max(pps) > torch.cuda.device_count():
        print(
            f"pipeline_bubble: --pp {max(pps)} needs {max(pps)} GPUs, {torch.cuda.device_count()} visible",
            file=sys.stderr,
        )
        return 2
    print(
        f"# pipeline bubble: GPT d_model {args.d_model}, {args.blocks_per_stage} blocks/stage, micro-batch "
        f"{args.batch} x {args.seq} tokens, {args.device}, {cores} cores, torch {torch.__version__}"
    )
    if args.device == "cpu" and max(pps) > cores:
        print(f"# warning: {max(pps)} processes on {cores} cores: stages share cores, figures are not a pipeline's")
    rows = []
    ctx = mp.get_context("spawn")
    for pp in pps:
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, pp, port, args, q)) for r in range(pp)]
        for proc in procs:
            proc.start()
        got = q.get(timeout=1800)
        if isinstance(got, str):
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
            print(got, file=sys.stderr)
            return 1
        rows += got
        for proc in procs:
            proc.join()
    # Second estimate, from the step times alone: the per-micro-batch time t_mb is the slope of
    # T(m) between the two largest m (it includes the point-to-point transfers the stage probe
    # leaves out); bubble_fit = 1 - m x t_mb / T(m). A pipeline that follows T = (m + p - 1) t_mb
    # gives exactly (p-1)/(m+p-1) here, so this column tests the shape of the bubble, the main
    # one its size against pure compute.
    slope = {}
    for schedule, pp in {(r[0], r[1]) for r in rows}:
        pts = sorted((r[2], r[3]) for r in rows if r[0] == schedule and r[1] == pp)
        if len(pts) >= 2:
            (m1, t1), (m2, t2) = pts[-2], pts[-1]
            slope[schedule, pp] = (t2 - t1) / (m2 - m1)
    print(
        f"{'schedule':<9} {'pp':>3} {'m':>3} {'step ms':>9} {'ideal ms':>9} {'bubble':>7} {'theory':>7} {'ratio':>6}"
        f"  follows  {'bubble_fit':>10}  contention"
    )
    ok_all, contended = True, False
    for schedule, pp, m, t, t_stage, contention in rows:
        ideal = m * t_stage
        bubble = max(0.0, 1 - ideal / t)
        theory = (pp - 1) / (m + pp - 1)
        ratio = bubble / theory
        ok = abs(ratio - 1) <= 0.25
        fit = f"{1 - m * slope[schedule, pp] / t:.3f}" if (schedule, pp) in slope else "-"
        ok_all &= ok
        print(
            f"{schedule:<9} {pp:>3} {m:>3} {t * 1e3:>9.1f} {ideal * 1e3:>9.1f} {bubble:>7.3f} {theory:>7.3f}"
            f" {ratio:>6.2f}  {'yes' if ok else 'NO':<7}  {fit:>10}  {contention:>10.2f}"
        )
        contended |= contention > 1.3
    print(f"# measured bubble within 25% of (p-1)/(m+p-1) everywhere: {'yes' if ok_all else 'no'}")
    if contended:
        print(
            "# contention = stage probe on all ranks at once / alone; above ~1.3 the stages share cores and"
            " cannot overlap, so the measured bubble says more about the host than the schedule"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
