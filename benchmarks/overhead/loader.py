"""The prefetching loader (paratrain.data.loader): delivery rate, and step time against in-memory batches.

1. delivery: tokens/s the loader alone delivers with 0, 1, 2 workers (token shards and a dataset
   whose ``__getitem__`` sleeps 5 ms), against the tokens/s the main job consumes.
2. step: a plain training loop (the built-in GPT, AdamW) whose batches come (a) from memory,
   already collated, (b) from the loader with ``--workers`` workers, (c) inline (0 workers); the
   same for the 5 ms dataset. Modes alternate within each run; printed: the median step time of
   each mode and the paired ratio to the in-memory mode (median and range over runs). Target:
   within 2 % with workers.
3. trainer (``--trainer``): the same comparison through ``paratrain.train`` itself (one process),
   ``data.workers = N`` against ``data.workers = 0`` (inline), alternating; the run's median step
   time (summary.json, first two steps left out), paired ratio.

    python benchmarks/overhead/loader.py [--corpus DIR] [--runs 3] [--steps 30] [--workers 2]
    python benchmarks/overhead/loader.py --device cuda --model 124m --dtype bfloat16   # the GPU check

Without ``--corpus`` the standard library is prepared with the bytes tokenizer into a temp dir.
    python benchmarks/overhead/loader.py --trainer --runs 3 --steps 30   # through paratrain.train
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sysconfig
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, default_collate

from paratrain import load_config, train
from paratrain.data.loader import StepSampler, build_loader, to_device
from paratrain.data.prepare import prepare
from paratrain.data.sampler import GlobalBatchSampler
from paratrain.data.tokens import build_tokens
from paratrain.models.gpt import build_gpt

HERE = os.path.dirname(os.path.abspath(__file__))


MODELS = {
    "tiny": dict(n_layer=4, n_head=4, d_model=128),
    "124m": dict(n_layer=12, n_head=12, d_model=768),  # GPT-2 small
}


class Sleepy(Dataset):
    """Another dataset's samples, each after a 5 ms sleep (a slow decoder, a network read)."""

    def __init__(self, inner: Dataset, sleep_s: float = 0.005):
        self.inner, self.sleep_s = inner, sleep_s

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i):
        time.sleep(self.sleep_s)
        return self.inner[i]


def sleepy_tokens(path: str, block_size: int) -> Dataset:
    """data.factory of the trainer mode: the token windows, 5 ms each."""
    return Sleepy(build_tokens(path=path, block_size=block_size))


def trainer_step_time(corpus: str, workers: int, args, *, sleepy: bool, vocab: int, out_dir: str) -> float:
    """Median step time (s) of one ``paratrain.train`` run with ``data.workers = workers``."""
    data = f"data.args={{path='{corpus}', block_size={args.block_size}}}"
    m = MODELS[args.model]
    overrides = [
        f"run.out_dir='{out_dir}'",
        f"run.steps={args.steps}",
        "run.progress=false",
        "run.save_model=false",
        "metrics.plot=false",
        "metrics.rank_stats_every=0",
        # vocab_size: a user factory (sleepy) has no meta.json for the preflight to read it from
        f"model.args={{n_layer={m['n_layer']}, n_head={m['n_head']}, d_model={m['d_model']},"
        f" block_size={args.block_size}, vocab_size={vocab}}}",
        *(["data.factory='loader:sleepy_tokens'", data] if sleepy else ["data.name='tokens'", data]),
        f"data.workers={workers}",
        f"data.prefetch={args.prefetch}",
        f"batch.global_batch_size={args.batch}",
        f"batch.micro_batch_size={args.micro_batch}",
        f"dist.device='{args.device}'",
        f"precision.dtype='{'bf16' if args.dtype == 'bfloat16' else 'fp32'}'",
    ]
    return train(load_config(None, overrides))["median_step_time_s"]


def trainer_mode(corpus: str, vocab: int, args, tmp: str) -> None:
    for name, sleepy in (("tokens", False), ("sleep5ms", True)):
        res: dict[int, list[float]] = {0: [], args.workers: []}
        for r in range(args.runs):
            for w in (0, args.workers) if r % 2 == 0 else (args.workers, 0):  # alternate the order
                out_dir = os.path.join(tmp, "run")
                res[w].append(trainer_step_time(corpus, w, args, sleepy=sleepy, vocab=vocab, out_dir=out_dir))
                print(f"  {name} run {r} workers {w}: median step {res[w][-1] * 1e3:.2f} ms", flush=True)
        ratios = [a / b for a, b in zip(res[args.workers], res[0])]
        print(
            f"trainer {name}: median step inline {statistics.median(res[0]) * 1e3:.2f} ms, {args.workers} workers"
            f" {statistics.median(res[args.workers]) * 1e3:.2f} ms; workers / inline: median"
            f" {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}, {args.runs} paired runs)"
        )


def sampler_for(ds: Dataset, args, start_step: int = 0, steps: int | None = None) -> StepSampler:
    return StepSampler(
        GlobalBatchSampler(len(ds), seed=0),
        start=start_step * args.batch,
        steps=steps if steps is not None else args.steps,
        global_batch_size=args.batch,
        micro_batch_size=args.micro_batch,
        dp_rank=0,
        dp=1,
    )


def batches(ds: Dataset, mode: str, args):
    """An iterator of steps (lists of collated micro-batches) for ``mode``."""
    sampler = sampler_for(ds, args)
    if mode == "memory":
        steps = [[default_collate([ds[i] for i in mb]) for mb in step] for step in sampler]
        if args.device == "cuda":
            steps = [[to_device(mb, torch.device("cuda")) for mb in step] for step in steps]
        return iter(steps)
    workers = 0 if mode == "inline" else args.workers
    pin = args.device == "cuda"
    return iter(build_loader(ds, sampler, workers=workers, prefetch=args.prefetch, pin_memory=pin))


def run_steps(model, opt, ds: Dataset, mode: str, args) -> float:
    """Median step time (s) of one run after warm-up; the clock includes waiting for data."""
    device = torch.device(args.device)
    autocast = (
        torch.autocast(device.type, dtype=getattr(torch, args.dtype))
        if args.dtype != "float32"
        else contextlib.nullcontext()
    )
    times, it = [], batches(ds, mode, args)
    for s in range(args.steps):
        t0 = time.perf_counter()
        step = next(it)
        n_tokens = sum(mb[1].numel() for mb in step)
        for x, y in step:
            x, y = to_device(x, device), to_device(y, device)
            with autocast:
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") / n_tokens
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if s >= args.warmup:
            times.append(time.perf_counter() - t0)
    del it  # ends the workers
    return statistics.median(times)


def delivery(ds: Dataset, workers: int, args) -> float:
    """Tokens/s of the loader alone (no training)."""
    sampler = sampler_for(ds, args, steps=args.delivery_steps)
    loader = iter(build_loader(ds, sampler, workers=workers, prefetch=args.prefetch))
    next(loader)  # worker start-up is not the rate
    t0, tokens = time.perf_counter(), 0
    for step in loader:
        tokens += sum(mb[1].numel() for mb in step)
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default="", help="a prepared corpus (default: the stdlib, bytes, prepared here)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--delivery-steps", type=int, default=200, help="steps of the delivery measurement")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="global batch (samples per step)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="autocast dtype on the device (bfloat16 on GPU)")
    p.add_argument("--skip-step", action="store_true", help="only measure delivery")
    p.add_argument("--trainer", action="store_true", help="only the comparison through paratrain.train")
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - args.workers))  # leave the workers a core each
    with tempfile.TemporaryDirectory() as tmp:
        corpus = args.corpus
        if not corpus:
            corpus = os.path.join(tmp, "stdlib")
            root = sysconfig.get_paths()["stdlib"]
            prepare([os.path.join(root, "json"), os.path.join(root, "email")], out_dir=corpus, tokenizer="bytes")
        tokens = build_tokens(path=corpus, block_size=args.block_size)
        datasets = {"tokens": tokens, "sleep5ms": Sleepy(tokens)}
        print(f"corpus {corpus}: {tokens.description['sources'][0]['tokens']} tokens, vocab {tokens.vocab_size}")
        if args.trainer:
            return trainer_mode(corpus, tokens.vocab_size, args, tmp)

        for name, ds in datasets.items():
            rates = {w: delivery(ds, w, args) for w in (0, 1, args.workers)}
            print(f"delivery {name}: " + ", ".join(f"{w} workers {r / 1e3:.1f} k tokens/s" for w, r in rates.items()))
        if args.skip_step:
            return
        torch.manual_seed(0)
        model = build_gpt(**MODELS[args.model], block_size=args.block_size, vocab_size=tokens.vocab_size)
        model = model.to(args.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        modes = ["memory", "workers", "inline"]
        for name, ds in datasets.items():
            res: dict[str, list[float]] = {m: [] for m in modes}
            for r in range(args.runs):
                for m in modes if r % 2 == 0 else modes[::-1]:  # alternate the order
                    res[m].append(run_steps(model, opt, ds, m, args))
            mem = res["memory"]
            consumed = args.batch * args.block_size / statistics.median(mem)
            print(f"{name}: the main job consumes {consumed / 1e3:.1f} k tokens/s (batches in memory)")
            for m in modes:
                ratios = [a / b for a, b in zip(res[m], mem)]
                print(
                    f"  {m:8s} median step {statistics.median(res[m]) * 1e3:8.2f} ms;"
                    f" / memory: median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f},"
                    f" {args.runs} paired runs)"
                )


if __name__ == "__main__":
    main()
